"""Per-request sampling parameters, validated before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > 0:
            raise NotImplementedError(
                "sampling with temperature > 0 is not implemented yet; pass temperature=0 "
                "for greedy decoding"
            )

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        params = dict(params or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"unsupported sampling parameter(s) {unknown}; supported: {sorted(known)}"
            )
        return cls(**params)
