"""SpecRunner: the jitted steps of speculative decoding, beside the target's ModelRunner.

Its programs, each one compiled function per bucket (a plain round where no request has a
draft is the target's own decode step, which the host side runs: speculative/decoder.py):

- `prefill`: the target's extend (prompt chunks) with its captured hidden states and the
  draft's extend over the same tokens; for the requests whose prompt is now complete, the
  sampled token and the draft's output at the last pair (the root the first tree grows
  from), kept in the request's slot.
- `round`, one program per round shape (`TreeShape`: plain decoding is the one-node tree):
  `draft_step` (the tree grown from each request's root), `verify_step` (every tree in one
  target forward with the tree mask, the accepted path, its nodes' target KV moved to
  consecutive slots), then `extend_step` (the draft extended over the accepted tokens, which
  gives the next root). The parts are public so that a benchmark can time them apart.
- `catch_up`: the draft extended over the tokens that plain rounds committed without it (see
  below), from the target features those rounds returned.
- `draft_trees` then `masked_verify`, the flags' shape as two programs: the draft's trees
  come back to the host, which writes the ids a grammar allows at every node (each node's
  path walked in the request's matcher), then verify and extend run with those masks on the
  target's distributions. A grammar-constrained batch takes them (or a plain round). Every
  call takes host arrays only, so other nodes can replay it.

Trees are grown at the start of the round that verifies them, so each round may take another
shape (the adaptive policy's choice) without a program per pair of shapes. What passes from
one round to the next stays on the device, per request slot (`SlotState`, and the target's
`last_tokens` for the root token): the committed length, the tokens sampled, the draft's
output at the root. So a round can be dispatched before the host has read the one before it:
where the host does not know a row's length yet it passes -1 and the round reads the slot's.
Results come back to the host asynchronously (`PendingRound`).

Invariant between steps: a request's target cache holds its first kv_len tokens (kv_len =
all tokens but the last) and its draft cache the same, except that with an adaptive policy a
plain round leaves the draft behind (`defers_draft`): it returns the target's features of the
committed token instead of extending the draft, and the host keeps them until the draft is
caught up (before the request's next speculative round, or once CATCH_UP_WIDTH are pending),
so a run of plain rounds costs what plain decode steps cost. The radix cache shares draft
pages where the draft is complete. Slots past kv_len are scratch that every round rewrites.
A hybrid target's (and a hybrid STANDALONE draft's) state slot holds the state after those
kv_len tokens: verify runs the tree's nodes from it without writing it, then commits the
state after the last accepted node.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from sgl_jax.layers import gated_delta_net
from sgl_jax.layers.attention import LayerKV, get_attention_backend
from sgl_jax.layers.attention.metadata import read_slots, write_slots
from sgl_jax.layers.sampler import SamplingBatch, sample
from sgl_jax.model_executor.forward_batch import (
    BatchShape,
    SeqChunk,
    build_forward_batch,
    kv_slots,
    token_positions,
    window_metadata,
)
from sgl_jax.model_executor.model_runner import (
    MAX_TOP_LOGPROBS,
    ModelRunner,
    PendingStep,
    _no_top_logprobs,
    _pad_rows,
    _top_logprobs,
    bitmask_words,
    greedy_sampling_batch,
)
from sgl_jax.models import qwen3_next
from sgl_jax.process_maps import WarmupForecast
from sgl_jax.speculative.drafts import DraftModel, TreeShape, allocate_draft_cache, grow_tree
from sgl_jax.speculative.tree import DraftTree, ancestor_mask, node_depths
from sgl_jax.speculative.verify import AcceptThresholds, Verdict, verify_tree

logger = logging.getLogger(__name__)

# Pending tokens one catch-up program extends the draft over, per request.
CATCH_UP_WIDTH = 8


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RoundRows:
    """Host arrays of the requests entering a round, padded to the batch bucket B."""

    slots: np.ndarray  # i32[B]: request slots (SlotState rows); -1: a padding row
    page_table: np.ndarray  # i32[B, P]: pages covering kv_len + SpecRunner.lookahead
    kv_lens: np.ndarray  # i32[B]: committed tokens before the root; -1: the slot's (a round
    # the host has not read yet decided it); the output position follows the same rule
    root_tokens: np.ndarray  # i32[B]: the request's last token; -1: the slot's
    min_new_tokens: np.ndarray  # i32[B]: EOS stays suppressed below this output position
    state_slots: np.ndarray  # i32[B]: a hybrid model's recurrent-state slots (0: none)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotState:
    """Each request slot's speculative state between rounds, on the device."""

    kv_lens: jax.Array  # i32[S]: committed tokens before the root, after the slot's last round
    num_sampled: jax.Array  # i32[S]: output tokens sampled by then (the next one's position)
    root_hidden: jax.Array  # f[S, H]: the draft's output at the root (SpecRunner.root_width)


@dataclass(frozen=True)
class CatchUpRow:
    """A request whose draft is behind its target by the tokens of some plain rounds."""

    slot: int  # its request slot: the caught-up draft's root is written there
    page_ids: Sequence[int]
    draft_len: int  # tokens the draft's cache holds (kv_len minus the pending ones)
    next_tokens: Sequence[int]  # per pending position p, the token at p + 1 (CATCH_UP_WIDTH)
    features: np.ndarray  # f[len(next_tokens), F]: the target's features at those positions


