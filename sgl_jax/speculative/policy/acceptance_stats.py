"""Acceptance counters: per request (meta_info) and server-wide (/get_server_info, /metrics).

Only speculative rounds count: a plain round (the adaptive policy's choice) drafts nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


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
        """One round of several requests: record()'s counts for each row, in a few array
        operations whatever the rows (the server's counters take every round's)."""
        accepted, steps = np.asarray(num_accepted), np.asarray(steps)
        counted = steps > 0
        self.rounds += int(counted.sum())
        self.accepted_tokens += int(accepted[counted].sum())
        positions = np.arange(self.num_steps)
        for counts, reached in ((self.drafted_per_position, steps),
                                (self.accepted_per_position, accepted * counted)):
            counts[:] = (np.asarray(counts) + (positions < reached[:, None]).sum(0)).tolist()

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
