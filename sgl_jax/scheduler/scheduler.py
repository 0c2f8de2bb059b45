"""The scheduler: one step = schedule -> launch -> settle the step before.

Extend batches (new prompts, chunked prefill, recomputation after retraction) have priority;
otherwise every running request decodes one token. All state here is host-side and owned by
the engine loop's thread.

The loop runs one step ahead of its results (`overlap`): step N+1 is dispatched before step
N's tokens are read, its decode inputs taken on the device from the tokens step N sampled
(the runner's per-slot last tokens), so the host's work on step N's results (stop rules,
text, streaming, freeing pages) runs while the device computes step N+1. What the host needs
before a step is known without the tokens: lengths, pages and sampling positions advance
when a step is launched (`Req.num_inflight` counts the tokens not read yet). A request that
ends at step N (EOS, a stop string) may have run in step N+1: that row is dropped when
settled, so nothing it emits changes; its pages and slot are released when step N is
settled, and any later step that reuses them is dispatched after step N+1, so the device
runs them in order. A step that needs the host's view of every token settles first:
retraction, and decode batches with a grammar-constrained request (its matcher must take
the last token before it can mask the next). Speculative rounds run synchronously.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sgl_jax.grammar import allow_eos_at_dead_ends, fill_bitmasks, fill_tree_bitmasks
from sgl_jax.layers.sampler import SamplingBatch
from sgl_jax.model_executor.forward_batch import SeqChunk, build_decode_batch
from sgl_jax.model_executor.model_runner import (
    ModelRunner,
    PendingStep,
    StepOutput,
    _pad_rows,
    bitmask_words,
    greedy_sampling_batch,
)
from sgl_jax.scheduler.cache_manager import CacheManager
from sgl_jax.scheduler.decode_manager import DecodeManager
from sgl_jax.scheduler.prefill_manager import PrefillLimits, PrefillManager
from sgl_jax.scheduler.req import Req
from sgl_jax.scheduler.slot_table import SlotTable
from sgl_jax.speculative.drafts import TreeShape
from sgl_jax.speculative.policy import PLAIN, SpeculationPolicy
from sgl_jax.speculative.spec_runner import (
    CATCH_UP_WIDTH,
    CatchUpRow,
    RoundOutput,
    RoundRow,
    SpecRunner,
)
from sgl_jax.speculative.stats import AcceptanceStats

logger = logging.getLogger(__name__)

# Called after each step for every request that produced a token or finished:
# (request, new text, new token ids).
OutputCallback = Callable[[Req, str, list[int]], None]


@dataclass
class LaunchedStep:
    """A dispatched extend or decode step whose results the host has not read yet."""

    kind: str  # "prefill" or "decode"
    rows: list[tuple[Req, int, bool]]  # (request, tokens computed, whether it samples one)
    output: PendingStep | _Ready


@dataclass(frozen=True)
class _Ready:
    """Results read already (a step that ran synchronously)."""

    output: StepOutput

    def result(self) -> StepOutput:
        return self.output


@dataclass
class SchedulerStats:
    num_prefill_tokens: int = 0
    num_generated_tokens: int = 0
    num_decode_steps: int = 0
    last_log_time: float = 0.0
    last_log_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: CacheManager,
        limits: PrefillLimits,
        *,
        on_output: OutputCallback,
        decode_log_interval: int = 40,
        spec: SpecRunner | None = None,
        adaptive_speculation: bool = True,
        overlap: bool = True,
    ):
        self.runner = runner
        self.vocab_size = runner.config.vocab_size
        self.cache = cache
        self.spec = spec  # speculative decoding: decode steps become verify rounds
        self.spec_stats = None if spec is None else AcceptanceStats(spec.shape.num_steps)
        # Each round's draft shape: the flags' one, or the adaptive policy's choice.
        self.policy = None if spec is None else SpeculationPolicy(
            spec.shapes, spec.shape, spec.round_seconds, adaptive=adaptive_speculation)
        self.prefill = PrefillManager(
            cache, limits, on_admit=None if spec is None or not spec.defers_draft
            else self._choose_drafting)
        self.decode = DecodeManager(cache, self._retract, settle=self._settle,
                                    lookahead=1 if spec is None else spec.lookahead)
        self.running: list[Req] = []
        self.on_output = on_output
        self.decode_log_interval = decode_log_interval
        self.stats = SchedulerStats(last_log_time=time.perf_counter())
        self._free_slots = list(range(limits.max_running_requests - 1, -1, -1))
        self.slot_table = SlotTable(limits.max_running_requests, runner.buckets.pages_per_seq,
                                    self.vocab_size)
        # Run a step ahead of the results (speculative rounds do not yet).
        self.overlap = overlap and spec is None
        self._in_flight: LaunchedStep | None = None

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: Req) -> None:
        if self.spec is not None:
            req.spec_stats = AcceptanceStats(self.spec.shape.num_steps)
            req.spec_acceptance = self.policy.new_request()
        if req.params.max_new_tokens == 0:  # nothing to generate: done without touching KV
            req.finish_reason = {"type": "length", "length": 0}
            req.finished_at = req.created_at
            self.on_output(req, "", [])
            return
        self.prefill.add(req)

    def _choose_drafting(self, req: Req, batch_size: int) -> None:
        """At admission: whether the request gets a draft (policy.admits_draft). Only where
        plain rounds leave the draft behind: a draft that extends every round cannot start
        late."""
        req.drafting = self.policy.admits_draft(self.runner.buckets.batch_padding(batch_size),
                                                req.rid, sum(r.drafting for r in self.running))

    def abort(self, rid: str, message: str = "aborted by the client") -> bool:
        for queue in (self.prefill.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.abort(message)
                    self._finish(req)
                    self.on_output(req, "", [])
                    return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.prefill.waiting or self._in_flight)

    # ------------------------------------------------------------------ the step

    def step(self) -> None:
        batch, kind = self._schedule()
        if kind == "decode" and self.spec is not None:
            self._verify_round([req for req, _ in batch])
            return
        launched = self._launch(batch, kind) if batch else None
        self._settle()  # the step before, while the device runs this one
        self._in_flight = launched
        if not self.overlap:
            self._settle()

    def _schedule(self) -> tuple[list[tuple[Req, int]], str]:
        batch = self.prefill.schedule(self.running)
        if batch:
            for req, _ in batch:
                self._assign_slot(req)
            return batch, "prefill"
        if self._in_flight is not None and any(r.grammar is not None for r in self.running):
            self._settle()  # a matcher takes the last token before it masks the next
        batch = self.decode.schedule(self.running)
        if batch:
            return batch, "decode"
        if self.running and self._in_flight is None:
            # Partial prefills hold every page: make room for the others.
            self._retract(self.running.pop())
        return [], "idle"

    def _launch(self, batch: list[tuple[Req, int]], kind: str) -> LaunchedStep:
        """Dispatch the batch; lengths advance now, tokens are read when it is settled."""
        if kind == "decode":
            return self._launch_decode([req for req, _ in batch])
        rows = [(req, n, n == req.tokens_to_compute) for req, n in batch]
        chunks = [SeqChunk(self._input_ids(req, n), req.kv_len, req.page_ids,
                           state_slot=req.state_slot) for req, n in batch]
        emits = np.array([emits for _, _, emits in rows])
        want_top = any(req.top_logprobs_num > 0 for req, _ in batch)
        sampling = sampling_batch(batch, self.vocab_size)
        if self.spec is not None:
            output = _Ready(self._spec_prefill(batch, chunks, sampling, emits, want_top))
        else:
            output = self.runner.step(
                chunks, sampling, np.array([_penalty_slot(req) for req, _ in batch], np.int32),
                emits, want_top, slots=np.array([req.slot for req, _ in batch], np.int32),
                want_logprobs=any(req.return_logprob for req, _ in batch))
        for req, n, emit in rows:
            req.kv_len += n
            req.num_inflight += emit
        return LaunchedStep(kind, rows, output)

    def _launch_decode(self, reqs: list[Req]) -> LaunchedStep:
        """One token for every request, the batch built from row arrays (SlotTable)."""
        n = len(reqs)
        shape = self.runner.buckets.decode_shape(n)
        slots = np.fromiter((r.slot for r in reqs), np.int32, n)
        num_sampled = np.fromiter((r.num_sampled for r in reqs), np.int32, n)
        batch = build_decode_batch(
            np.fromiter((-1 if r.num_inflight else r.last_token for r in reqs), np.int32, n),
            np.fromiter((r.kv_len for r in reqs), np.int32, n),
            self.slot_table.page_rows(reqs),
            np.fromiter((r.state_slot for r in reqs), np.int32, n),
            page_size=self.runner.page_size, shape=shape)
        sampling, penalty_slots = self.slot_table.sampling_rows(reqs, slots, num_sampled,
                                                                shape.num_logits)
        rows = shape.num_logits
        output = self.runner.launch(
            batch, sampling, penalty_slots, _pad_rows(slots, rows, fill=-1),
            np.arange(rows) < n, n,
            want_top_logprobs=any(r.top_logprobs_num for r in reqs),
            want_logprobs=any(r.return_logprob for r in reqs))
        for req in reqs:
            req.kv_len += 1
            req.num_inflight += 1
        return LaunchedStep("decode", [(req, 1, True) for req in reqs], output)

    @staticmethod
    def _input_ids(req: Req, n: int) -> list[int]:
        """The chunk's tokens; a decode row whose last token is still on the device reads it
        there (-1)."""
        if not req.num_inflight:
            return req.token_slice(req.kv_len, req.kv_len + n)
        if n != 1:
            raise RuntimeError(f"request {req.rid}: an extend chunk after unread tokens")
        return [-1]

    def _settle(self) -> bool:
        """Read the step in flight (if any) and act on its tokens; True if there was one."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return False
        self._postprocess(launched.rows, launched.output.result(), launched.kind)
        return True

    def _spec_prefill(self, batch, chunks, sampling, emits, want_top) -> StepOutput:
        """Target and draft extend together (the target alone where no request of the batch
        has a draft); completed prompts get their first draft tree's root."""
        after = [req.token_slice(req.kv_len + n, req.kv_len + n + 1) for req, n in batch]
        next_tokens = [ids[0] if ids else 0 for ids in after]
        output, roots = self.spec.prefill(chunks, sampling, emits, want_top, next_tokens,
                                          run_draft=any(req.drafting for req, _ in batch))
        for row, (req, _) in enumerate(batch):
            if emits[row]:
                req.draft_root = roots[row]
        return output

    def _verify_round(self, reqs: list[Req]) -> None:
        """One speculative round for every decoding request, in the shape the policy picks:
        draft, verify, emit, extend the draft (a plain round may leave that to a catch-up).
        A batch holding a grammar-constrained request takes a plain round or the flags'
        shape with every tree node masked by the grammar."""
        want_top = any(req.top_logprobs_num > 0 for req in reqs)
        bucket = self.runner.buckets.batch_padding(len(reqs))
        constrained = [row for row, req in enumerate(reqs) if req.grammar is not None]
        records = [req.spec_acceptance if req.drafting else None for req in reqs]
        shape = self.policy.choose(records, bucket,
                                   menu=self._constrained_menu(reqs) if constrained else None)
        if shape != PLAIN:
            self._catch_up_drafts(reqs)
        rows = [RoundRow(req.page_ids, req.kv_len, req.token_slice(req.kv_len, req.kv_len + 1)[0],
                         req.draft_root, max(req.params.min_new_tokens - len(req.output_ids), 0),
                         req.state_slot)
                for req in reqs]
        sampling = sampling_batch([(req, 1) for req in reqs], self.vocab_size)
        masked = bool(constrained) and shape != PLAIN
        start = time.perf_counter()
        if masked:
            tree = self.spec.draft_trees(rows, sampling)
            output = self.spec.masked_verify(
                rows, sampling, want_top, tree,
                self._tree_masks(reqs, constrained, tree.tokens, tree.parents))
        elif shape == PLAIN and not any(req.drafting for req in reqs):
            output = self.spec.undrafted_round(rows, sampling, want_top)
        else:
            output = self.spec.round(rows, sampling, want_top, shape)
        accepted = [int(a) for a in output.num_accepted]
        self.policy.observe(shape, bucket, time.perf_counter() - start,
                            list(zip(records, accepted, strict=True)), masked=masked)
        emitted = 0
        for row, req in enumerate(reqs):
            self.spec_stats.record(accepted[row], shape.num_steps)
            req.spec_stats.record(accepted[row], shape.num_steps)
            text, tokens = self._emit_run(req, output, row, accepted[row] + 1)
            emitted += len(tokens)
            req.kv_len += len(tokens)  # the root and the accepted nodes are now in the cache
            if output.features is None:
                req.draft_root = output.root_hidden[row]
            elif req.drafting:  # the draft is one more token behind
                req.draft_pending.append(output.features[row])
            if req.finished:
                self.running.remove(req)
                self._finish(req)
            self.on_output(req, text, tokens)
        if any(len(req.draft_pending) >= CATCH_UP_WIDTH for req in self.running):
            self._catch_up_drafts(self.running)
        self._log_decode(emitted)

    def _catch_up_drafts(self, reqs: list[Req]) -> None:
        """Extend the drafts that plain rounds left behind over their pending tokens."""
        behind = [req for req in reqs if req.draft_pending]
        if not behind:
            return
        rows = [CatchUpRow(req.page_ids, req.draft_len,
                           req.token_slice(req.draft_len + 1, req.kv_len + 1),
                           np.stack(req.draft_pending))
                for req in behind]
        roots = self.spec.catch_up(rows)
        for req, root in zip(behind, roots, strict=True):
            req.draft_root = root
            req.draft_pending.clear()

    def _constrained_menu(self, reqs: list[Req]) -> tuple[TreeShape, ...]:
        """Shapes a batch with grammar-constrained requests may take. Masked trees need the
        matcher's view of every node, which min_new_tokens' EOS suppression below the root
        would contradict, so such a request keeps its batch on plain rounds until it is past
        min_new_tokens."""
        if any(req.grammar is not None and req.suppressing_eos for req in reqs):
            return (PLAIN,)
        return (PLAIN, self.spec.shape)

    def _tree_masks(self, reqs: list[Req], constrained: list[int], tokens: np.ndarray,
                    parents: np.ndarray) -> np.ndarray:
        """i32[B, N, W] over the padded batch: every id for free rows; for a constrained row
        the ids its grammar allows after each node's path (EOS alone at a dead end)."""
        masks = np.full((*tokens.shape, bitmask_words(self.vocab_size)), -1, np.int32)
        for row in constrained:
            fill_tree_bitmasks(reqs[row].grammar, tokens[row], parents[row], masks[row])
            allow_eos_at_dead_ends(masks[row], reqs[row].eos_ids)
        return masks

    @staticmethod
    def _emit_run(req: Req, output: RoundOutput, row: int, count: int) -> tuple[str, list[int]]:
        """Append a round's tokens one by one, stopping where the request finishes (EOS, a
        stop string, max_new_tokens or the context) so nothing past it is emitted."""
        text, tokens = "", []
        for j in range(count):
            token = int(output.tokens[row, j])
            top = []
            if req.top_logprobs_num:
                ids, values = output.top_logprob_ids[row, j], output.top_logprobs[row, j]
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            text += req.append_token(token, float(output.logprobs[row, j]), top)
            tokens.append(token)
            if req.finished:
                break
        return text, tokens

    def _postprocess(self, rows: list[tuple[Req, int, bool]], output: StepOutput,
                     kind: str) -> None:
        """Append each emitting row's token; a request that ended while the step ran (it
        stopped at the step before, or was aborted) drops its token."""
        tokens = output.tokens.tolist()
        logprobs = output.logprobs.tolist() if output.logprobs is not None else None
        for row, (req, _, emits) in enumerate(rows):
            if not emits:
                continue
            req.num_inflight -= 1
            if req.finished:
                continue
            top = _top_logprobs(output, row) if req.top_logprobs_num else []
            token = tokens[row]
            text = req.append_token(token, logprobs[row] if logprobs else 0.0, top)
            if req.finished:
                self.running.remove(req)
                self._finish(req)
            self.on_output(req, text, [token])
        self._log(rows, kind)

    # ------------------------------------------------------------------ bookkeeping

    def _assign_slot(self, req: Req) -> None:
        """A request gets its row of the device's per-request state when first admitted. It
        keeps it through retraction; admission is first come first served, so running plus
        retracted requests never outnumber the slots (max_running_requests)."""
        if req.slot < 0:
            req.slot = self._free_slots.pop()
            self.slot_table.join(req)
            if req.params.uses_penalties:
                self.runner.reset_penalty_slot(req.slot, req.prompt_ids)

    def _retract(self, req: Req) -> None:
        """Free a running request's pages (and state slot); it recomputes its tokens when
        readmitted."""
        self.cache.release(req)
        req.kv_len = 0
        req.draft_pending.clear()  # the prompt's recomputation extends the draft too
        self.prefill.requeue(req)
        logger.info("Retracted request %s (KV cache full): %d tokens to recompute", req.rid,
                    len(req.all_ids))

    def _finish(self, req: Req) -> None:
        req.finished_at = time.perf_counter()
        if self.policy is not None:
            self.policy.count_finished(req.drafting)
        self.cache.release(req)
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    def _log(self, batch: list[tuple[Req, int, bool]], kind: str) -> None:
        stats = self.stats
        usage = self.cache.used_pages / self.cache.allocator.capacity
        if kind == "prefill":
            new_tokens = sum(n for _, n, _ in batch)
            stats.num_prefill_tokens += new_tokens
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                "token usage: %.2f, #running-req: %d, #queue-req: %d",
                len(batch), new_tokens, sum(r.cached_tokens for r, _, _ in batch), usage,
                len(self.running), len(self.prefill.waiting),
            )
            return
        self._log_decode(len(batch))

    def _log_decode(self, num_tokens: int) -> None:
        stats = self.stats
        stats.num_decode_steps += 1
        stats.num_generated_tokens += num_tokens
        if stats.num_decode_steps % self.decode_log_interval:
            return
        now = time.perf_counter()
        rate = (stats.num_generated_tokens - stats.last_log_tokens) / (now - stats.last_log_time)
        stats.last_log_time, stats.last_log_tokens = now, stats.num_generated_tokens
        usage = self.cache.used_pages / self.cache.allocator.capacity
        spec = ""
        if self.spec_stats is not None:
            rates = ", ".join(f"{r:.2f}" for r in self.spec_stats.acceptance_rates)
            spec = f"accept len: {self.spec_stats.accept_length:.2f}, acc: [{rates}], "
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %s"
            "gen throughput (token/s): %.2f, #queue-req: %d",
            len(self.running), sum(r.kv_len for r in self.running), usage, spec, rate,
            len(self.prefill.waiting),
        )