@dataclass(frozen=True)
class RoundOutput:
    """Host copies of one round's results, one row per request."""

    tokens: np.ndarray  # i32[B, S+1]: accepted tokens then the bonus token
    num_accepted: np.ndarray  # i32[B]: a; the row emits tokens[:a+1]
    logprobs: np.ndarray | None  # f32[B, S+1]: raw target log-probability (None: not asked)
    top_logprob_ids: np.ndarray | None  # i32[B, S+1, MAX_TOP_LOGPROBS] (None: not asked)
    top_logprobs: np.ndarray | None  # f32[B, S+1, MAX_TOP_LOGPROBS]
    # i32[B, N]: the tree this round verified (node 0 = the root); None for a round where no
    # request had a draft (the target's decode step)
    tree_tokens: np.ndarray | None
    tree_parents: np.ndarray | None
    # f[B, F]: a plain round that left the draft behind: the target's features at the root,
    # for the catch-up; else None.
    features: np.ndarray | None = None


class PendingRound:
    """A dispatched round's results, still on the device: their copy to the host starts at
    once, and `result()` waits for it. Log-probabilities are copied only when asked for."""

    def __init__(self, num_rows: int, result: tuple, *, want_logprobs: bool,
                 want_top_logprobs: bool):
        verdict, logprobs, top, tree, features = result
        self._num_rows = num_rows
        self._arrays = (verdict.tokens, verdict.num_accepted,
                        logprobs if want_logprobs else None,
                        *(top if want_top_logprobs else (None, None)),
                        tree.tokens, tree.parents, features)
        for array in self._arrays:
            if array is not None:
                array.copy_to_host_async()

    def result(self) -> RoundOutput:
        n = self._num_rows
        return RoundOutput(*(None if a is None else np.asarray(a)[:n] for a in self._arrays))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Verified:
    """What a round's verification hands on, one row per request."""

    verdict: Verdict
    logprobs: jax.Array  # f32[B, S+1]: raw target log-probability of each emitted token
    top: tuple[jax.Array, jax.Array]  # i32 / f32[B, S+1, MAX_TOP_LOGPROBS] (zeros unless asked)
    features: jax.Array | None  # f[B*(S+1), F]: the target's features along the accepted
    # path (what the draft reads), or None for a draft that reads none


