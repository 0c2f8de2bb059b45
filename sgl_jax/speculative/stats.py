"""Acceptance counters: per request (meta_info) and server-wide (/get_server_info, /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    num_steps: int  # S: draft positions a round can accept
    rounds: int = 0
    accepted_tokens: int = 0  # draft tokens accepted, bonus tokens not counted
    accepted_per_position: list[int] = field(default_factory=list)  # [S]

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_steps

    def record(self, num_accepted: int) -> None:
        """One verify round that accepted `num_accepted` draft tokens (positions 0..a-1)."""
        self.rounds += 1
        self.accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def accept_length(self) -> float:
        """Tokens per verify round: accepted draft tokens plus the bonus token."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """acc_i: the fraction of rounds whose i-th draft position was accepted."""
        return [count / max(self.rounds, 1) for count in self.accepted_per_position]
