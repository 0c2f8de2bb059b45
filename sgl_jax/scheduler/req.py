"""Req: one generation request's host-side state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl_jax.sampling_params import SamplingParams


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token: int, eos_ids: frozenset[int]) -> None:
        self.output_ids.append(token)
        if token in eos_ids and not self.params.ignore_eos:
            self.finish_reason = {"type": "stop", "matched": token}
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.params.max_new_tokens}