def _penalty_slot(req: Req) -> int:
    """The request's row of the device penalty state, or -1 for a request without
    penalties (the sampler then skips them)."""
    return req.slot if req.params.uses_penalties else -1


def _top_logprobs(output: StepOutput, row: int) -> list[tuple[int, float]]:
    ids, values = output.top_logprob_ids[row].tolist(), output.top_logprobs[row].tolist()
    return list(zip(ids, values, strict=True))


def sampling_batch(batch: list[tuple[Req, int]], vocab_size: int) -> SamplingBatch:
    """Host arrays of each row's sampling parameters; a constrained row's grammar writes the
    ids it allows next."""
    params = [req.params for req, _ in batch]
    greedy = greedy_sampling_batch(len(batch), vocab_size)
    suppress, allowed = greedy.suppress_ids, greedy.allowed
    bias_ids, bias_values = greedy.bias_ids, greedy.bias_values
    for row, (req, _) in enumerate(batch):
        if req.suppressing_eos:
            ids = sorted(req.stop_ids())
            suppress[row, : len(ids)] = ids
        if req.params.logit_bias:
            ids, values = zip(*req.params.logit_bias, strict=True)
            bias_ids[row, : len(ids)], bias_values[row, : len(ids)] = ids, values
    constrained = [(req.grammar, row) for row, (req, _) in enumerate(batch)
                   if req.grammar is not None]
    if constrained:
        fill_bitmasks(constrained, allowed)
    for grammar, row in constrained:
        if grammar.is_stopped():  # complete: it may end now, whatever min_new_tokens says
            suppress[row] = -1
        allow_eos_at_dead_ends(allowed[row], batch[row][0].eos_ids)
    return dataclasses.replace(  # suppress, bias and grammar arrays filled in place above
        greedy,
        temperature=np.array([p.temperature for p in params], np.float32),
        top_p=np.array([p.top_p for p in params], np.float32),
        top_k=np.array([p.top_k for p in params], np.int32),
        min_p=np.array([p.min_p for p in params], np.float32),
        frequency_penalty=np.array([p.frequency_penalty for p in params], np.float32),
        presence_penalty=np.array([p.presence_penalty for p in params], np.float32),
        repetition_penalty=np.array([p.repetition_penalty for p in params], np.float32),
        seed=np.array([req.seed for req, _ in batch], np.uint32),
        position=np.array([req.num_sampled for req, _ in batch], np.int32),
    )