class SpecRunner:
    def __init__(
        self,
        target: ModelRunner,
        draft: DraftModel,
        shape: TreeShape,
        *,
        thresholds: AcceptThresholds,
        capture_layers: tuple[int, ...],
        attention_backend: str = "native",
        shapes: Sequence[TreeShape] = (),
    ):
        self.target = target
        self.draft = draft
        self.vocab_size = target.config.vocab_size
        self.shape = shape  # the flags' shape: the widest a round may take
        self.shapes = tuple(dict.fromkeys((*shapes, shape)))  # every shape a round may take
        self.thresholds = thresholds
        self.capture_layers = capture_layers
        self.page_size = target.page_size
        self.tp = target.tp
        self.attention = self.tp.attention(get_attention_backend(attention_backend))
        # Pages of the first attention layer (a hybrid model's layer 0 may be a state pool).
        config = target.config
        first_attention = next(i for i in range(config.num_layers)
                               if not config.is_linear_layer(i))
        num_pages = target.kv_cache[first_attention][0].shape[0]
        self.draft_kv: list[LayerKV] = allocate_draft_cache(
            draft, num_pages=num_pages, page_size=self.page_size, dtype=target.model.dtype,
            tp=self.tp, num_state_slots=target.num_state_slots,
        )
        self.root_width = draft.cache_config.hidden_size if draft.uses_target_features else 0
        num_slots = target.last_tokens.shape[0]
        self.slot_state = self.tp.put_replicated(SlotState(
            np.zeros(num_slots, np.int32), np.zeros(num_slots, np.int32),
            np.zeros((num_slots, self.root_width), target.model.dtype)))
        # Every program that writes the per-slot state (SlotState, the target's last tokens)
        # takes it donated, after the two caches.
        state_args = (2, 3, 4, 5)
        self._prefill = jax.jit(self._prefill_impl, donate_argnums=state_args)
        self._rounds = {s: jax.jit(functools.partial(self._round_impl, shape=s),
                                   donate_argnums=state_args) for s in self.shapes}
        self._draft_trees = jax.jit(functools.partial(self._draft_trees_impl, shape=shape),
                                    donate_argnums=(1,))
        self._masked_verify = jax.jit(functools.partial(self._masked_verify_impl, shape=shape),
                                      donate_argnums=state_args)
        self._catch_up = jax.jit(self._catch_up_impl, donate_argnums=(1, 2))
        # Plain rounds leave the draft behind when the policy may take them (a recurrent
        # draft's state would need its own catch-up: it keeps extending).
        self.defers_draft = (any(s.num_draft_tokens == 1 for s in self.shapes)
                             and draft.uses_target_features and not draft.recurrent)
        self.hybrid = config.is_hybrid
        # Seconds of one round by (shape, padded batch size), measured by warmup().
        self.round_seconds: dict[tuple[TreeShape, int], float] = {}

    @property
    def lookahead(self) -> int:
        """KV slots past kv_len a round may write: the verify window, or the draft windows,
        or the accepted tokens, whichever reaches furthest, for the widest shape."""
        def reach(shape: TreeShape) -> int:
            s, k, n = shape.num_steps, shape.topk, shape.num_draft_tokens
            window = max(s - 1, 0) * k + int(self.draft.root_in_window)
            return max(n, s + 1, window)
        return max(map(reach, self.shapes))

    # ------------------------------------------------------------------ host API

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
        batch has a draft), without waiting. An emitting row's sampled token and the draft's
        output at it (zeros without the draft) become its slot's root."""
        shape = self.target.buckets.shape_for(chunks)
        batch = build_forward_batch(chunks, page_size=self.page_size, shape=shape)
        rows = shape.num_logits
        draft_ids = _shifted_ids(chunks, shape, next_tokens)
        sampling = jax.tree.map(lambda a: _pad_rows(np.asarray(a), rows), sampling)
        (self.target.kv_cache, self.draft_kv, self.slot_state, self.target.last_tokens, out,
         top) = self._prefill(
            self.target.model.params, self.draft.params, self.target.kv_cache, self.draft_kv,
            self.slot_state, self.target.last_tokens, batch, sampling,
            _pad_rows(emits, rows, fill=False), _pad_rows(slots.astype(np.int32), rows, fill=-1),
            np.bool_(want_top_logprobs), draft_ids, np.bool_(run_draft))
        return PendingStep(len(chunks), out.tokens, out.logprob if want_logprobs else None,
                           top if want_top_logprobs else None)

    def round(self, rows: RoundRows, sampling: SamplingBatch, want_top_logprobs: bool,
              shape: TreeShape | None = None, *, num_rows: int | None = None,
              want_logprobs: bool = True) -> PendingRound:
        """Dispatch a round of `shape` (default: the flags') for every row: draft, verify,
        extend the draft; `sampling` has a host row per row of `rows`. Results come back for
        the first `num_rows` (default: every row)."""
        (self.target.kv_cache, self.draft_kv, self.slot_state, self.target.last_tokens,
         result) = self._rounds[shape or self.shape](
            self.target.model.params, self.draft.params, self.target.kv_cache, self.draft_kv,
            self.slot_state, self.target.last_tokens, rows, sampling,
            np.bool_(want_top_logprobs))
        return PendingRound(len(rows.slots) if num_rows is None else num_rows, result,
                            want_logprobs=want_logprobs, want_top_logprobs=want_top_logprobs)

    def draft_trees(self, rows: RoundRows) -> DraftTree:
        """The first half of a masked round: each row's tree of the flags' shape, as host
        arrays (tokens and parents i32[B, N]). Every row's length must be known (>= 0)."""
        tree, self.draft_kv = self._draft_trees(self.draft.params, self.draft_kv,
                                                self.slot_state, self.target.last_tokens, rows)
        return jax.device_get(tree)

    def masked_verify(self, rows: RoundRows, sampling: SamplingBatch, want_top_logprobs: bool,
                      tree: DraftTree, allowed: np.ndarray, *, num_rows: int | None = None,
                      want_logprobs: bool = True) -> PendingRound:
        """The second half: verify `tree` (draft_trees' for the same rows) with every node's
        target distribution masked by `allowed` (i32[B, N, W] bitmasks, W = ceil(V / 32), in
        place of `sampling.allowed`), then extend the draft."""
        (self.target.kv_cache, self.draft_kv, self.slot_state, self.target.last_tokens,
         result) = self._masked_verify(
            self.target.model.params, self.draft.params, self.target.kv_cache, self.draft_kv,
            self.slot_state, self.target.last_tokens, rows, tree, sampling,
            np.bool_(want_top_logprobs), allowed)
        return PendingRound(len(rows.slots) if num_rows is None else num_rows, result,
                            want_logprobs=want_logprobs, want_top_logprobs=want_top_logprobs)

    def catch_up(self, rows: Sequence[CatchUpRow]) -> None:
        """Extend each row's draft over its pending tokens (at most CATCH_UP_WIDTH); the
        draft's output at each row's last one becomes its slot's root."""
        padded = self.target.buckets.batch_padding(len(rows))
        page_table = self._page_table([row.page_ids for row in rows], padded)
        ints = np.zeros((2, padded), np.int32)  # draft_len, pending count
        slots = np.full(padded, -1, np.int32)
        tokens = np.zeros((padded, CATCH_UP_WIDTH), np.int32)
        features = np.zeros((padded, CATCH_UP_WIDTH, self.feature_width),
                            self.target.model.dtype)
        for i, row in enumerate(rows):
            count = len(row.next_tokens)
            ints[:, i] = row.draft_len, count
            slots[i] = row.slot
            tokens[i, :count] = row.next_tokens
            features[i, :count] = row.features
        self.draft_kv, self.slot_state = self._catch_up(
            self.draft.params, self.draft_kv, self.slot_state, tokens, features, page_table,
            *ints, slots)

    @property
    def feature_width(self) -> int:
        """F: the target features the draft reads per token (EAGLE3: the captured layers)."""
        hidden = self.target.config.hidden_size
        return hidden * len(self.capture_layers) if self.draft.feature_source == "aux" else hidden

    def warmup(self, sizes: Sequence[int] | None = None, *, rare_programs: bool = True) -> None:
        """Compile the round programs of the batch buckets `sizes` (default: every one) and
        time each for the adaptive policy (the fastest of a few runs after the compiling one:
        the others met some other load), then the prefill buckets. Without `rare_programs`,
        the programs few batches need (grammar-masked rounds, prefills of one-token chunks)
        are left to compile on first use, as are the buckets left out of `sizes`
        (`time_bucket` times those when the policy first meets them)."""
        buckets = self.target.buckets
        sizes = buckets.bs_paddings if sizes is None else tuple(sizes)
        prefills = [s for s in buckets.all_shapes() if rare_programs or s.q_block > 1]
        if self.defers_draft:  # rounds where no request has a draft: the target's decode steps
            self.target.warmup(self._decode_shapes(sizes))
        total = len(sizes) * (len(self.shapes) + 1) + len(prefills)
        forecast = WarmupForecast(total)
        with tqdm(total=total, desc="Compiling speculative buckets", unit="bucket") as bar:
            def compiled() -> None:
                forecast.compiled()
                bar.update()
            for size in sizes:
                rows = self._dummy_rows(size)
                self._time_rounds(rows, after_each=compiled)
                if rare_programs:
                    tree = self.draft_trees(rows)
                    self.masked_verify(
                        rows, greedy_sampling_batch(size, self.vocab_size), False, tree,
                        allow_every_id(tree.tokens.shape, self.vocab_size)).result()
                if self.defers_draft:
                    self._warm_catch_up(range(size))
                compiled()
            for shape in prefills:
                self._warm_prefill(shape)
                compiled()
        # Warm-up rounds wrote scratch into the slots; no request reads a slot before its
        # prefill writes its root.

    def time_bucket(self, size: int) -> None:
        """Compile and time the round programs of batch bucket `size` while serving: padding
        rows only (they write nothing, so the requests' slots and caches stay as they were),
        and a fixed number of runs (other nodes replay this call and must run the same
        rounds). The bucket's other programs (the target's decode step, the catch-up) are
        compiled with them, so no later batch of this size compiles."""
        self._time_rounds(self._padding_rows(size), runs=2, budget_s=0.0)
        if self.defers_draft:
            self.target.warmup(self._decode_shapes([size]))
            self._warm_catch_up([-1] * size)

    def _decode_shapes(self, sizes: Sequence[int]) -> list[BatchShape]:
        return [s for s in self.target.buckets.all_shapes()
                if s.q_block == 1 and s.num_tokens in sizes]

    def _warm_catch_up(self, slots: Sequence[int]) -> None:
        """A catch-up of nothing for `slots` (-1: padding, which writes no root)."""
        self.catch_up([CatchUpRow(slot, [0], 0, [], np.zeros((0, self.feature_width)))
                       for slot in slots])

    def _time_rounds(self, rows: RoundRows, *, after_each: Callable[[], None] = lambda: None,
                     runs: int = 5, budget_s: float = 1.0) -> None:
        """round_seconds of every shape for `rows`' bucket: a compiling run, then the
        fastest of `runs` (or of those that fit in `budget_s`)."""
        size = len(rows.slots)
        sampling = greedy_sampling_batch(size, self.vocab_size)
        for shape in self.shapes:
            def run(shape: TreeShape = shape) -> None:
                self.round(rows, sampling, False, shape).result()
            run()
            self.round_seconds[shape, size] = _fastest_seconds(run, runs, budget_s)
            after_each()

    def _warm_prefill(self, shape: BatchShape) -> None:
        chunks = _dummy_chunks(shape, self.target.buckets.context_len, self.page_size)
        count = len(chunks)
        if self.hybrid:
            chunks = [dataclasses.replace(c, state_slot=slot) for c, slot
                      in zip(chunks, self._dummy_state_slots(count), strict=True)]
        self.prefill(chunks, greedy_sampling_batch(count, self.vocab_size),
                     np.zeros(count, bool), False, [0] * count,
                     np.full(count, -1, np.int32)).result()

    # ------------------------------------------------------------------ host helpers

    def _page_table(self, page_ids: Sequence[Sequence[int]], padded: int) -> np.ndarray:
        """i32[padded, P]: each row's pages, then the null page."""
        table = np.zeros((padded, self.target.buckets.pages_per_seq), np.int32)
        for i, pages in enumerate(page_ids):
            table[i, : len(pages)] = pages
        return table

    def _dummy_rows(self, count: int) -> RoundRows:
        """Warm-up rows: real slots (a padding row may cost less than a request's), every
        token in the null page."""
        zeros = np.zeros(count, np.int32)
        return RoundRows(np.arange(count, dtype=np.int32),
                         np.zeros((count, self.target.buckets.pages_per_seq), np.int32),
                         zeros, zeros, zeros,
                         np.array(self._dummy_state_slots(count), np.int32))

    def _padding_rows(self, count: int) -> RoundRows:
        """Rows that are all padding (slot -1, the null page, the null state slot)."""
        zeros = np.zeros(count, np.int32)
        return RoundRows(np.full(count, -1, np.int32),
                         np.zeros((count, self.target.buckets.pages_per_seq), np.int32),
                         zeros, zeros, zeros, zeros)

    def _dummy_state_slots(self, count: int) -> list[int]:
        """Warm-up rows of a hybrid target need distinct real slots (their states are
        scratch: no request holds a slot during warm-up)."""
        if not self.hybrid:
            return [0] * count
        return [1 + i % (self.target.num_state_slots - 1) for i in range(count)]

    # ------------------------------------------------------------------ jitted bodies

    def _target_forward(self, params, kv, tokens, positions, metadata, state_slots):
        impl, config = self.target.model.impl, self.target.config
        hybrid = {}
        if self.hybrid:  # prompt chunks read and update their requests' states
            layer = functools.partial(gated_delta_net.forward_slots,
                                      config=config.linear_attention)
            hybrid = dict(state_slots=state_slots,
                          linear_attention=self.tp.linear_attention(layer))
        return impl.forward(params, kv, tokens, positions, metadata, config=config,
                            attention=self.attention, capture_layers=self.capture_layers,
                            **hybrid)

    def _target_verify_forward(self, params, kv, tokens, positions, metadata,
                               tree: gated_delta_net.TreeLayout):
        """A hybrid target over draft trees: linear layers return each node's state."""
        config = self.target.config
        layer = functools.partial(gated_delta_net.verify_slots, config=config.linear_attention)
        return qwen3_next.verify_forward(
            params, kv, tokens, positions, metadata, config=config, attention=self.attention,
            tree=tree, linear_attention=self.tp.linear_attention(layer),
            capture_layers=self.capture_layers)

    def _prefill_impl(self, target_params, draft_params, target_kv, draft_kv, slot_state,
                      last_tokens, batch, sampling, emits, slots, want_top, draft_ids,
                      run_draft):
        self._count_compilation("prefill", batch.input_ids.shape[0])
        hidden, target_kv, captured = self._target_forward(
            target_params, target_kv, batch.input_ids, batch.positions, batch.attention,
            batch.state_slots)
        logits = self.target.model.impl.compute_logits(
            target_params, hidden[batch.logits_indices], self.target.config)
        out = sample(logits, sampling, None, None)
        top = jax.lax.cond(want_top, _top_logprobs, _no_top_logprobs, logits)
        rows = batch.logits_indices.shape[0]
        if self.draft.uses_target_features:
            # The last token of a completed prompt pairs with the token just sampled.
            where = jnp.where(emits, batch.logits_indices, draft_ids.shape[0])
            draft_ids = draft_ids.at[where].set(out.tokens, mode="drop")

            def extend(draft_kv):  # -> root_hidden f[rows, H], draft_kv
                hidden_d, draft_kv = self.draft.forward(
                    draft_params, draft_kv, draft_ids, batch.positions,
                    self._features(hidden, captured), batch.attention, from_target=True)
                return hidden_d[batch.logits_indices], draft_kv

            def skip(draft_kv):
                return jnp.zeros((rows, self.root_width), self.target.model.dtype), draft_kv

            root_hidden, draft_kv = jax.lax.cond(run_draft, extend, skip, draft_kv)
        else:
            extra = dict(state_slots=batch.state_slots) if self.draft.recurrent else {}
            _, draft_kv = self.draft.forward(draft_params, draft_kv, batch.input_ids,
                                             batch.positions, None, batch.attention,
                                             from_target=True, **extra)
            root_hidden = jnp.zeros((rows, 0), self.target.model.dtype)
        where = jnp.where(emits & (slots >= 0), slots, last_tokens.shape[0])  # others: dropped
        slot_state = dataclasses.replace(
            slot_state, root_hidden=slot_state.root_hidden.at[where].set(root_hidden,
                                                                         mode="drop"))
        last_tokens = last_tokens.at[where].set(out.tokens, mode="drop")
        return target_kv, draft_kv, *self.tp.constrain_replicated(
            (slot_state, last_tokens, out, top))

    def _round_impl(self, target_params, draft_params, target_kv, draft_kv, slot_state,
                    last_tokens, rows: RoundRows, sampling, want_top, *, shape: TreeShape):
        self._count_compilation(f"round {_shape_name(shape)}", rows.slots.shape[0])
        inputs = _round_inputs(slot_state, last_tokens, rows, sampling)
        tree, draft_kv = self.draft_step(draft_params, draft_kv, inputs.root_tokens,
                                         inputs.root_hidden, rows.page_table, inputs.kv_lens,
                                         inputs.active, rows.state_slots, shape=shape)
        target_kv, verified = self.verify_step(
            target_params, target_kv, rows.page_table, inputs.kv_lens, inputs.active, tree,
            inputs.sampling, inputs.suppress_depth, want_top, rows.state_slots, shape=shape)
        features = root_hidden = None
        if shape.num_draft_tokens == 1 and self.defers_draft:
            features = verified.features  # f[B, F]: the root's, for a later catch-up
        else:
            root_hidden, draft_kv = self.extend_step(
                draft_params, draft_kv, tree, verified, rows.page_table, inputs.kv_lens,
                inputs.active, rows.state_slots)
        slot_state, last_tokens = _advance_slots(slot_state, last_tokens, rows.slots, inputs,
                                                 verified.verdict, root_hidden)
        return target_kv, draft_kv, *self.tp.constrain_replicated(
            (slot_state, last_tokens,
             (verified.verdict, verified.logprobs, verified.top, tree, features)))

    def _draft_trees_impl(self, draft_params, draft_kv, slot_state, last_tokens,
                          rows: RoundRows, *, shape: TreeShape):
        inputs = _round_inputs(slot_state, last_tokens, rows, None)
        tree, draft_kv = self.draft_step(draft_params, draft_kv, inputs.root_tokens,
                                         inputs.root_hidden, rows.page_table, inputs.kv_lens,
                                         inputs.active, rows.state_slots, shape=shape)
        return self.tp.constrain_replicated(tree), draft_kv

    def _masked_verify_impl(self, target_params, draft_params, target_kv, draft_kv, slot_state,
                            last_tokens, rows: RoundRows, tree, sampling, want_top,
                            node_allowed, *, shape: TreeShape):
        self._count_compilation("masked verify", tree.tokens.shape[0])
        inputs = _round_inputs(slot_state, last_tokens, rows, sampling)
        target_kv, verified = self.verify_step(
            target_params, target_kv, rows.page_table, inputs.kv_lens, inputs.active, tree,
            inputs.sampling, inputs.suppress_depth, want_top, rows.state_slots, shape=shape,
            node_allowed=node_allowed)
        root_hidden, draft_kv = self.extend_step(draft_params, draft_kv, tree, verified,
                                                 rows.page_table, inputs.kv_lens, inputs.active,
                                                 rows.state_slots)
        slot_state, last_tokens = _advance_slots(slot_state, last_tokens, rows.slots, inputs,
                                                 verified.verdict, root_hidden)
        return target_kv, draft_kv, *self.tp.constrain_replicated(
            (slot_state, last_tokens,
             (verified.verdict, verified.logprobs, verified.top, tree, None)))

    def _catch_up_impl(self, draft_params, draft_kv, slot_state, tokens, features, page_table,
                       draft_lens, counts, slots):
        self._count_compilation("catch-up", tokens.shape[0])
        batch, width = tokens.shape
        root_hidden, draft_kv = self.extend_draft(
            draft_params, draft_kv, tokens, features.reshape(batch * width, -1), page_table,
            draft_lens, counts, jnp.zeros(batch, jnp.int32))
        where = jnp.where(slots >= 0, slots, slot_state.root_hidden.shape[0])
        slot_state = dataclasses.replace(
            slot_state, root_hidden=slot_state.root_hidden.at[where].set(root_hidden,
                                                                         mode="drop"))
        return draft_kv, self.tp.constrain_replicated(slot_state)

    def draft_step(self, params, kv: list[LayerKV],
                   root_tokens: jax.Array,  # i32[B]: each request's last token
                   root_hidden: jax.Array,  # f[B, H]: the draft's output at the root
                   page_table: jax.Array,  # i32[B, P]
                   kv_lens: jax.Array,  # i32[B]: committed tokens before the root
                   active: jax.Array,  # bool[B]: padding rows write nothing
                   state_slots: jax.Array,  # i32[B]: a recurrent draft's slots
                   *, shape: TreeShape) -> tuple[DraftTree, list[LayerKV]]:
        """The round's first part (pure, jittable): grow each request's tree of `shape` from
        its root. The one-node shape (plain decoding) runs no draft at all."""
        if shape.num_draft_tokens == 1:
            return DraftTree(root_tokens[:, None], jnp.full((root_tokens.shape[0], 1), -1,
                                                             jnp.int32)), kv
        root_logits = None
        if self.draft.uses_target_features:
            root_logits = self.draft.logits(params, root_hidden)
        else:
            root_hidden = None
        return grow_tree(self.draft, params, kv, root_tokens, root_hidden, root_logits,
                         kv_lens, page_table, active, shape=shape, page_size=self.page_size,
                         state_slots=state_slots)

    def verify_step(self, target_params, target_kv: list[LayerKV],
                    page_table: jax.Array,  # i32[B, P]
                    kv_lens: jax.Array,  # i32[B]: committed tokens before the tree's root
                    active: jax.Array,  # bool[B]: padding rows write nothing
                    tree: DraftTree,  # [B, N]
                    sampling: SamplingBatch,  # B rows, one per request
                    suppress_depth: jax.Array,  # i32[B]: nodes shallower still suppress EOS
                    want_top: jax.Array,  # bool[]
                    state_slots: jax.Array,  # i32[B]: hybrid targets' slots
                    *, shape: TreeShape,
                    node_allowed: jax.Array | None = None,  # i32[B, N, W]: grammar bitmasks
                    ) -> tuple[list[LayerKV], Verified]:
        """The round's second part (pure, jittable): the target's forward over every tree with
        the tree mask, the acceptance walk, and the accepted nodes' K/V moved into place.
        `node_allowed` masks each node's distribution (else each request's row applies).
        A hybrid target's linear layers run the trees from each request's committed state
        without writing the pools; the state after the last accepted node is then committed
        to the request's slot (padding rows write nothing)."""
        batch, n = tree.tokens.shape
        depths = node_depths(tree.parents)
        positions = kv_lens[:, None] + depths
        metadata = window_metadata(page_table, kv_lens, jnp.where(active, n, 0), n,
                                   self.page_size, ancestor_mask(tree.parents))
        pools = list(target_kv)
        if self.hybrid:
            slots = jnp.where(active, state_slots, 0)
            layout = gated_delta_net.TreeLayout(
                slots, tree.parents, jnp.broadcast_to(active[:, None], tree.parents.shape))
            hidden, target_kv, captured = self._target_verify_forward(
                target_params, target_kv, tree.tokens.reshape(-1), positions.reshape(-1),
                metadata, layout)
        else:
            hidden, target_kv, captured = self._target_forward(
                target_params, target_kv, tree.tokens.reshape(-1), positions.reshape(-1),
                metadata, None)
        logits = self.target.model.impl.compute_logits(target_params, hidden,
                                                       self.target.config)  # f32[B*N, V]
        per_node = node_sampling(sampling, depths, suppress_depth)
        if node_allowed is not None:
            per_node = dataclasses.replace(per_node, allowed=node_allowed.reshape(batch * n, -1))
        verdict = verify_tree(tree, logits, per_node, num_steps=shape.num_steps,
                              thresholds=self.thresholds)
        if self.hybrid:
            last = jnp.take_along_axis(verdict.path, verdict.num_accepted[:, None], axis=1)[:, 0]
            target_kv = [
                gated_delta_net.commit_node(pools[i], nodes, slots, last, active)
                if self.target.config.is_linear_layer(i) else nodes
                for i, nodes in enumerate(target_kv)]
        if shape.topk > 1:  # a chain's accepted nodes are already consecutive
            target_kv = commit_path_kv(target_kv, page_table, kv_lens, verdict, self.page_size)
        path_rows = (jnp.arange(batch)[:, None] * n + jnp.maximum(verdict.path, 0)).reshape(-1)
        logprobs, top = _path_logprobs(logits[path_rows], verdict.tokens, want_top)
        features = (self._features(hidden, captured)[path_rows]
                    if self.draft.uses_target_features else None)
        return target_kv, Verified(verdict, logprobs, top, features)

    def extend_step(self, params, kv: list[LayerKV], tree: DraftTree, verified: Verified,
                    page_table: jax.Array, kv_lens: jax.Array, active: jax.Array,
                    state_slots: jax.Array) -> tuple[jax.Array, list[LayerKV]]:
        """The round's last part (pure, jittable): extend the draft over the accepted path;
        returns its output at the new root (f[B, H], the bonus token's pair; f[B, 0] for a
        draft that reads no target features). Arguments as for verify_step. A recurrent
        draft runs the path as a chain from each request's committed state and commits the
        state after its last token."""
        verdict = verified.verdict
        if self.draft.uses_target_features:  # pairs (features of node, the token after it)
            tokens = verdict.tokens
        else:  # the accepted path's own tokens, root first
            tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(verdict.path, 0), axis=1)
        valid = jnp.where(active, verdict.num_accepted + 1, 0)
        return self.extend_draft(params, kv, tokens, verified.features, page_table, kv_lens,
                                 valid, jnp.where(active, state_slots, 0))

    def extend_draft(self, params, kv: list[LayerKV],
                     tokens: jax.Array,  # i32[B, W]: the draft's input per position
                     features: jax.Array | None,  # f[B*W, F]: the target's, per position
                     page_table: jax.Array,  # i32[B, P]
                     start: jax.Array,  # i32[B]: tokens the draft's cache holds
                     valid: jax.Array,  # i32[B]: real positions per row (0: nothing written)
                     state_slots: jax.Array,  # i32[B]: a recurrent draft's slots (0: none)
                     ) -> tuple[jax.Array, list[LayerKV]]:
        """Run the draft over `valid` new positions per row from `start`; returns its output
        at each row's last one (f[B, H]; f[B, 0] for a draft that reads no target features).
        A recurrent draft runs them as a chain from each row's committed state and commits
        the state after the last."""
        batch, width = tokens.shape
        metadata = window_metadata(page_table, start, valid, width, self.page_size)
        positions = (start[:, None] + jnp.arange(width)).reshape(-1)
        last = jnp.maximum(valid - 1, 0)
        extra = {}
        if self.draft.recurrent:
            chain = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32) - 1, (batch, width))
            extra = dict(tree=gated_delta_net.TreeLayout(
                state_slots, chain, jnp.arange(width)[None, :] < valid[:, None]), commit=last)
        hidden, kv = self.draft.forward(params, kv, tokens.reshape(-1), positions,
                                        features, metadata, from_target=True, **extra)
        if not self.draft.uses_target_features:
            return jnp.zeros((batch, 0), self.target.model.dtype), kv
        root_hidden = jnp.take_along_axis(hidden.reshape(batch, width, -1),
                                          last[:, None, None], axis=1)[:, 0]
        return root_hidden, kv

    def _features(self, hidden: jax.Array, captured: tuple[jax.Array, ...]) -> jax.Array:
        """What the draft reads of the target per token: f[T, 3H] (EAGLE3) or f[T, H]."""
        if self.draft.feature_source == "aux":
            return jnp.concatenate(captured, axis=-1)
        return hidden

    def _count_compilation(self, kind: str, size: int) -> None:
        # Runs only while tracing, i.e. once per new bucket.
        self.target.num_compilations += 1
        logger.info("Compiling speculative %s #%d: size %d", kind, self.target.num_compilations,
                    size)


