"""The decoding interface the scheduler drives, and plain decoding, its first implementation.

The scheduler decides which requests run (admission, chunked prefill, retraction) and when a
step's results are read; a `Decoding` decides how the step runs on the device and what its
results append to each request. Plain decoding samples one token per request per step;
speculative decoding (speculative/decode_loop.py) runs draft-and-verify rounds behind the same
methods. The scheduler knows no more of either than this interface.

A step is launched, then settled a step later (the loop runs one step ahead of its results):
`plan_decode` says whether the step in flight must be read first (a round that needs the
host's view of every token), `launch_*` dispatches without waiting, and `settle` reads the
results and appends each request's new tokens, up to where it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sgl_jax.layers.sampler import SamplingBatch, logprob_detail
from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner, PendingStep, StepOutput
from sgl_jax.scheduler.page_reuse import PageReuse, ReuseEveryPage
from sgl_jax.scheduler.req import Req
from sgl_jax.scheduler.slot_table import SlotTable

# What a settled step hands back, per request that produced tokens: (request, new token ids,
# whether they finished it).
Emitted = list[tuple[Req, list[int], bool]]


@dataclass
class LaunchedStep:
    """A dispatched step whose results the host has not read yet."""

    kind: str  # "prefill" or "decode"
    reqs: list[Req]  # a request per row, in order
    output: Any  # the decoding's handle on the results (PendingStep, or a round's)
    # An extend step's rows: (request, tokens computed, whether it samples one). None for a
    # decode step, whose rows each compute one token and sample it.
    chunks: list[tuple[Req, int, bool]] | None = None

    @property
    def emits(self) -> list[bool] | None:
        """Whether each row samples a token (None: every row does)."""
        return None if self.chunks is None else [emits for _, _, emits in self.chunks]


@dataclass(frozen=True)
class PrefillBatch:
    """An extend step's host inputs, one row per chunk."""

    rows: list[tuple[Req, int, bool]]  # (request, tokens in its chunk, completes its prompt)
    chunks: list[SeqChunk]
    sampling: SamplingBatch  # host arrays, one row per chunk
    penalty_slots: np.ndarray  # i32[n]: -1 for requests without penalties
    emits: np.ndarray  # bool[n]: the chunk completes its request's prompt
    slots: np.ndarray  # i32[n]: request slots

    @property
    def reqs(self) -> list[Req]:
        return [req for req, _, _ in self.rows]


@dataclass(frozen=True)
class DecodePlan:
    """How the next decode step will run, decided before it is launched."""

    settle_first: bool  # the step in flight must be read before this one is launched
    detail: Any = None  # the decoding's own choice (a round's shape)


class Decoding(Protocol):
    lookahead: int  # KV slots past kv_len a decode step may write
    page_reuse: PageReuse  # which pages of a cached prefix a request may read

    def add_request(self, req: Req) -> None: ...

    def admit(self, req: Req, batch_size: int, running: list[Req]) -> None:
        """A request is about to be admitted into a batch of `batch_size`."""

    def batch_limit(self, wanted: int) -> int:
        """The most requests a decode step may take now without waiting for a compile; the
        programs `wanted` requests would need are built in the background meanwhile."""

    def prefill_limit(self, wanted: int) -> int:
        """The same for the tokens of an extend batch."""

    def launch_prefill(self, batch: PrefillBatch) -> PendingStep: ...

    def plan_decode(self, reqs: list[Req], in_flight: LaunchedStep | None) -> DecodePlan: ...

    def launch_decode(self, reqs: list[Req], plan: DecodePlan) -> Any: ...

    def settle(self, launched: LaunchedStep) -> Emitted: ...

    def retract(self, req: Req) -> None: ...

    def flush(self) -> None:
        """Forget what finished requests left behind (the engine's flush_cache)."""

    def finish(self, req: Req) -> None:
        """A request ends (finished, aborted); its pages are released already."""

    def log_fields(self) -> str:
        """Figures for the scheduler's periodic decode log line ("" for none)."""

    def server_info(self) -> dict[str, Any]: ...


