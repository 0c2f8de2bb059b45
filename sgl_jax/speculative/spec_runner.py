"""SpecRunner: the jitted steps of speculative decoding, beside the target's ModelRunner.

Its programs, each built per bucket (model_executor/programs.py; a plain round where no
request has a draft is the target's own decode step, run from speculative/decode_loop.py):

- `prefill`: the target's extend (prompt chunks) with its captured hidden states and the
  draft's extend over the same tokens; for the requests whose prompt is now complete, the
  sampled token and the draft's output at the last pair (the root the first tree grows
  from), kept in the request's slot.
- `round`, one program per round shape (`TreeShape`: plain decoding is the one-node tree):
  the drafter proposes a tree per row, `round.verify_trees` runs every tree in one target
  forward with the tree mask, walks the accepted path and moves its nodes' target KV to
  consecutive slots, then the drafter advances over the accepted tokens (an EAGLE draft's
  extend gives the next root). The parts are pure functions (round/, drafters/).
- `catch_up`: the draft extended over the tokens that plain rounds committed without it (see
  below), from the target features those rounds returned.
- `draft_trees` then `masked_verify`, the flags' shape as two programs: the draft's trees
  come back to the host, which writes the ids a grammar allows at every node (each node's
  path walked in the request's matcher), then verify and extend run with those masks on the
  target's distributions. A grammar-constrained batch takes them (or a plain round). Every
  call takes host arrays only, so other nodes can replay it.

Trees are grown at the start of the round that verifies them, so each round may take another
shape (the adaptive policy's choice) without a program per pair of shapes. What passes
between rounds stays on the device (round/program.py), so a round can be dispatched before
the host has read the one before it (`PendingRound`). Every program takes and returns the
target's device state (KV cache, last tokens) and this runner's (`DraftDeviceState`),
donated; every method that launches device work is a `device_call` (multi-host followers
replay it). Warm-up, building and timing: spec_warmup.py.

Invariant between steps: a request's target cache holds its first kv_len tokens (kv_len =
all tokens but the last) and its draft cache the same, except that with an adaptive policy a
plain round leaves the draft behind (`defers_draft`): it is the target's own decode step,
which returns the target's features of the committed token instead of extending the draft,
and the host keeps them until the draft is caught up (before the request's next speculative
round, or once CATCH_UP_WIDTH are pending), so a run of plain rounds costs what plain decode
steps cost. The radix cache shares draft pages where the draft is complete. Slots past
kv_len are scratch that every round rewrites. A hybrid target's (and a hybrid STANDALONE
draft's) state slot holds the state after those kv_len tokens: verify runs the tree's nodes
from it without writing it, then commits the state after the last accepted node.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers.attention import ModelCache
from sgl_jax.layers.sampler import SamplingBatch, logprob_detail, sample
from sgl_jax.model_executor.forward_batch import (
    BatchShape,
    Buckets,
    SeqChunk,
    build_forward_batch,
)
from sgl_jax.model_executor.model_runner import (
    MAX_TOP_LOGPROBS,
    ModelRunner,
    PendingStep,
    pad_rows,
)
from sgl_jax.model_executor.packing import Layouts, Packing, unpack
from sgl_jax.model_executor.programs import Programs
from sgl_jax.parallel.multihost import device_call
from sgl_jax.speculative.drafters.interface import Drafter, root_only_tree
from sgl_jax.speculative.policy.request_lengths import packed_counts, round_packing, rows_for
from sgl_jax.speculative.round.output import PendingRound, round_result
from sgl_jax.speculative.round.program import (
    CatchUpRow,
    DraftDeviceState,
    RoundInputs,
    RoundRows,
    SlotState,
    Verified,
    advance_slots,
    catch_up_arrays,
    round_inputs,
    shifted_ids,
    target_features,
    verify_trees,
)
from sgl_jax.speculative.round.tree import DraftTree, limit_depth
from sgl_jax.speculative.round.verify import AcceptThresholds
from sgl_jax.speculative.spec_config import TreeShape

logger = logging.getLogger(__name__)


class SpecRunner:
    def __init__(
        self,
        target: ModelRunner,
        drafter: Drafter,
        shape: TreeShape,
        *,
        thresholds: AcceptThresholds,
        shapes: Sequence[TreeShape] = (),
    ):
        self.target = target
        self.drafter = drafter
        self.forward = target.target_forward
        # The target runner's state, which rounds and plain steps alike read and write.
        self.state = target.state
        self.draft_state = DraftDeviceState(self._allocate_draft_cache(),
                                            self._empty_slot_state())
        self.vocab_size = target.config.vocab_size
        self.shape = shape  # the flags' shape: the widest a round may take
        self.shapes = tuple(dict.fromkeys((*shapes, shape)))  # every shape a round may take
        self.thresholds = thresholds
        self.capture_layers = drafter.capture_layers
        self.page_size = target.page_size
        self.tp = target.tp
        # Every program that writes the per-slot state (SlotState, the target's slot lengths
        # and last tokens) takes it donated, after the two caches.
        state_args = (2, 3, 4, 5, 6)
        store = target.store

        def programs(name: str, impl, donate=state_args, static=(), **bound) -> Programs:
            jitted = jax.jit(functools.partial(impl, **bound) if bound else impl,
                             donate_argnums=donate, static_argnames=static)
            return Programs(name, jitted, store)
        # Each by its inputs' padded size: a prefill's BatchShape, else the batch bucket.
        self.prefills = programs("spec_prefill", self._prefill_impl)
        # A round's host inputs cross as one int32 and one float32 array (packing.py).
        self.rounds = {s: programs(f"round_{s.name.replace('/', 'x').replace(':', 'w')}",
                                   self._round_impl, static=("packing",), shape=s)
                       for s in self.shapes}
        self._round_layouts = Layouts()  # by shape and batch bucket
        self.tree_drafts = programs("draft_trees", self._draft_trees_impl, (1,), shape=shape)
        self.masked_verifies = programs("masked_verify", self._masked_verify_impl,
                                        shape=shape)
        self.catch_ups = programs("catch_up", self._catch_up_impl, (1, 2))
        # Plain rounds leave the draft behind when the policy may take them and the drafter
        # can be caught up (a recurrent draft's state would need its own catch-up).
        self.defers_draft = drafter.defers and any(s.num_draft_tokens == 1 for s in self.shapes)
        # A plain round is the target's own decode step (its program, its cost) unless the
        # drafter must advance on every token on the device (a STANDALONE draft).
        self.plain_is_decode_step = not drafter.advances_on_plain or drafter.defers
        self.hybrid = target.config.is_hybrid
        # Seconds of one round by (shape, padded batch size), measured by warmup().
        self.round_seconds: dict[tuple[TreeShape, int], float] = {}

    def _allocate_draft_cache(self) -> ModelCache | list:
        """The drafter's paged cache, as many pages a layer as the target's: one allocator
        serves both ([] for a drafter that keeps none)."""
        cache, target = self.drafter.cache, self.target
        if cache is None:
            return []
        return cache.allocate(
            num_pages=self.state.kv_cache.pages_per_layer, page_size=target.page_size,
            dtype=target.model.dtype, tp=target.tp, num_state_slots=target.num_state_slots,
            kv_dtype=target.kv_dtype)

    def _empty_slot_state(self) -> SlotState:
        num_slots = self.state.last_tokens.shape[0]
        return self.target.tp.put_replicated(SlotState(
            np.zeros((num_slots, self.drafter.slot_width), self.drafter.slot_dtype)))

    @property
    def buckets(self) -> Buckets:
        return self.target.buckets

    @property
    def lookahead(self) -> int:
        """KV slots past kv_len a round may write: the verify window, or the draft windows,
        or the accepted tokens, whichever reaches furthest, for the widest shape."""
        return max(max(s.num_draft_tokens, s.num_steps + 1, self.drafter.reach(s))
                   for s in self.shapes)

    @property
    def feature_width(self) -> int:
        """F: the target features the draft reads per token (EAGLE3: the captured layers)."""
        hidden = self.target.config.hidden_size
        return hidden * len(self.capture_layers) if self.drafter.features == "aux" else hidden

    def state_args(self) -> tuple:
        """The leading arguments of every round and prefill program: both models' parameters
        (the target's as ProgramParams.arrays), then the state they donate (target KV, draft
        KV, slot state, slot lengths, last tokens)."""
        state, draft = self.state, self.draft_state
        return (self.target.program_params.arrays, self.drafter.params, state.kv_cache, draft.kv,
                draft.slots, state.lengths, state.last_tokens)

    def masked_built(self, size: int) -> bool:
        return size in self.tree_drafts and size in self.masked_verifies

    # ------------------------------------------------------------------ host API

    @device_call
    def prefill(
        self,
        chunks: Sequence[SeqChunk],
        sampling: SamplingBatch,  # host arrays, one row per chunk
        emits: np.ndarray,  # bool[n]: the chunk completes its request's prompt
        want_top_logprobs: bool,
        next_tokens: Sequence[int],  # the token after each chunk when known (else ignored)
        slots: np.ndarray,  # i32[n]: request slots, where emitting rows leave their roots
        *, run_draft: bool = True, want_logprobs: bool = True,
    ) -> PendingStep:
        """Extend target and draft (the target alone without `run_draft`: no request of the
        batch has a draft), without waiting. An emitting row's sampled token and the
        drafter's slot row at it become its slot's root."""
        shape, inputs = self.prefill_inputs(
            chunks, sampling, emits, logprob_detail(want_logprobs, want_top_logprobs),
            next_tokens, slots, run_draft)
        state, draft = self.state, self.draft_state
        (state.kv_cache, draft.kv, draft.slots, state.lengths, state.last_tokens,
         out) = self.prefills(shape, *self.state_args(), *inputs)
        return PendingStep.of_sample(len(chunks), out, want_logprobs, want_top_logprobs)

    def prefill_inputs(self, chunks: Sequence[SeqChunk], sampling: SamplingBatch,
                       emits: np.ndarray, detail: np.int32, next_tokens: Sequence[int],
                       slots: np.ndarray, run_draft: bool) -> tuple[BatchShape, tuple]:
        """A prefill's bucket and its host inputs, padded to the bucket (see prefill)."""
        shape = self.target.buckets.shape_for(chunks)
        batch = build_forward_batch(chunks, page_size=self.page_size, shape=shape)
        rows = shape.num_logits
        sampling = jax.tree.map(lambda a: pad_rows(np.asarray(a), rows), sampling)
        return shape, (batch, sampling, pad_rows(emits, rows, fill=False),
                       pad_rows(slots.astype(np.int32), rows, fill=-1),
                       detail, shifted_ids(chunks, shape, next_tokens),
                       np.bool_(run_draft))

    @device_call
    def round(self, rows: RoundRows, sampling: SamplingBatch, want_top_logprobs: bool,
              shape: TreeShape | None = None, *, num_rows: int | None = None,
              want_logprobs: bool = True) -> PendingRound:
        """Dispatch a round of `shape` (default: the flags') for every row: propose, verify,
        advance the drafter; `sampling` has a host row per row of `rows`. Results come back
        for the first `num_rows` (default: every row)."""
        shape = shape or self.shape
        packed, packing = self.packed_round_inputs(
            shape, rows, sampling, logprob_detail(want_logprobs, want_top_logprobs))
        state, draft = self.state, self.draft_state
        (state.kv_cache, draft.kv, draft.slots, state.lengths, state.last_tokens,
         result) = self.rounds[shape](
            len(rows.slots), *self.state_args(), *packed, packing=packing)
        return PendingRound(len(rows.slots) if num_rows is None else num_rows, result,
                            want_logprobs=want_logprobs, want_top_logprobs=want_top_logprobs)

    def packed_round_inputs(self, shape: TreeShape, rows: RoundRows, sampling: SamplingBatch,
                            detail: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], Packing]:
        """A round program's host inputs after the state (`rows` as `shape` takes them,
        `sampling`, the log-probability detail) packed, and their layout (its `packing`)."""
        return self._round_layouts.pack((shape, len(rows.slots)),
                                        (rows_for(shape, rows), sampling, detail))

    @device_call
    def draft_trees(self, rows: RoundRows) -> DraftTree:
        """The first half of a masked round: each row's tree of the flags' shape, as host
        arrays (tokens and parents i32[B, N]). Every row's length must be known (>= 0)."""
        draft, rows = self.draft_state, rows_for(self.shape, rows)
        tree, draft.kv = self.tree_drafts(len(rows.slots), self.drafter.params, draft.kv,
                                          draft.slots, self.state.lengths,
                                          self.state.last_tokens, rows)
        return jax.device_get(tree)

    @device_call
    def masked_verify(self, rows: RoundRows, sampling: SamplingBatch, want_top_logprobs: bool,
                      tree: DraftTree, allowed: np.ndarray, *, num_rows: int | None = None,
                      want_logprobs: bool = True) -> PendingRound:
        """The second half: verify `tree` (draft_trees' for the same rows) with every node's
        target distribution masked by `allowed` (i32[B, N, W] bitmasks, W = ceil(V / 32), in
        place of `sampling.allowed`), then advance the drafter."""
        state, draft, rows = self.state, self.draft_state, rows_for(self.shape, rows)
        (state.kv_cache, draft.kv, draft.slots, state.lengths, state.last_tokens,
         result) = self.masked_verifies(
            len(rows.slots), *self.state_args(), rows, tree, sampling,
            logprob_detail(want_logprobs, want_top_logprobs), allowed)
        return PendingRound(len(rows.slots) if num_rows is None else num_rows, result,
                            want_logprobs=want_logprobs, want_top_logprobs=want_top_logprobs)

    @device_call
    def catch_up(self, rows: Sequence[CatchUpRow], padded: int) -> None:
        """Extend each row's draft over its pending tokens (at most CATCH_UP_WIDTH), padded
        to bucket `padded`; the draft's output at each row's last one is its slot's root."""
        inputs = self.catch_up_inputs(rows, padded)
        draft = self.draft_state
        draft.kv, draft.slots = self.catch_ups(padded, self.drafter.params, draft.kv,
                                               draft.slots, *inputs)

    def catch_up_inputs(self, rows: Sequence[CatchUpRow], padded: int) -> tuple:
        """The host arrays of a catch-up of `rows` padded to batch bucket `padded`."""
        return catch_up_arrays(rows, padded, self.target.buckets.pages_per_seq,
                               self.feature_width, self.target.model.dtype)

    # ------------------------------------------------------------------ jitted bodies

    def _prefill_impl(self, target_params, draft_params, target_kv, draft_kv, slot_state,
                      lengths, last_tokens, batch, sampling, emits, slots, detail, draft_ids,
                      run_draft):
        target_params = self.target.program_params.unstack(target_params)
        self._count_compilation("prefill", batch.input_ids.shape[0])
        hidden, target_kv, captured = self.forward(
            target_params, target_kv, batch.input_ids, batch.positions, batch.attention,
            capture=self.capture_layers, state_slots=batch.state_slots)
        logits = self.forward.logits(target_params, hidden[batch.logits_indices])
        out = sample(logits, sampling, None, None, detail=detail,
                     num_top_logprobs=MAX_TOP_LOGPROBS)
        features = None
        if self.drafter.features:
            # The last token of a completed prompt pairs with the token just sampled.
            where = jnp.where(emits, batch.logits_indices, draft_ids.shape[0])
            draft_ids = draft_ids.at[where].set(out.tokens, mode="drop")
            features = target_features(self.drafter.features, hidden, captured)
        slot_rows, draft_kv = self.drafter.prefill(draft_params, draft_kv, batch, features,
                                                   draft_ids, run_draft)
        where = jnp.where(emits & (slots >= 0), slots, last_tokens.shape[0])  # others: dropped
        slot_state = dataclasses.replace(
            slot_state, draft=slot_state.draft.at[where].set(slot_rows, mode="drop"))
        last_tokens = last_tokens.at[where].set(out.tokens, mode="drop")
        return target_kv, draft_kv, *self.tp.constrain_replicated(
            (slot_state, lengths, last_tokens, out))

    def _round_impl(self, target_params, draft_params, target_kv, draft_kv, slot_state,
                    lengths, last_tokens, ints, floats, *, shape: TreeShape,
                    packing: Packing):
        rows, sampling, detail = unpack(packing, ints, floats)
        self._count_compilation(f"round {shape.name}", rows.slots.shape[0])
        inputs = round_inputs(slot_state, lengths, last_tokens, rows, sampling)
        tree, draft_kv = self.propose(draft_params, draft_kv, inputs, rows, shape)
        tree, packed = round_packing(tree, rows)
        target_kv, verified = self.verify(target_params, target_kv, rows, inputs, tree,
                                           detail, shape, packed=packed)
        slot_rows, draft_kv = self.drafter.advance(draft_params, draft_kv, tree, verified,
                                                   inputs, rows.page_table, rows.state_slots)
        slot_state, lengths, last_tokens = advance_slots(
            slot_state, lengths, last_tokens, rows.slots, inputs, verified.verdict, slot_rows)
        counts = None if packed is None else packed_counts(packed, tree.tokens.shape)
        return target_kv, draft_kv, *self.tp.constrain_replicated(
            (slot_state, lengths, last_tokens, round_result(verified, tree, counts)))

    def _draft_trees_impl(self, draft_params, draft_kv, slot_state, lengths, last_tokens,
                          rows: RoundRows, *, shape: TreeShape):
        inputs = round_inputs(slot_state, lengths, last_tokens, rows, None)
        tree, draft_kv = self.propose(draft_params, draft_kv, inputs, rows, shape)
        tree = dataclasses.replace(tree, scores=None)  # a masked round packs nothing
        return self.tp.constrain_replicated(tree), draft_kv

    def _masked_verify_impl(self, target_params, draft_params, target_kv, draft_kv, slot_state,
                            lengths, last_tokens, rows: RoundRows, tree, sampling, detail,
                            node_allowed, *, shape: TreeShape):
        self._count_compilation("masked verify", tree.tokens.shape[0])
        inputs = round_inputs(slot_state, lengths, last_tokens, rows, sampling)
        target_kv, verified = self.verify(target_params, target_kv, rows, inputs, tree,
                                           detail, shape, node_allowed=node_allowed)
        slot_rows, draft_kv = self.drafter.advance(draft_params, draft_kv, tree, verified,
                                                   inputs, rows.page_table, rows.state_slots)
        slot_state, lengths, last_tokens = advance_slots(
            slot_state, lengths, last_tokens, rows.slots, inputs, verified.verdict, slot_rows)
        return target_kv, draft_kv, *self.tp.constrain_replicated(
            (slot_state, lengths, last_tokens, round_result(verified, tree.structure(), None)))

    def propose(self, draft_params, draft_kv, inputs: RoundInputs, rows: RoundRows,
                 shape: TreeShape) -> tuple[DraftTree, list]:
        """The drafter's trees, each cut to its row's max depth (a request's own cap). The
        one-node shape (plain decoding) runs no draft at all."""
        if shape.num_draft_tokens == 1:
            return root_only_tree(inputs.root_tokens), draft_kv
        tree, draft_kv = self.drafter.propose(draft_params, draft_kv, inputs, rows.page_table,
                                              rows.state_slots, rows.hints, shape=shape)
        return limit_depth(tree, rows.max_depths), draft_kv

    def verify(self, target_params, target_kv, rows: RoundRows, inputs: RoundInputs,
                tree: DraftTree, detail, shape: TreeShape, node_allowed=None, packed=None
                ) -> tuple[list, Verified]:
        return verify_trees(
            self.forward, self.target.program_params.unstack(target_params), target_kv,
            rows.page_table, inputs, tree, detail, rows.state_slots, num_steps=shape.num_steps,
            chain=self.drafter.chains(shape), page_size=self.page_size, thresholds=self.thresholds,
            features=self.drafter.features, capture=self.capture_layers, node_allowed=node_allowed,
            packed=packed)

    def _catch_up_impl(self, draft_params, draft_kv, slot_state, tokens, features, page_table,
                       draft_lens, counts, slots):
        self._count_compilation("catch-up", tokens.shape[0])
        batch, width = tokens.shape
        slot_rows, draft_kv = self.drafter.catch_up(
            draft_params, draft_kv, tokens, features.reshape(batch * width, -1), page_table,
            draft_lens, counts)
        where = jnp.where(slots >= 0, slots, slot_state.draft.shape[0])
        slot_state = dataclasses.replace(
            slot_state, draft=slot_state.draft.at[where].set(slot_rows, mode="drop"))
        return draft_kv, self.tp.constrain_replicated(slot_state)

    def _count_compilation(self, kind: str, size: int) -> None:
        # Runs only while tracing, i.e. once per new bucket.
        self.target.num_compilations += 1
        logger.info("Compiling speculative %s #%d: size %d", kind, self.target.num_compilations,
                    size)