def commit_path_kv(kv: list[LayerKV], page_table: jax.Array, prefix_lens: jax.Array,
                   verdict: Verdict, page_size: int) -> list[LayerKV]:
    """Copy the K/V of each accepted node (at slot prefix + node index) to slot prefix + depth,
    so the accepted path lies in consecutive slots like ordinary decoded tokens."""
    depth = jnp.arange(1, verdict.path.shape[1])[None, :]  # i32[1, S]
    nodes = verdict.path[:, 1:]
    moved = (depth <= verdict.num_accepted[:, None]) & (nodes != depth)
    source = kv_slots(page_table, prefix_lens[:, None] + jnp.maximum(nodes, 0), page_size)
    dest = kv_slots(page_table, prefix_lens[:, None] + depth, page_size)
    source = jnp.where(moved, source, 0).reshape(-1)  # unmoved pairs copy the null slot
    dest = jnp.where(moved, dest, 0).reshape(-1)

    def move(pages: jax.Array) -> jax.Array:
        return write_slots(pages, dest, read_slots(pages, source))

    # A hybrid model's linear layers hold state pools, committed apart.
    return [layer if isinstance(layer, gated_delta_net.GdnState) else tuple(map(move, layer))
            for layer in kv]


def _path_logprobs(logits: jax.Array, tokens: jax.Array, want_top: jax.Array):
    """logits f32[B*(S+1), V] at the nodes that produced each emitted token, tokens i32[B, S+1]
    -> raw log-probabilities f32[B, S+1] and top ones [B, S+1, MAX_TOP_LOGPROBS] (or zeros)."""
    batch, width = tokens.shape
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens.reshape(-1, 1), axis=1).reshape(batch, width)
    top_ids, top_values = jax.lax.cond(want_top, _top_logprobs, _no_top_logprobs, logits)
    shape = (batch, width, MAX_TOP_LOGPROBS)
    return chosen, (top_ids.reshape(shape), top_values.reshape(shape))


