"""SpecDecoder: speculative decoding behind the scheduler's decoding interface
(scheduler/decoding.py), the host side of SpecRunner.

Each decode step it picks the round's shape for the running requests (the adaptive policy,
`plan_decode`), catches up drafts that plain rounds left behind, and dispatches the round
without waiting (`launch_decode`); a step later, while the next round runs, it appends each
request's accepted run (`settle`).

So the host plans round N+1 before it knows what round N accepted. A request's `kv_len` then
counts one token for round N (a round commits at least its root) and `inflight_extra` the
num_steps more it may have accepted: pages are reserved for the upper bound, and the round
reads the exact length, output position and root token from the request's slot on the
device (the slot lengths of DeviceState), which round N wrote; a plain round is the target's
decode step, which reads them there too. The policy learns each round's acceptance and time
when it is settled, so it chooses from statistics one round old. The scheduler settles the
round in flight first where the host must see every token: before a batch with a
grammar-constrained request (the matcher walks each tree on the host) and before catch-ups
(their inputs are the features plain rounds bring back, catch_up.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_jax.model_executor.model_runner import ModelRunner, PendingStep
from sgl_jax.scheduler.decoding import (
    DecodePlan,
    Emitted,
    LaunchedStep,
    PrefillBatch,
    dispatch_decode_step,
    emit_tokens,
)
from sgl_jax.scheduler.page_reuse import ReuseEveryPage
from sgl_jax.scheduler.req import Req
from sgl_jax.scheduler.slot_table import SlotTable
from sgl_jax.speculative import spec_warmup
from sgl_jax.speculative.catch_up import CatchUps
from sgl_jax.speculative.drafters.interface import NoProposer, Proposer
from sgl_jax.speculative.next_token_pages import NextTokenPages
from sgl_jax.speculative.policy.acceptance_stats import AcceptanceStats
from sgl_jax.speculative.policy.shape_policy import PLAIN, SpeculationPolicy
from sgl_jax.speculative.request_state import DraftState, DraftStates
from sgl_jax.speculative.round.output import PendingRound, RoundOutput
from sgl_jax.speculative.round.program import packed_nodes
from sgl_jax.speculative.round.results import (
    emit_run,
    max_depth,
    node_outcomes,
    round_rows,
    tree_masks,
    verified_depths,
)
from sgl_jax.speculative.spec_config import TreeShape
from sgl_jax.speculative.spec_runner import SpecRunner


@dataclass(frozen=True)
class _RoundPlan:
    """What plan_decode chose for a round."""

    shape: TreeShape
    bucket: int  # the padded batch size (spec_warmup.ready_padding)
    hints: Any  # a host-side drafter's proposals (RoundRows.hints)
    records: list  # each request's policy.Acceptance (None: no draft this round)


@dataclass
class LaunchedRound:
    """A dispatched round whose results the host has not read yet."""

    reqs: list[Req]
    shape: TreeShape
    bucket: int  # the padded batch size
    records: list  # each request's policy.Acceptance, None for one without a draft
    masked: bool  # a grammar masked its trees
    defers: bool  # a plain round that leaves the drafting requests' drafts behind
    output: PendingRound | PendingStep  # a PendingStep: the target's own decode step
    launched_at: float
    compiled: bool = False  # its dispatch compiled a program: its time says nothing of a round


class SpecDecoder:
    def __init__(self, spec: SpecRunner, runner: ModelRunner, slot_table: SlotTable, *,
                 adaptive: bool, proposer: Proposer | None = None):
        self.spec = spec
        self.proposer = proposer or NoProposer()  # a host-side drafter's statistics
        self.runner = runner  # the target's, for rounds where no request has a draft
        self.slot_table = slot_table
        self.buckets = spec.target.buckets
        self.lookahead = spec.lookahead
        self.stats = AcceptanceStats(spec.shape.num_steps)
        self.policy = SpeculationPolicy(spec.shapes, spec.shape, spec.round_seconds,
                                        adaptive=adaptive)
        self.states = DraftStates()  # each request's speculative state
        self.page_reuse = (NextTokenPages(self.states, runner.page_size)
                           if spec.drafter.pairs_next_token else ReuseEveryPage())
        self.catch_ups = CatchUps(spec, self.states, self.policy)
        self._last_result_at = 0.0

    # ------------------------------------------------------------------ requests

    def add_request(self, req: Req) -> None:
        self.states.add(req, DraftState(AcceptanceStats(self.spec.shape.num_steps),
                                        self.policy.new_request()))

    def admit(self, req: Req, batch_size: int, running: list[Req]) -> None:
        """Whether the request gets a draft (policy.admits_draft), where plain rounds leave
        drafts behind (else one could not start late); a host-side drafter starts reading it
        here, and lets go of it in finish()."""
        self.proposer.add_request(req)
        self.policy.refills.joined()
        state = self.states[req]
        if not req.params.speculative:
            state.drafting = False  # it asked for none
        elif self.spec.defers_draft:
            state.drafting = self.policy.admits_draft(
                self._timed_bucket(batch_size), req.rid, sum(self._drafting(running)))

    def batch_limit(self, wanted: int) -> int:
        return spec_warmup.batch_limit(self.spec, wanted)

    def prefill_limit(self, wanted: int) -> int:
        return spec_warmup.prefill_limit(self.spec, wanted)

    def flush(self) -> None:
        self.proposer.flush()

    def retract(self, req: Req) -> None:
        self.states[req].pending.clear()  # the prompt's recomputation extends the draft too

    def finish(self, req: Req) -> None:
        state = self.states.pop(req)
        req.decoding_info = state.meta_info()
        self.policy.count_finished(state.drafting, len(self.states) > 0, held_slot=req.slot >= 0)
        self.proposer.finish(req)

    def _drafting(self, reqs: list[Req]) -> list[bool]:
        return [self.states[req].drafting for req in reqs]

    def log_fields(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.stats.acceptance_rates)
        return f"accept len: {self.stats.accept_length:.2f}, acc: [{rates}], "

    def server_info(self) -> dict[str, Any]:
        return {**self.stats.server_info(), **self.policy.info()}

    def _timed_bucket(self, batch_size: int) -> int:
        """The padded size of a batch of `batch_size` (spec_warmup.ready_padding), its round
        programs timed first where the policy has none yet (spec_warmup.untimed_shapes)."""
        bucket = spec_warmup.ready_padding(self.spec, batch_size)
        if self.policy.adaptive:
            untimed = spec_warmup.untimed_shapes(self.spec, bucket, self.policy.round_seconds,
                                                 self.policy.provisional)
            if untimed:
                clean = spec_warmup.time_bucket(self.spec, bucket, untimed)
                self.policy.add_round_seconds(
                    {(s, bucket): self.spec.round_seconds[s, bucket] for s in untimed},
                    provisional=not clean)
        return bucket

    # ------------------------------------------------------------------ prefill

    def launch_prefill(self, batch: PrefillBatch) -> PendingStep:
        """Target and draft extend together (the target alone where no request of the batch
        has a draft); a completed prompt's first token and draft root stay in its slot."""
        reqs = batch.reqs
        after = [req.token_slice(req.kv_len + n, req.kv_len + n + 1) for req, n, _ in batch.rows]
        return self.spec.prefill(
            batch.chunks, batch.sampling, batch.emits, any(req.top_logprobs_num for req in reqs),
            [ids[0] if ids else 0 for ids in after], batch.slots,
            run_draft=any(self._drafting(reqs)),
            want_logprobs=any(req.return_logprob for req in reqs))

    # ------------------------------------------------------------------ rounds

    def plan_decode(self, reqs: list[Req], in_flight: LaunchedStep | None) -> DecodePlan:
        """The round's shape (the policy's choice) and whether the round in flight must be
        read first (see the module's docstring). A host-side drafter proposes now, where the
        round may draft: a request it has nothing for counts as one without a draft."""
        bucket = self._timed_bucket(len(reqs))
        records, hints = self._records(reqs), None
        def offered() -> list[bool]:  # asked by the policy only where the round may draft
            nonlocal hints
            hints = self.proposer.hints(reqs, bucket)
            return self.proposer.offered(hints, len(reqs))

        shape = self.policy.choose(records, bucket, menu=self._constrained_menu(reqs, bucket),
                                   remaining=[req.tokens_left for req in reqs],
                                   offered=offered if self.proposer.on_host else None)
        if shape != PLAIN and hints is None:  # a fixed shape, or not asked
            offered()
        if hints is not None:
            records = self._offered(records, hints)
        unread = in_flight.output if in_flight is not None and in_flight.kind == "decode" \
            else None
        settle_first = unread is not None and unread.defers and self.catch_ups.needs_settled(
            reqs, shape, unread.reqs)
        return DecodePlan(settle_first, _RoundPlan(shape, bucket, hints, records))

    def launch_decode(self, reqs: list[Req], plan: DecodePlan) -> LaunchedRound:
        """Dispatch one round for `reqs` in the planned shape."""
        shape, bucket = plan.detail.shape, plan.detail.bucket
        hints, records = plan.detail.hints, plan.detail.records
        if plan.settle_first and shape != PLAIN:  # the host has read more since: propose again
            hints = self.proposer.hints(reqs, bucket)
            records = self._offered(self._records(reqs), hints)
        self.catch_ups.run_due(reqs, shape)
        compilations = self.spec.target.num_compilations
        start = time.perf_counter()
        undrafted = self._undrafted(reqs, shape)
        defers = shape == PLAIN and self.spec.defers_draft and not undrafted
        masked = shape != PLAIN and any(req.grammar is not None for req in reqs)
        verified = self.verified_nodes(reqs, shape, bucket, records)
        if undrafted or defers:  # the target's own decode step
            output = dispatch_decode_step(self.runner, self.slot_table, reqs, padded=bucket,
                                          want_features=defers)
        else:
            output = self._dispatch(reqs, bucket, shape, masked, hints, verified)
        return LaunchedRound(
            reqs, shape, bucket, records, masked, defers, output, start,
            compiled=self.spec.target.num_compilations != compilations)

    def verified_nodes(self, reqs: list[Req], shape: TreeShape, bucket: int,
                       records: list) -> list[int] | None:
        """A packed round's draft nodes per request: the policy's shares
        (policy/request_lengths.py), a chain's within each request's own cap (a tree's nodes
        past it are cut by the round's program); None for any other round."""
        if not shape.verify_width:
            return None
        counts = self.policy.verify_counts(records, shape, bucket).tolist()
        return counts if shape.topk > 1 else [
            min(c, max_depth(r, shape.num_steps)) for c, r in zip(counts, reqs, strict=True)]

    def _undrafted(self, reqs: list[Req], shape: TreeShape) -> bool:
        """Whether a round of `shape` is the target's decode step: plain, and no draft to
        advance (none in the batch, or a drafter like NGRAM that has none on the device)."""
        return shape == PLAIN and (not self.spec.drafter.advances_on_plain
                                   or not any(self._drafting(reqs)))

    def settle(self, launched: LaunchedStep) -> Emitted:
        if launched.kind == "prefill":
            emitted = emit_tokens(launched.reqs, launched.output.result(), launched.emits)
            # A round launched behind this prefill starts on the device only now: its
            # seconds must not include the prefill's.
            self._last_result_at = time.perf_counter()
        else:
            emitted = self._settle_round(launched.output)
        self.proposer.extend(emitted)
        return emitted

    def _settle_round(self, launched: LaunchedRound) -> Emitted:
        """Append each live request's accepted run (up to where it finishes)."""
        if isinstance(launched.output, PendingStep):
            return self._settle_step(launched)
        output = launched.output.result()
        seconds = self._device_seconds(launched)
        accepted = output.num_accepted.tolist()
        live = [row for row, req in enumerate(launched.reqs) if not req.finished]
        steps = launched.shape.num_steps
        depths = verified_depths(output, steps)
        self.policy.observe(launched.shape, launched.bucket, seconds,
                            [(launched.records[row], accepted[row], depths[row])
                             for row in live],
                            masked=launched.masked, timed=not launched.compiled)
        for req in launched.reqs:
            req.num_inflight -= 1
            req.inflight_extra -= steps
        drafted = [min(d, v) for d, v in zip(self._drafted_depths(launched, output), depths,
                                             strict=True)]
        if output.tree_scores is not None and live:
            self.policy.calibration.record(*node_outcomes(output, live))
        self.stats.record_rounds([accepted[row] for row in live], [drafted[row] for row in live])
        emitted = []
        for row in live:
            req, state = launched.reqs[row], self.states[launched.reqs[row]]
            state.stats.record(accepted[row], drafted[row])
            tokens = emit_run(req, output, row, accepted[row] + 1)
            req.kv_len += len(tokens) - 1  # the root was counted at launch
            emitted.append((req, tokens, req.finish_reason is not None))
        return emitted

    def _settle_step(self, launched: LaunchedRound) -> Emitted:
        """A plain round that ran as the target's decode step: one token each; a drafting
        request's draft, left behind, gets the token's features for its catch-up."""
        result = launched.output.result()
        if launched.defers:
            for row, req in enumerate(launched.reqs):
                if not req.finished and self.states[req].drafting:
                    self.states[req].pending.append(result.features[row])
        emitted = emit_tokens(launched.reqs, result)
        self.policy.observe(PLAIN, launched.bucket, self._device_seconds(launched), [],
                            timed=not launched.compiled)
        return emitted

    def _device_seconds(self, launched: LaunchedRound) -> float:
        """Seconds since the round's launch or the read of the result before, the later."""
        now = time.perf_counter()
        seconds = now - max(launched.launched_at, self._last_result_at)
        self._last_result_at = now
        return seconds

    def _drafted_depths(self, launched: LaunchedRound, output: RoundOutput) -> list[int]:
        """The draft positions each row's round tried: the shape's depth (or the request's
        own cap) for a drafter that always drafts that deep, else the deepest node of the
        tree it verified (NGRAM: 0 where the text offered nothing)."""
        if self.spec.drafter.full_depth:
            steps = launched.shape.num_steps
            return [max_depth(req, steps) for req in launched.reqs]
        return output.deepest.tolist()

    def _dispatch(self, reqs: list[Req], padded: int, shape: TreeShape, masked: bool,
                  hints: Any, verified: list[int] | None) -> PendingRound:
        """A round of the speculative programs over batch bucket `padded` (packed: each
        request verifies its `verified` draft nodes); lengths advance by the least it
        commits."""
        n = len(reqs)
        rows = round_rows(reqs, padded, hints, self.slot_table.page_rows(reqs),
                          self.buckets.pages_per_seq, self.spec.shape.num_steps)
        if verified is not None:
            rows = dataclasses.replace(rows, packed_nodes=packed_nodes(
                [d + 1 for d in verified], shape.num_draft_tokens, shape.verify_width * padded),
                calibration=self.policy.calibration.table(shape.num_steps))
        sampling, _ = self.slot_table.sampling_rows(
            reqs, rows.slots[:n], np.fromiter((r.num_sampled for r in reqs), np.int32, n),
            padded)
        want_top = any(req.top_logprobs_num for req in reqs)
        want_logprobs = any(req.return_logprob for req in reqs)
        if masked:
            tree = self.spec.draft_trees(rows)
            output = self.spec.masked_verify(rows, sampling, want_top, tree,
                                             tree_masks(reqs, tree.tokens, tree.parents,
                                                        self.spec.vocab_size),
                                             num_rows=n, want_logprobs=want_logprobs)
        else:
            output = self.spec.round(rows, sampling, want_top, shape, num_rows=n,
                                     want_logprobs=want_logprobs)
        for req in reqs:
            req.kv_len += 1
            req.num_inflight += 1
            req.inflight_extra += shape.num_steps
        return output

    def _offered(self, records: list, hints: Any) -> list:
        """`records` (_records), None too where the host-side drafter offers nothing."""
        offered = self.proposer.offered(hints, len(records))
        return [record if has_draft else None
                for record, has_draft in zip(records, offered, strict=True)]

    def _records(self, reqs: list[Req]) -> list:
        """Each request's acceptance record, None where its rounds teach the policy nothing:
        no draft, or a depth the request capped itself."""
        states = [self.states[req] for req in reqs]
        return [state.acceptance if state.drafting and req.params.max_draft_depth is None
                else None for req, state in zip(reqs, states, strict=True)]

    def _constrained_menu(self, reqs: list[Req], bucket: int
                          ) -> tuple[TreeShape, ...] | None:
        """Shapes a batch with grammar-constrained requests may take (None: any). Masked
        trees need the matcher's view of every node, which min_new_tokens' EOS suppression
        below the root would contradict, so such a request keeps its batch on plain rounds
        until it is past min_new_tokens."""
        constrained = [req for req in reqs if req.grammar is not None]
        if not constrained:
            return None
        if any(req.suppressing_eos for req in constrained) or not spec_warmup.masked_ready(
                self.spec, bucket):
            return (PLAIN,)  # (masked rounds not built yet: plain rounds meanwhile)
        return (PLAIN, self.spec.shape)
