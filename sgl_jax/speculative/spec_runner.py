"""SpecRunner: the jitted steps of speculative decoding, beside the target's ModelRunner.

Two steps, each one compiled function per bucket:

- `prefill`: the target's extend (prompt chunks) with its captured hidden states and the
  draft's extend over the same tokens; for the requests whose prompt is now complete, the
  draft's output at the last pair (the root the first tree grows from).
- `round`, one program per round shape (`TreeShape`: plain decoding is the one-node tree):
  `draft_step` (the tree grown from each request's root), `verify_step` (every tree in one
  target forward with the tree mask, the accepted path, its nodes' target KV moved to
  consecutive slots), then `extend_step` (the draft extended over the accepted tokens, which
  gives the next root). The parts are public so that a benchmark can time them apart.
- `catch_up`: the draft extended over the tokens that plain rounds committed without it (see
  below), from the target features those rounds returned.
- `undrafted_round`: a plain round where no request has a draft (see the adaptive policy's
  admission) is the target's own decode step, the plain engine's program: nothing of the
  one-node round (the tree walk, the features) is of use to such a batch.
- `draft_trees` then `masked_verify`, the flags' shape as two programs: the draft's trees
  come back to the host, which writes the ids a grammar allows at every node (each node's
  path walked in the request's matcher), then verify and extend run with those masks on the
  target's distributions. A grammar-constrained batch takes them (or a plain round). Every
  call takes host arrays only, so other nodes can replay it.

Trees are grown at the start of the round that verifies them, so each round may take another
shape (the adaptive policy's choice) without a program per pair of shapes; what passes from
one round to the next is the root's draft output, kept on the host with the request.

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
from collections.abc import Sequence
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
    StepOutput,
    _no_top_logprobs,
    _pad_rows,
    _top_logprobs,
    bitmask_words,
    greedy_sampling_batch,
)
from sgl_jax.models import qwen3_next
from sgl_jax.speculative.drafts import DraftModel, TreeShape, allocate_draft_cache, grow_tree
from sgl_jax.speculative.tree import DraftTree, ancestor_mask, node_depths
from sgl_jax.speculative.verify import AcceptThresholds, Verdict, verify_tree

logger = logging.getLogger(__name__)

# Pending tokens one catch-up program extends the draft over, per request.
CATCH_UP_WIDTH = 8


@dataclass(frozen=True)
class RoundRow:
    """One running request entering a verify round."""

    page_ids: Sequence[int]  # covering kv_len + SpecRunner.lookahead tokens
    kv_len: int
    root_token: int  # the request's last token (not in the cache yet): the trees' root
    root_hidden: np.ndarray  # f[H]: the draft's output at the root (SpecRunner.root_width)
    suppress_depth: int  # nodes shallower than this still suppress EOS (min_new_tokens)
    state_slot: int = 0  # hybrid targets: the request's recurrent-state slot


@dataclass(frozen=True)
class CatchUpRow:
    """A request whose draft is behind its target by the tokens of some plain rounds."""

    page_ids: Sequence[int]
    draft_len: int  # tokens the draft's cache holds (kv_len minus the pending ones)
    next_tokens: Sequence[int]  # per pending position p, the token at p + 1 (CATCH_UP_WIDTH)
    features: np.ndarray  # f[len(next_tokens), F]: the target's features at those positions


@dataclass(frozen=True)
class RoundOutput:
    """Host copies of one round's results, one row per request."""

    tokens: np.ndarray  # i32[B, S+1]: accepted tokens then the bonus token
    num_accepted: np.ndarray  # i32[B]: a; the row emits tokens[:a+1]
    logprobs: np.ndarray  # f32[B, S+1]: raw target log-probability of each token
    top_logprob_ids: np.ndarray  # i32[B, S+1, MAX_TOP_LOGPROBS]
    top_logprobs: np.ndarray  # f32[B, S+1, MAX_TOP_LOGPROBS]
    root_hidden: np.ndarray  # f[B, H]: the draft's output at the new root (the next round's)
    tree_tokens: np.ndarray  # i32[B, N]: the tree this round verified (node 0 = the root)
    tree_parents: np.ndarray  # i32[B, N]
    # f[B, F]: a plain round that left the draft behind: the target's features at the root,
    # for the catch-up (root_hidden is then the rows' own, unchanged); else None.
    features: np.ndarray | None = None


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
        self._prefill = jax.jit(self._prefill_impl, donate_argnums=(2, 3))
        self._rounds = {s: jax.jit(functools.partial(self._round_impl, shape=s),
                                   donate_argnums=(2, 3)) for s in self.shapes}
        self._draft_trees = jax.jit(functools.partial(self.draft_step, shape=shape),
                                    donate_argnums=(1,))
        self._masked_verify = jax.jit(functools.partial(self._masked_verify_impl, shape=shape),
                                      donate_argnums=(2, 3))
        self._catch_up = jax.jit(self._catch_up_impl, donate_argnums=(1,))
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
        *, run_draft: bool = True,
    ) -> tuple[StepOutput, np.ndarray]:
        """Extend target and draft (the target alone without `run_draft`: no request of the
        batch has a draft); returns the sampled tokens and, for emitting rows, the draft's
        output at the root (f[n, root_width]; zeros without the draft)."""
        shape = self.target.buckets.shape_for(chunks)
        batch = build_forward_batch(chunks, page_size=self.page_size, shape=shape)
        rows = shape.num_logits
        draft_ids = _shifted_ids(chunks, shape, next_tokens)
        row_slots = np.zeros(rows, np.int32)
        row_slots[: len(chunks)] = [chunk.state_slot for chunk in chunks]
        sampling = jax.tree.map(lambda a: _pad_rows(np.asarray(a), rows), sampling)
        self.target.kv_cache, self.draft_kv, out, top, root_hidden = self._prefill(
            self.target.model.params, self.draft.params, self.target.kv_cache, self.draft_kv,
            batch, sampling, _pad_rows(emits, rows, fill=False), np.bool_(want_top_logprobs),
            draft_ids, np.bool_(run_draft),
        )
        n = len(chunks)
        top_ids, top_values = (np.asarray(a)[:n] for a in top)
        output = StepOutput(np.asarray(out.tokens)[:n], np.asarray(out.logprob)[:n], top_ids,
                            top_values)
        return output, np.asarray(root_hidden)[:n]

    def round(self, rows: Sequence[RoundRow], sampling: SamplingBatch, want_top_logprobs: bool,
              shape: TreeShape | None = None) -> RoundOutput:
        """Draft, verify and extend every row with trees of `shape` (default: the flags');
        `sampling` has one host row per request."""
        self.target.kv_cache, self.draft_kv, result = self._rounds[shape or self.shape](
            self.target.model.params, self.draft.params, self.target.kv_cache, self.draft_kv,
            *self.round_arrays(rows, sampling), np.bool_(want_top_logprobs),
        )
        return _round_output(jax.device_get(result), len(rows))

    def undrafted_round(self, rows: Sequence[RoundRow], sampling: SamplingBatch,
                        want_top_logprobs: bool) -> RoundOutput:
        """A plain round for rows none of which has a draft: one decode step of the target
        (root_hidden comes back as zeros, features as None)."""
        chunks = [SeqChunk([row.root_token], row.kv_len, row.page_ids, state_slot=row.state_slot)
                  for row in rows]
        n = len(rows)
        out = self.target.step(chunks, sampling, np.full(n, -1, np.int32), np.ones(n, bool),
                               want_top_logprobs).result()
        roots = np.array([row.root_token for row in rows], np.int32)[:, None]
        top_ids, top_values = out.top_logprob_ids, out.top_logprobs
        if top_ids is None:  # not asked for: zeros, as a round returns them
            top_ids = np.zeros((n, MAX_TOP_LOGPROBS), np.int32)
            top_values = np.zeros((n, MAX_TOP_LOGPROBS), np.float32)
        return RoundOutput(
            tokens=out.tokens[:, None], num_accepted=np.zeros(n, np.int32),
            logprobs=out.logprobs[:, None], top_logprob_ids=top_ids[:, None],
            top_logprobs=top_values[:, None],
            root_hidden=np.zeros((n, self.root_width), self.target.model.dtype),
            tree_tokens=roots, tree_parents=np.full_like(roots, -1))

    def draft_trees(self, rows: Sequence[RoundRow], sampling: SamplingBatch) -> DraftTree:
        """The first half of a masked round: each row's tree of the flags' shape, as host
        arrays over the padded batch (tokens and parents i32[B, N])."""
        (page_table, kv_lens, active, root_tokens, root_hidden, _, _,
         state_slots) = self.round_arrays(rows, sampling)
        tree, self.draft_kv = self._draft_trees(
            self.draft.params, self.draft_kv, root_tokens, root_hidden, page_table, kv_lens,
            active, state_slots)
        return jax.device_get(tree)

    def masked_verify(self, rows: Sequence[RoundRow], sampling: SamplingBatch,
                      want_top_logprobs: bool, tree: DraftTree, allowed: np.ndarray
                      ) -> RoundOutput:
        """The second half: verify `tree` (draft_trees' for the same rows) with every node's
        target distribution masked by `allowed` (i32[B, N, W] bitmasks over the padded batch,
        W = ceil(V / 32), in place of `sampling.allowed`), then extend the draft."""
        (page_table, kv_lens, active, _, _, sampling, suppress_depth,
         state_slots) = self.round_arrays(rows, sampling)
        self.target.kv_cache, self.draft_kv, result = self._masked_verify(
            self.target.model.params, self.draft.params, self.target.kv_cache, self.draft_kv,
            page_table, kv_lens, active, tree, sampling, suppress_depth, state_slots,
            np.bool_(want_top_logprobs), allowed)
        return _round_output(jax.device_get(result), len(rows))

    def catch_up(self, rows: Sequence[CatchUpRow]) -> np.ndarray:
        """Extend each row's draft over its pending tokens (at most CATCH_UP_WIDTH); returns
        the draft's output at each row's last one, the next round's root (f[n, root_width])."""
        padded = self.target.buckets.batch_padding(len(rows))
        page_table = self._page_table([row.page_ids for row in rows], padded)
        ints = np.zeros((2, padded), np.int32)  # draft_len, pending count
        tokens = np.zeros((padded, CATCH_UP_WIDTH), np.int32)
        features = np.zeros((padded, CATCH_UP_WIDTH, self.feature_width),
                            self.target.model.dtype)
        for i, row in enumerate(rows):
            count = len(row.next_tokens)
            ints[:, i] = row.draft_len, count
            tokens[i, :count] = row.next_tokens
            features[i, :count] = row.features
        root_hidden, self.draft_kv = self._catch_up(
            self.draft.params, self.draft_kv, tokens, features, page_table, *ints)
        return np.asarray(root_hidden)[: len(rows)]

    @property
    def feature_width(self) -> int:
        """F: the target features the draft reads per token (EAGLE3: the captured layers)."""
        hidden = self.target.config.hidden_size
        return hidden * len(self.capture_layers) if self.draft.feature_source == "aux" else hidden

    def warmup(self) -> None:
        """Compile every round shape and prefill bucket now, and time each round program for
        the adaptive policy (the fastest of a few runs after the compiling one: the others
        met some other load)."""
        sizes, shapes = self.target.buckets.bs_paddings, self.target.buckets.all_shapes()
        if self.defers_draft:  # undrafted_round's decode steps
            self.target.warmup([s for s in shapes if s.q_block == 1])
        with tqdm(total=len(sizes) * (len(self.shapes) + 1) + len(shapes),
                  desc="Compiling speculative buckets", unit="bucket") as bar:
            for size in sizes:
                rows = self._dummy_rows(size)
                for shape in self.shapes:
                    self.round(rows, greedy_sampling_batch(size, self.vocab_size), False, shape)
                    self.round_seconds[shape, size] = _fastest_seconds(
                        lambda rows=rows, shape=shape, size=size: self.round(
                            rows, greedy_sampling_batch(size, self.vocab_size), False, shape))
                    bar.update()
                sampling = greedy_sampling_batch(size, self.vocab_size)
                tree = self.draft_trees(rows, sampling)
                self.masked_verify(rows, sampling, False, tree,
                                   allow_every_id(tree.tokens.shape, self.vocab_size))
                if self.defers_draft:
                    self.catch_up([CatchUpRow([0], 0, [], np.zeros((0, self.feature_width)))
                                   for _ in range(size)])
                bar.update()
            for shape in shapes:
                chunks = _dummy_chunks(shape, self.target.buckets.context_len, self.page_size)
                count = len(chunks)
                if self.hybrid:
                    chunks = [dataclasses.replace(c, state_slot=slot) for c, slot
                              in zip(chunks, self._dummy_state_slots(count), strict=True)]
                self.prefill(chunks, greedy_sampling_batch(count, self.vocab_size),
                             np.zeros(count, bool), False, [0] * count)
                bar.update()

    # ------------------------------------------------------------------ host helpers

    def round_arrays(self, rows: Sequence[RoundRow], sampling: SamplingBatch) -> tuple:
        """The host arrays a round takes, padded to the batch bucket: page_table i32[B, P],
        kv_lens i32[B], active bool[B], root_tokens i32[B], root_hidden f[B, H], sampling
        (B rows), suppress_depth i32[B], state_slots i32[B] (0, the null slot, for padding
        rows and targets without recurrent state)."""
        padded = self.target.buckets.batch_padding(len(rows))
        page_table = self._page_table([row.page_ids for row in rows], padded)
        ints = np.zeros((4, padded), np.int32)  # kv_len, root token, suppress depth, state slot
        active = np.arange(padded) < len(rows)
        root_hidden = np.zeros((padded, self.root_width), self.target.model.dtype)
        for i, row in enumerate(rows):
            ints[:, i] = row.kv_len, row.root_token, row.suppress_depth, row.state_slot
            root_hidden[i] = row.root_hidden
        kv_lens, root_tokens, suppress_depth, state_slots = ints
        sampling = jax.tree.map(lambda a: _pad_rows(np.asarray(a), padded), sampling)
        return (page_table, kv_lens, active, root_tokens, root_hidden, sampling,
                suppress_depth, state_slots)

    def _page_table(self, page_ids: Sequence[Sequence[int]], padded: int) -> np.ndarray:
        """i32[padded, P]: each row's pages, then the null page."""
        table = np.zeros((padded, self.target.buckets.pages_per_seq), np.int32)
        for i, pages in enumerate(page_ids):
            table[i, : len(pages)] = pages
        return table

    def _dummy_rows(self, count: int) -> list[RoundRow]:
        root = np.zeros(self.root_width, self.target.model.dtype)
        return [RoundRow([0], 0, 0, root, 0, slot) for slot in self._dummy_state_slots(count)]

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

    def _prefill_impl(self, target_params, draft_params, target_kv, draft_kv, batch, sampling,
                      emits, want_top, draft_ids, run_draft):
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
        return target_kv, draft_kv, *self.tp.constrain_replicated((out, top, root_hidden))

    def _round_impl(self, target_params, draft_params, target_kv, draft_kv, page_table,
                    kv_lens, active, root_tokens, root_hidden, sampling, suppress_depth,
                    state_slots, want_top, *, shape: TreeShape):
        self._count_compilation(f"round {_shape_name(shape)}", root_tokens.shape[0])
        tree, draft_kv = self.draft_step(draft_params, draft_kv, root_tokens, root_hidden,
                                         page_table, kv_lens, active, state_slots, shape=shape)
        target_kv, verified = self.verify_step(target_params, target_kv, page_table, kv_lens,
                                               active, tree, sampling, suppress_depth,
                                               want_top, state_slots, shape=shape)
        features = None
        if shape.num_draft_tokens == 1 and self.defers_draft:
            features = verified.features  # f[B, F]: the root's, for a later catch-up
        else:
            root_hidden, draft_kv = self.extend_step(draft_params, draft_kv, tree, verified,
                                                     page_table, kv_lens, active, state_slots)
        return target_kv, draft_kv, self.tp.constrain_replicated(
            (verified.verdict, verified.logprobs, verified.top, root_hidden, tree, features))

    def _masked_verify_impl(self, target_params, draft_params, target_kv, draft_kv, page_table,
                            kv_lens, active, tree, sampling, suppress_depth, state_slots,
                            want_top, node_allowed, *, shape: TreeShape):
        self._count_compilation("masked verify", tree.tokens.shape[0])
        target_kv, verified = self.verify_step(target_params, target_kv, page_table, kv_lens,
                                               active, tree, sampling, suppress_depth,
                                               want_top, state_slots, shape=shape,
                                               node_allowed=node_allowed)
        root_hidden, draft_kv = self.extend_step(draft_params, draft_kv, tree, verified,
                                                 page_table, kv_lens, active, state_slots)
        return target_kv, draft_kv, self.tp.constrain_replicated(
            (verified.verdict, verified.logprobs, verified.top, root_hidden, tree, None))

    def _catch_up_impl(self, draft_params, draft_kv, tokens, features, page_table, draft_lens,
                       counts):
        self._count_compilation("catch-up", tokens.shape[0])
        batch, width = tokens.shape
        root_hidden, draft_kv = self.extend_draft(
            draft_params, draft_kv, tokens, features.reshape(batch * width, -1), page_table,
            draft_lens, counts, jnp.zeros(batch, jnp.int32))
        return self.tp.constrain_replicated(root_hidden), draft_kv

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


def _round_output(result: tuple, n: int) -> RoundOutput:
    """The first n rows of a round's host results."""
    verdict, logprobs, top, root_hidden, tree, features = result
    return RoundOutput(
        tokens=verdict.tokens[:n], num_accepted=verdict.num_accepted[:n],
        logprobs=logprobs[:n], top_logprob_ids=top[0][:n], top_logprobs=top[1][:n],
        root_hidden=root_hidden[:n], tree_tokens=tree.tokens[:n],
        tree_parents=tree.parents[:n], features=None if features is None else features[:n],
    )


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