def _shifted_ids(chunks: Sequence[SeqChunk], shape: BatchShape, next_tokens: Sequence[int]
                 ) -> np.ndarray:
    """i32[T]: at each token, the token after it (EAGLE3 pairs features t with token t+1)."""
    ids = np.zeros(shape.num_tokens, np.int32)
    for chunk, where, after in zip(chunks, token_positions(chunks, shape), next_tokens,
                                   strict=True):
        ids[where] = [*chunk.token_ids[1:], after]
    return ids


def node_sampling(sampling: SamplingBatch, depths: jax.Array, suppress_depth: jax.Array
                  ) -> SamplingBatch:
    """One sampling row per tree node (B*N rows) from one per request (B rows) and the node
    depths i32[B, N]: the request's parameters at the output position of that node's
    prediction, with EOS suppressed only where min_new_tokens still holds."""
    n = depths.shape[1]
    per_node = jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), sampling)
    suppressing = (depths < suppress_depth[:, None]).reshape(-1)
    return dataclasses.replace(
        per_node, position=per_node.position + depths.reshape(-1),
        suppress_ids=jnp.where(suppressing[:, None], per_node.suppress_ids, -1))


def allow_every_id(nodes: tuple[int, int], vocab_size: int) -> np.ndarray:
    """i32[B, N, W]: node bitmasks that allow every id at each of [B, N] nodes."""
    return np.full((*nodes, bitmask_words(vocab_size)), -1, np.int32)


