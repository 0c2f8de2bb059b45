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
the last token before it can mask the next). How a step runs on the device is the
`Decoding`'s (scheduler/decoding.py): plain decoding, or speculative rounds run ahead of their
results the same way (speculative/decode_loop.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.scheduler.cache_manager import CacheManager
from sgl_jax.scheduler.decode_manager import DecodeManager
from sgl_jax.scheduler.decoding import Decoding, Emitted, LaunchedStep, PrefillBatch
from sgl_jax.scheduler.prefill_manager import PrefillLimits, PrefillManager
from sgl_jax.scheduler.req import Req
from sgl_jax.scheduler.slot_table import SlotTable

logger = logging.getLogger(__name__)

# Called after each step with every request that produced tokens or finished: (request, its
# new token ids, whether it finished), in order. It runs on the engine thread and only hands
# them on: text, stop strings and the caller's chunks are the output side's.
OutputCallback = Callable[[list[tuple[Req, list[int], bool]]], None]


@dataclass
class StepPhase:
    """One kind of step: how many ran, their rows (requests), and the engine thread's
    seconds on them: dispatching (launch) and reading the results and acting on them
    (settle, the wait for the device included). With the loop a step ahead, a launch runs
    while the device computes the step before, so launch + settle per step above the
    device's own time is host work the device waited for."""

    steps: int = 0
    rows: int = 0
    launch_s: float = 0.0
    settle_s: float = 0.0


@dataclass
class SchedulerStats:
    num_prefill_tokens: int = 0
    num_generated_tokens: int = 0
    num_decode_steps: int = 0
    last_log_time: float = 0.0
    last_log_tokens: int = 0
    # by LaunchedStep.kind; idle_s: the engine thread waiting for work (EngineLoop)
    phases: dict[str, StepPhase] = field(
        default_factory=lambda: {"prefill": StepPhase(), "decode": StepPhase()})
    idle_s: float = 0.0

    @property
    def settle_s(self) -> float:
        return sum(phase.settle_s for phase in self.phases.values())

    def phases_info(self) -> dict[str, object]:
        """/get_server_info's `scheduler_phases`: counts and seconds since the start."""
        return {"idle_s": self.idle_s,
                **{kind: asdict(phase) for kind, phase in self.phases.items()}}


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: CacheManager,
        limits: PrefillLimits,
        slot_table: SlotTable,
        decoding: Decoding,
        *,
        on_output: OutputCallback,
        decode_log_interval: int = 40,
        overlap: bool = True,
    ):
        self.runner = runner
        self.cache = cache
        self.slot_table = slot_table
        self.decoding = decoding  # plain or speculative: how a step runs on the device
        self.prefill = PrefillManager(cache, limits, on_admit=self._admit,
                                      batch_limit=decoding.batch_limit,
                                      prefill_limit=decoding.prefill_limit)
        self.decode = DecodeManager(cache, self._retract, settle=self._settle,
                                    lookahead=decoding.lookahead)
        self.running: list[Req] = []
        self.on_output = on_output
        self.decode_log_interval = decode_log_interval
        self.stats = SchedulerStats(last_log_time=time.perf_counter())
        self._free_slots = list(range(limits.max_running_requests - 1, -1, -1))
        self.overlap = overlap  # run a step ahead of the results
        self._in_flight: LaunchedStep | None = None

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: Req) -> None:
        self.decoding.add_request(req)
        if req.params.max_new_tokens == 0:  # nothing to generate: done without touching KV
            req.finish_reason = {"type": "length", "length": 0}
            req.finished_at = req.created_at
            self.decoding.finish(req)
            self.on_output([(req, [], True)])
            return
        self.prefill.add(req)

    def _admit(self, req: Req, batch_size: int) -> None:
        self.decoding.admit(req, batch_size, self.running)

    def abort(self, rid: str, message: str = "aborted by the client") -> bool:
        return self.end(rid, {"type": "abort", "message": message})

    def end(self, rid: str, reason: dict) -> bool:
        """Finish a running or waiting request now for `reason` (an abort; a stop string the
        output side found); False if it is not here (it finished already)."""
        for queue in (self.prefill.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.end(reason)
                    self._finish(req)
                    self.on_output([(req, [], True)])
                    return True
        return False

    def abort_all(self, message: str) -> None:
        """Abort every running and waiting request (the engine stops, or a step failed)."""
        for req in list(self.running) + list(self.prefill.waiting):
            self.abort(req.rid, message)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.prefill.waiting or self._in_flight)

    def settle_if_idle(self) -> None:
        """With no request running or waiting, the step in flight holds only rows of requests
        that have finished: read it now, so the caller sees an idle scheduler."""
        if not (self.running or self.prefill.waiting):
            self._settle()

    # ------------------------------------------------------------------ the step

    def step(self) -> None:
        batch, kind = self._schedule()
        launched = self._timed_launch(batch, kind) if batch else None
        self._settle()  # the step before, while the device runs this one
        self._in_flight = launched
        if not self.overlap:
            self._settle()

    def _schedule(self) -> tuple[list, str]:
        """The next step's batch and kind: an extend step's (request, tokens to compute)
        pairs ("prefill"), or the requests a decode step takes ("decode")."""
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

    def _timed_launch(self, batch: list, kind: str) -> LaunchedStep | None:
        """_launch, its seconds counted under `kind` (less a settle it ran first)."""
        start, settled = time.perf_counter(), self.stats.settle_s
        launched = self._launch(batch, kind)
        phase = self.stats.phases[kind]
        phase.launch_s += time.perf_counter() - start - (self.stats.settle_s - settled)
        if launched is not None:
            phase.steps += 1
            phase.rows += len(launched.reqs)
        return launched

    def _launch(self, batch: list, kind: str) -> LaunchedStep | None:
        """Dispatch the batch (None when there is nothing left to run); lengths advance now,
        tokens are read when it is settled."""
        if kind == "decode":
            return self._launch_decode(batch)
        prefill = self._prefill_batch(batch)
        output = self.decoding.launch_prefill(prefill)
        for req, n, emits in prefill.rows:
            req.kv_len += n
            req.num_inflight += emits
        return LaunchedStep("prefill", prefill.reqs, output, prefill.rows)

    def _launch_decode(self, reqs: list[Req]) -> LaunchedStep | None:
        plan = self.decoding.plan_decode(reqs, self._in_flight)
        if plan.settle_first:
            self._settle()
            reqs = [req for req in reqs if not req.finished]
            if not reqs:
                return None
        return LaunchedStep("decode", reqs, self.decoding.launch_decode(reqs, plan))

    def _prefill_batch(self, batch: list[tuple[Req, int]]) -> PrefillBatch:
        reqs = [req for req, _ in batch]
        rows = [(req, n, n == req.tokens_to_compute) for req, n in batch]
        chunks = [SeqChunk(self._input_ids(req, n), req.kv_len, req.page_ids,
                           state_slot=req.state_slot) for req, n in batch]
        slots = np.fromiter((req.slot for req in reqs), np.int32, len(reqs))
        sampling, penalty_slots = self.slot_table.sampling_rows(
            reqs, slots, np.fromiter((req.num_sampled for req in reqs), np.int32, len(reqs)),
            len(reqs))
        return PrefillBatch(rows, chunks, sampling, penalty_slots,
                            np.array([emits for _, _, emits in rows]), slots)

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
        start = time.perf_counter()
        emitted = self.decoding.settle(launched)
        self._emit(emitted)
        if launched.kind == "prefill":
            self._log_prefill(launched.chunks)
        else:
            self._log_decode(sum(len(tokens) for _, tokens, _ in emitted))
        self.stats.phases[launched.kind].settle_s += time.perf_counter() - start
        return True

    def _emit(self, emitted: Emitted) -> None:
        """Hand on each request's new tokens; a request they finished leaves."""
        for req, _, finished in emitted:
            if finished:
                self.running.remove(req)
                self._finish(req)
        if emitted:
            self.on_output(emitted)

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
        self.decoding.retract(req)
        self.prefill.requeue(req)
        logger.info("Retracted request %s (KV cache full): %d tokens to recompute", req.rid,
                    len(req.all_ids))

    def _finish(self, req: Req) -> None:
        req.finished_at = time.perf_counter()
        # Steps it will never read counted in its length: the cache keeps what a loop
        # without overlap would have computed.
        req.kv_len -= req.num_inflight
        self.cache.release(req)  # before the decoding lets go of it: its page-reuse rule reads it
        self.decoding.finish(req)
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    def _log_prefill(self, rows: list[tuple[Req, int, bool]]) -> None:
        new_tokens = sum(n for _, n, _ in rows)
        self.stats.num_prefill_tokens += new_tokens
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
            "token usage: %.2f, #running-req: %d, #queue-req: %d",
            len(rows), new_tokens, sum(r.cached_tokens for r, _, _ in rows),
            self.cache.used_pages / self.cache.allocator.capacity, len(self.running),
            len(self.prefill.waiting),
        )

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
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %s"
            "gen throughput (token/s): %.2f, #queue-req: %d",
            len(self.running), sum(r.kv_len for r in self.running), usage,
            self.decoding.log_fields(), rate,
            len(self.prefill.waiting),
        )

