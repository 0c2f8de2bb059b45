"""DFLASH: a DFlash head (models/dflash.py) behind the drafter interface
(drafters/interface.py).

Its cache holds, at every committed position t, each layer's context keys and values made
from the target's captured layers at t (the prefill writes the prompt's, `advance` those of
the accepted path, a catch-up those plain rounds left behind). A round runs one block
[root, MASK x (B-1)] at the root's position over that cache and reads its first S drafts as
a chain (S = the round's steps, at most B-1): one draft forward a round, whatever S is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend, ModelCache
from sgl_jax.layers.sampler import vocab_top_k
from sgl_jax.model_executor.forward_batch import kv_slots, window_metadata
from sgl_jax.models import dflash
from sgl_jax.models.loader import LoadedDraft, LoadedModel
from sgl_jax.speculative.drafters.head_networks import target_head, target_head_logits
from sgl_jax.speculative.drafters.interface import DraftCache
from sgl_jax.speculative.round.tree import DraftTree, select_tree
from sgl_jax.speculative.spec_config import TreeShape


class DFlashDrafter:
    features = "aux"
    defers = True  # its cache is caught up from the target's features alone
    advances_on_plain = True
    full_depth = True
    pairs_next_token = False  # context t comes from the target's features at t alone
    slot_width = 0  # nothing per slot: the root token and the cache are all it reads

    def __init__(self, draft: LoadedDraft, target: LoadedModel, attention: AttentionBackend,
                 *, page_size: int):
        self.config: dflash.DFlashConfig = draft.config
        self.cache = DraftCache(self.config.layer)
        self.attention = attention
        self.page_size = page_size
        self.slot_dtype = target.dtype
        self.params = {"dflash": draft.params, "embed": target.params["embed"],
                       "lm_head": target_head(target)}
        self.vocab_size = target.config.vocab_size

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.config.capture_layers

    def reach(self, shape: TreeShape) -> int:
        return self.config.block_size if shape.num_draft_tokens > 1 else 0

    def chains(self, shape: TreeShape) -> bool:
        return shape.topk == 1

    def idle_hints(self, batch: int) -> None:
        return None

    def prefill(self, params, kv, batch, features, next_ids, run):
        rows = batch.logits_indices.shape[0]
        kv = jax.lax.cond(
            run, lambda kv: dflash.context_kv(params["dflash"], kv, features, batch.positions,
                                              batch.attention.slot_mapping, config=self.config),
            lambda kv: kv, kv)
        return jnp.zeros((rows, 0), self.slot_dtype), kv

    def propose(self, params, kv, inputs, page_table, state_slots, hints, *, shape):
        """One block per row at its root's position; a tree from the top-k of its first
        num_steps positions (a chain of argmaxes at top-k 1). Verification is exact whatever
        the drafts are."""
        roots = inputs.root_tokens
        batch, steps = roots.shape[0], shape.num_steps
        hidden, kv = self.block(params, kv, inputs, page_table)
        drafted = hidden[:, 1 : steps + 1]
        logits = target_head_logits(params["lm_head"], drafted.reshape(batch * steps, -1),
                                    self.vocab_size)
        logprobs = jax.nn.log_softmax(logits.reshape(batch, steps, -1), axis=-1)
        return position_topk_tree(roots, logprobs, topk=shape.topk,
                                  num_draft_tokens=shape.num_draft_tokens), kv

    def block(self, params, kv: ModelCache, inputs, page_table: jax.Array
              ) -> tuple[jax.Array, ModelCache]:
        """Each row's block [root, MASK x (B-1)] at its root's position over its cache: the
        final-normed outputs f[rows, B, H] and the cache, the block's keys written past the
        context."""
        roots = inputs.root_tokens
        batch, width = roots.shape[0], self.config.block_size
        block = jnp.full((batch, width), self.config.mask_token_id, jnp.int32).at[:, 0].set(roots)
        positions = inputs.kv_lens[:, None] + jnp.arange(width)
        metadata = window_metadata(page_table, inputs.kv_lens,
                                   jnp.where(inputs.active, width, 0), width, self.page_size,
                                   dflash.full_block_mask(batch, width))
        hidden, kv = dflash.block_forward(
            params["dflash"], kv, block.reshape(-1), positions.reshape(-1), metadata,
            config=self.config, attention=self.attention, embed=params["embed"])
        return hidden.reshape(batch, width, -1), kv

    def advance(self, params, kv, tree, verified, inputs, page_table, state_slots):
        """The context of the accepted path (the root and each accepted token)."""
        verdict = verified.verdict
        valid = jnp.where(inputs.active, verdict.num_accepted + 1, 0)
        return self.catch_up(params, kv, verdict.tokens, verified.features, page_table,
                             inputs.kv_lens, valid)

    def catch_up(self, params, kv: ModelCache,
                 tokens: jax.Array,  # i32[B, W]: only its shape is read
                 features: jax.Array,  # f[B*W, F]: the target's, per position
                 page_table: jax.Array,  # i32[B, P]
                 start: jax.Array,  # i32[B]: positions the cache holds
                 valid: jax.Array,  # i32[B]: real positions per row (0: nothing written)
                 ) -> tuple[jax.Array, ModelCache]:
        """Write the context of `valid` positions per row from `start`."""
        batch, width = tokens.shape
        offsets = jnp.arange(width)[None, :]
        positions = start[:, None] + offsets
        slots = jnp.where(offsets < valid[:, None],
                          kv_slots(page_table, positions, self.page_size), 0)
        kv = dflash.context_kv(params["dflash"], kv, features, positions.reshape(-1),
                               slots.reshape(-1), config=self.config)
        return jnp.zeros((batch, 0), self.slot_dtype), kv


def position_topk_tree(
    roots: jax.Array,  # i32[B]
    logprobs: jax.Array,  # f32[B, S, V]: block position 1..S's own distribution
    *,
    topk: int,
    num_draft_tokens: int,  # N, the root included
) -> DraftTree:
    """The best N-1 paths through each position's top-k tokens, scored as if positions were
    independent (a path's score is the sum of its tokens' log-probabilities): the `topk` best
    paths of each depth are extended by the next position's top-k, as EAGLE-2 grows its
    frontier, and `select_tree` keeps the best candidates, ancestors first."""
    batch, steps, _ = logprobs.shape
    top_scores, top_ids = vocab_top_k(logprobs, topk)  # [B, S, K]
    # Depths are scanned, not sliced: XLA moved each depth's slice below the top-k and sorted
    # the whole vocabulary once per depth (0.55 s a round on the demo model's CPU, not 3 ms).
    by_depth = (jnp.swapaxes(top_scores, 0, 1), jnp.swapaxes(top_ids, 0, 1).astype(jnp.int32))
    first = jnp.broadcast_to(jnp.arange(topk, dtype=jnp.int32), (batch, topk))

    def grow(frontier, depth_top):
        """The frontier's children at the next depth (child j of frontier node i at i*K + j)
        and the best k of them, numbered as candidates."""
        (frontier_scores, frontier_ids, offset), (position_scores, position_ids) = (frontier,
                                                                                    depth_top)
        child_scores = (frontier_scores[:, :, None] + position_scores[:, None, :]
                        ).reshape(batch, topk * topk)
        children = (child_scores, jnp.tile(position_ids, (1, topk)),
                    jnp.repeat(frontier_ids, topk, axis=1))
        best_scores, best = jax.lax.top_k(child_scores, topk)
        return (best_scores, (offset + best).astype(jnp.int32), offset + topk * topk), children

    start = (by_depth[0][0], first, jnp.int32(topk))
    _, (child_scores, child_tokens, child_parents) = jax.lax.scan(
        grow, start, (by_depth[0][1:], by_depth[1][1:]))  # each [S-1, B, K*K]

    def candidates(first_depth, later):
        later = jnp.moveaxis(later, 0, 1).reshape(batch, (steps - 1) * topk * topk)
        return jnp.concatenate([first_depth, later], 1)

    scores = candidates(by_depth[0][0], child_scores)
    tokens = candidates(by_depth[1][0], child_tokens)
    parents = candidates(jnp.full_like(first, -1), child_parents)
    return select_tree(roots, scores, tokens, parents, num_draft_tokens)