@dataclass(frozen=True)
class _RoundInputs:
    """A round's per-row inputs on the device: the host's where it knows them, else the
    slot's (inside a jitted round)."""

    active: jax.Array  # bool[B]: padding rows write nothing
    kv_lens: jax.Array  # i32[B]
    root_tokens: jax.Array  # i32[B]
    root_hidden: jax.Array  # f[B, H]
    sampling: SamplingBatch | None  # positions from the slots where the host's are unknown
    suppress_depth: jax.Array  # i32[B]: nodes shallower than this suppress EOS


def _round_inputs(state: SlotState, last_tokens: jax.Array, rows: RoundRows,
                  sampling: SamplingBatch | None) -> _RoundInputs:
    slot = jnp.maximum(rows.slots, 0)
    unread = rows.kv_lens < 0  # a round the host has not read decided the length
    kv_lens = jnp.where(unread, state.kv_lens[slot], rows.kv_lens)
    roots = jnp.where(rows.root_tokens < 0, last_tokens[slot], rows.root_tokens)
    positions = state.num_sampled[slot]
    if sampling is not None:
        positions = jnp.where(unread, positions, sampling.position)
        sampling = dataclasses.replace(sampling, position=positions)
    return _RoundInputs(rows.slots >= 0, kv_lens, roots, state.root_hidden[slot], sampling,
                        jnp.maximum(rows.min_new_tokens - positions, 0))


