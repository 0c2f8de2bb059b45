"""Acceptance counters: per request (meta_info) and server-wide (/get_server_info, /metrics).

Only speculative rounds count: a plain round (the adaptive policy's choice) drafts nothing."""

from __future__ import annotations

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