class PlainDecoding:
    """One token per request per step: the target's sampling step (ModelRunner)."""

    lookahead = 1

    def __init__(self, runner: ModelRunner, slot_table: SlotTable):
        self.runner = runner
        self.slot_table = slot_table
        self.page_reuse = ReuseEveryPage()

    def add_request(self, req: Req) -> None:
        pass

    def admit(self, req: Req, batch_size: int, running: list[Req]) -> None:
        pass

    def batch_limit(self, wanted: int) -> int:
        return self.runner.decode_batch_limit(wanted)

    def prefill_limit(self, wanted: int) -> int:
        return self.runner.prefill_token_limit(wanted)

    def launch_prefill(self, batch: PrefillBatch) -> PendingStep:
        reqs = batch.reqs
        return self.runner.step(
            batch.chunks, batch.sampling, batch.penalty_slots, batch.emits,
            any(req.top_logprobs_num for req in reqs), slots=batch.slots,
            want_logprobs=any(req.return_logprob for req in reqs))

    def plan_decode(self, reqs: list[Req], in_flight: LaunchedStep | None) -> DecodePlan:
        return DecodePlan(settle_first=False)

    def launch_decode(self, reqs: list[Req], plan: DecodePlan) -> PendingStep:
        return dispatch_decode_step(self.runner, self.slot_table, reqs)

    def settle(self, launched: LaunchedStep) -> Emitted:
        return emit_tokens(launched.reqs, launched.output.result(), launched.emits)

    def retract(self, req: Req) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, req: Req) -> None:
        pass

    def log_fields(self) -> str:
        return ""

    def server_info(self) -> dict[str, Any]:
        return {}


def dispatch_decode_step(runner: ModelRunner, slot_table: SlotTable, reqs: list[Req],
                         padded: int | None = None, want_features: bool = False
                         ) -> PendingStep:
    """One token for every request, its rows gathered from the slot table and padded to batch
    bucket `padded` (default: the smallest that fits); lengths advance now, the token is read
    when the step is settled (with `want_features`, each row's features for a drafter that
    plain steps leave behind too)."""
    n = len(reqs)
    slots = slot_table.slots_of(reqs, runner.buckets.batch_padding(padded or n))
    want_top = any(r.top_logprobs_num for r in reqs)
    want_logprobs = any(r.return_logprob for r in reqs)
    ints, floats, allowed = slot_table.decode_rows(reqs, slots,
                                                   logprob_detail(want_logprobs, want_top))
    output = runner.launch_decode(ints, floats, allowed, n, want_top_logprobs=want_top,
                                  want_logprobs=want_logprobs, want_features=want_features)
    for req in reqs:
        req.kv_len += 1
        req.num_inflight += 1
    return output


def emit_tokens(reqs: list[Req], output: StepOutput, emits: list[bool] | None = None
                ) -> Emitted:
    """Append each emitting row's token (`emits`: whether each row samples one, None: every
    row does); a request that ended while the step ran (it stopped at the step before, or
    was aborted) drops its token."""
    tokens = output.tokens.tolist()
    if emits is None and output.logprobs is None and output.top_logprob_ids is None:
        return _emit_one_each(reqs, tokens)
    logprobs = output.logprobs.tolist() if output.logprobs is not None else None
    emitted = []
    for row, req in enumerate(reqs):
        if emits is not None and not emits[row]:
            continue
        req.num_inflight -= 1
        if req.finish_reason is not None:
            continue
        run = tokens[row: row + 1]
        req.append_tokens(run, logprobs and logprobs[row: row + 1],
                          _top_logprobs(output, row) if req.top_logprobs_num else None)
        emitted.append((req, run, req.finish_reason is not None))
    return emitted


def _emit_one_each(reqs: list[Req], tokens: list[int]) -> Emitted:
    """emit_tokens of a decode step that no request asked log-probabilities of: the loop
    the engine runs every step, without the per-row checks it does not need."""
    emitted = []
    for req, token in zip(reqs, tokens, strict=True):
        req.num_inflight -= 1
        if req.finish_reason is None:
            run = [token]
            req.append_tokens(run)
            emitted.append((req, run, req.finish_reason is not None))
    return emitted


def _top_logprobs(output: StepOutput, row: int) -> list[list[tuple[int, float]]]:
    """A row's top log-probabilities as append_tokens takes them (one token's)."""
    ids, values = output.top_logprob_ids[row].tolist(), output.top_logprobs[row].tolist()
    return [list(zip(ids, values, strict=True))]
