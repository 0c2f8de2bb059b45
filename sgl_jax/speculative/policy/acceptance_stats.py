"""Acceptance counters: per request (meta_info) and server-wide (/get_server_info, /metrics).

Only speculative rounds count: a plain round (the adaptive policy's choice) drafts nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    num_steps: int  # S: the deepest draft a round can take
    rounds: int = 0
    accepted_tokens: int = 0  # draft tokens accepted, bonus tokens not counted
    accepted_per_position: list[int] = field(default_factory=list)  # [S]
    drafted_per_position: list[int] = field(default_factory=list)  # [S]: rounds that reached it

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_steps
        if not self.drafted_per_position:
            self.drafted_per_position = [0] * self.num_steps

    def record(self, num_accepted: int, steps: int | None = None) -> None:
        """One verify round of `steps` draft positions (default S) that accepted
        `num_accepted` draft tokens (positions 0..a-1)."""
        steps = self.num_steps if steps is None else steps
        if steps == 0:
            return
        self.rounds += 1
        self.accepted_tokens += num_accepted
        for position in range(steps):
            self.drafted_per_position[position] += 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def record_rounds(self, num_accepted: Sequence[int], steps: Sequence[int]) -> None:
        """One round of several requests: record()'s counts for each row, in one pass over
        the rows (the server's counters take every round's)."""
        counted = [(a, s) for a, s in zip(num_accepted, steps, strict=True) if s > 0]
        self.rounds += len(counted)
        self.accepted_tokens += sum(a for a, _ in counted)
        for counts, reached in ((self.drafted_per_position, rows_reaching(
                [s for _, s in counted], self.num_steps)),
                                (self.accepted_per_position, rows_reaching(
                [a for a, _ in counted], self.num_steps))):
            counts[:] = [c + r for c, r in zip(counts, reached, strict=True)]

    @property
    def accept_length(self) -> float:
        """Tokens per verify round: accepted draft tokens plus the bonus token."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """acc_i: the fraction of the rounds that drafted position i which accepted it."""
        return [count / max(drafted, 1) for count, drafted
                in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    def server_info(self) -> dict:
        """The server-wide figures /get_server_info shows."""
        return {
            "avg_spec_accept_length": self.accept_length,
            "spec_verify_rounds": self.rounds,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_accepted_per_position": list(self.accepted_per_position),
            "spec_drafted_per_position": list(self.drafted_per_position),
            "spec_accept_rates": self.acceptance_rates,  # acc_0, acc_1, ... by position
        }


def rows_reaching(values: Sequence[int], depth: int) -> list[int]:
    """[depth]: per draft position d, how many of `values` (each >= 0: the positions a row
    reached) exceed d. A histogram and a running sum: a round's rows in one Python pass,
    cheaper than a [rows, depth] mask for the few rows and depths of a round."""
    histogram = [0] * (depth + 1)
    for value in values:
        histogram[min(value, depth)] += 1
    reaching, running = [0] * depth, 0
    for position in range(depth - 1, -1, -1):
        running += histogram[position + 1]
        reaching[position] = running
    return reaching