def _advance_slots(state: SlotState, last_tokens: jax.Array, slots: jax.Array,
                   inputs: _RoundInputs, verdict: Verdict, root_hidden: jax.Array | None
                   ) -> tuple[SlotState, jax.Array]:
    """Each row's slot after the round: a + 1 more tokens committed and sampled, the bonus
    token as the root, and the draft's new root output (unchanged where the round left the
    draft behind: root_hidden None)."""
    where = jnp.where(inputs.active, slots, last_tokens.shape[0])  # padding: dropped
    grown = verdict.num_accepted + 1
    bonus = jnp.take_along_axis(verdict.tokens, verdict.num_accepted[:, None], axis=1)[:, 0]
    hidden = state.root_hidden
    if root_hidden is not None:
        hidden = hidden.at[where].set(root_hidden, mode="drop")
    state = SlotState(state.kv_lens.at[where].set(inputs.kv_lens + grown, mode="drop"),
                      state.num_sampled.at[where].set(inputs.sampling.position + grown,
                                                      mode="drop"),
                      hidden)
    return state, last_tokens.at[where].set(bonus, mode="drop")


def _shape_name(shape: TreeShape) -> str:
    return f"{shape.num_steps}/{shape.topk}/{shape.num_draft_tokens}"


def _fastest_seconds(fn, runs: int = 5, budget_s: float = 1.0) -> float:
    """The fastest of `runs` calls of fn, or of those that fit in `budget_s` (at least 2)."""
    times: list[float] = []
    while len(times) < runs and (len(times) < 2 or sum(times) < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _dummy_chunks(shape: BatchShape, context_len: int, page_size: int) -> list[SeqChunk]:
    """Chunks filling a bucket that write only into the null page (warm-up)."""
    if shape.q_block == 1:
        return [SeqChunk([0], 0, [0]) for _ in range(shape.num_tokens)]
    length = min(shape.num_tokens, context_len)
    return [SeqChunk([0] * length, 0, [0] * -(-length // page_size))]


