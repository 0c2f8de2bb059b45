"""Req: one generation request's host-side state, and the rules that finish it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sgl_jax.sampling_params import SamplingParams
from sgl_jax.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the request's sampling seed (its own, or drawn by the engine)
    eos_ids: frozenset[int]
    context_len: int
    detokenizer: IncrementalDetokenizer  # the output side's (entrypoints/outputs.py) alone
    return_logprob: bool = False
    top_logprobs_num: int = 0

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None

    # KV bookkeeping, owned by the cache manager.
    page_ids: list[int] = field(default_factory=list)
    kv_len: int = 0  # leading tokens of all_ids whose K/V are in the cache
    cached_tokens: int = 0  # tokens the prefix cache served at admission
    prefix_node: Any = None  # radix-cache handle locked while the request holds its pages
    # Row of the device's per-request state (last sampled token, penalty counts), from first
    # admission to finish (kept through retraction); -1 = none yet.
    slot: int = -1
    # Tokens the device has sampled for this request that the host has not read yet (the
    # engine loop runs a step ahead of its results): they count in kv_len and the lengths a
    # step is scheduled by, but not yet in output_ids.
    num_inflight: int = 0
    # Tokens beyond num_inflight that unread steps may have committed (a speculative round
    # counts its root in num_inflight and kv_len; the round decides how many of its depth more).
    inflight_extra: int = 0
    state_slot: int = 0  # hybrid models: slot of the recurrent-state pool; 0 = none held
    grammar: Any = None  # constrained requests: their sgl_jax.grammar.Constraint

    # What the decoding reports of the request in its meta_info (a speculative one: its
    # rounds' acceptance), written when the request finishes.
    decoding_info: dict[str, Any] = field(default_factory=dict)

    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def last_token(self) -> int:
        """The last token the host has read (the prompt's last before any output)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (a decode step needs one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : stop - n]
        return self.prompt_ids[start:stop] + self.output_ids[: max(stop - n, 0)]

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, read by the host or not: the output position of the
        next token a step samples."""
        return len(self.output_ids) + self.num_inflight

    @property
    def tokens_to_compute(self) -> int:
        """Tokens whose K/V are still missing; the last one's logits give the next token."""
        return len(self.prompt_ids) + self.num_sampled - self.kv_len

    @property
    def decodes_next(self) -> bool:
        """Whether a decode step takes it: its prompt is computed (one token left to compute,
        the last sampled) and the tokens sampled do not reach max_new_tokens or the context
        (else it ends once the host reads them and needs no further step). Worked out in one
        pass: the scheduler asks it of every running request each step."""
        sampled = len(self.output_ids) + self.num_inflight
        return (len(self.prompt_ids) + sampled - self.kv_len == 1
                and sampled < self.output_limit)

    @property
    def tokens_left(self) -> int:
        """The most tokens it may still sample: up to max_new_tokens or the context's end."""
        return self.output_limit - self.num_sampled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def suppressing_eos(self) -> bool:
        """Whether the next token a step samples must not be EOS (min_new_tokens)."""
        return self.num_sampled < self.params.min_new_tokens

    def __post_init__(self) -> None:
        # What ends the request by token, fixed at creation (append_tokens reads them for
        # every token): its stop ids, and the most output tokens it may hold (max_new_tokens,
        # or up to the context's end).
        eos = frozenset() if self.params.ignore_eos else self.eos_ids
        self._stop_ids = eos | frozenset(self.params.stop_token_ids)
        self.output_limit = min(self.params.max_new_tokens,
                                 self.context_len - len(self.prompt_ids))

    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids

    def append_tokens(self, tokens: list[int], logprobs: list[float] | None = None,
                      tops: list[list[tuple[int, float]]] | None = None) -> int:
        """Record sampled tokens up to where the request finishes, if it does; returns how
        many it took. The rules by token are checked here (EOS and stop ids, max_new_tokens,
        the context, a grammar); stop strings are the output side's (its detokenizer ends the
        request through the engine, entrypoints/outputs.py)."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        for count, token in enumerate(tokens, start=1):
            self.output_ids.append(token)
            if self.return_logprob:
                self.output_logprobs.append(logprobs[count - 1] if logprobs else 0.0)
                self.output_top_logprobs.append(
                    tops[count - 1][: self.top_logprobs_num] if tops else [])
            if self.grammar is not None:
                self.finish_reason = self._grammar_rejection(token) or self._finish_reason(token)
            elif (token in self._stop_ids
                  or len(self.output_ids) >= self.output_limit):  # the common case: neither
                self.finish_reason = self._finish_reason(token)
            if self.finish_reason is not None:
                return count
        return len(tokens)

    def end(self, reason: dict[str, Any]) -> None:
        """Finish now for `reason` (an abort, or a stop string the output side found)."""
        self.finish_reason = reason

    def _grammar_rejection(self, token: int) -> dict[str, Any] | None:
        """Advance the grammar. A matcher that cannot take the token (it reached a dead end:
        the step could only end the output) ends the request and says why."""
        if self.grammar is None:
            return None
        if self.grammar.consume_token(token) and not self.grammar.is_error():
            return None
        return {"type": "grammar_error",
                "message": "the grammar allows no token here (a dead end); the output ends"}

    def _finish_reason(self, token: int) -> dict[str, Any] | None:
        if token in self._stop_ids and len(self.output_ids) >= self.params.min_new_tokens:
            return {"type": "stop", "matched": token}
        if self.grammar is not None and self.grammar.is_stopped():
            return {"type": "stop", "matched": None}  # the grammar is complete
        if len(self.output_ids) >= self.params.max_new_tokens:
            return {"type": "length", "length": self.params.max_new_tokens}
        if len(self.prompt_ids) + len(self.output_ids) >= self.context_len:
            return {"type": "length", "length": len(self.output_ids)}
        return None
