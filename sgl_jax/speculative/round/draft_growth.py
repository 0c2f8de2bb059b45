"""EAGLE-2 drafting (`grow_tree`): a draft network (drafters/head_networks.DraftModel)
expands the best `topk` nodes by `topk` children a level, re-running the frontier with an
ancestor mask, and the best N-1 candidates become the round's tree."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from sgl_jax.layers import gated_delta_net
from sgl_jax.layers.attention import ModelCache
from sgl_jax.layers.sampler import vocab_top_k
from sgl_jax.model_executor.forward_batch import window_metadata
from sgl_jax.speculative.drafters.head_networks import DraftModel, Params
from sgl_jax.speculative.round.tree import DraftTree, ancestor_mask, node_depths, select_tree
from sgl_jax.speculative.spec_config import TreeShape


def grow_tree(
    draft: DraftModel,
    params: Params,
    kv: ModelCache,
    root_tokens: jax.Array,  # i32[B]: the last committed token of each request
    root_hidden: jax.Array | None,  # f[B, H]: EAGLE3's output at the root pair, fed forward
    root_logits: jax.Array | None,  # f32[B, Vd]: EAGLE3's prediction of the first draft token
    prefix_lens: jax.Array,  # i32[B]: draft KV entries already valid (the committed tokens)
    page_table: jax.Array,  # i32[B, P]
    active: jax.Array,  # bool[B]: padding rows write nothing
    *,
    shape: TreeShape,
    page_size: int,
    state_slots: jax.Array | None = None,  # i32[B]: a recurrent draft's state slots
) -> tuple[DraftTree, ModelCache]:
    """EAGLE-2 drafting: expand the best `topk` nodes by `topk` children for `num_steps`
    levels, then keep the best N-1 candidates by cumulative log-probability.

    Each step re-runs all frontier nodes so far in one window with an ancestor mask (a node
    sees the committed prefix, its ancestors and itself); re-running keeps the attention to
    "prefix + window" and costs a few extra rows of a one-layer draft.
    """
    steps, k = shape.num_steps, shape.topk
    batch = root_tokens.shape[0]
    window = _Window.start(root_tokens, draft.root_in_window)
    if root_logits is None:  # the root's prediction comes from running it
        hidden, kv = _run_window(draft, params, kv, window, prefix_lens, page_table, active,
                                 page_size, state_slots)
        root_logits = draft.logits(params, hidden[:, 0])
    scores, ids = vocab_top_k(jax.nn.log_softmax(root_logits, axis=-1), k)  # [B, K]
    tokens = draft.to_target(params, ids)
    candidates = [(scores, tokens, jnp.full((batch, k), -1, jnp.int32))]
    frontier = _Frontier(
        candidate=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k)),
        scores=scores, tokens=tokens,
        window_parent=jnp.full((batch, k), 0 if draft.root_in_window else -1, jnp.int32),
        inputs=None if root_hidden is None else jnp.repeat(root_hidden[:, None], k, axis=1),
    )
    num_candidates = k
    for step in range(1, steps):
        window = window.append(frontier)
        hidden, kv = _run_window(draft, params, kv, window, prefix_lens, page_table, active,
                                 page_size, state_slots)
        frontier_hidden = hidden[:, -k:]  # [B, K, H]
        logp = jax.nn.log_softmax(draft.logits(params, frontier_hidden.reshape(batch * k, -1)))
        child_logp, child_ids = vocab_top_k(logp.reshape(batch, k, -1), k)  # [B, K, K]
        child_scores = (frontier.scores[:, :, None] + child_logp).reshape(batch, k * k)
        child_tokens = draft.to_target(params, child_ids).reshape(batch, -1)
        child_parents = jnp.repeat(frontier.candidate, k, axis=1)
        candidates.append((child_scores, child_tokens, child_parents))
        if step < steps - 1:
            fed_back = frontier_hidden if draft.uses_target_features else None
            frontier = _next_frontier(child_scores, child_tokens, fed_back, num_candidates,
                                      window.size - k, k)
        num_candidates += k * k
    scores, tokens, parents = (jnp.concatenate(part, axis=1)
                               for part in zip(*candidates, strict=True))
    tree = select_tree(root_tokens, scores, tokens, parents, shape.num_draft_tokens)
    return tree, kv


@dataclass(frozen=True)
class _Frontier:
    """The nodes expanded at the next step."""

    candidate: jax.Array  # i32[B, K]: their candidate indices
    scores: jax.Array  # f32[B, K]: cumulative log-probabilities
    tokens: jax.Array  # i32[B, K]
    window_parent: jax.Array  # i32[B, K]: their parents' window indices (-1 = outside)
    inputs: jax.Array | None  # f[B, K, H]: their parents' outputs (EAGLE3)


def _next_frontier(child_scores, child_tokens, frontier_hidden, candidate_offset,
                   window_offset, k) -> _Frontier:
    """The best k children (by cumulative score) of the frontier just run."""
    scores, best = jax.lax.top_k(child_scores, k)  # [B, K]
    parent = best // k  # which frontier node each came from
    return _Frontier(
        candidate=(candidate_offset + best).astype(jnp.int32),
        scores=scores,
        tokens=jnp.take_along_axis(child_tokens, best, axis=1),
        window_parent=(window_offset + parent).astype(jnp.int32),
        inputs=(None if frontier_hidden is None
                else jnp.take_along_axis(frontier_hidden, parent[:, :, None], axis=1)),
    )


@dataclass(frozen=True)
class _Window:
    """The draft tokens run together in one step: [root,] then the frontiers, depth by depth."""

    tokens: jax.Array  # i32[B, W]
    parents: jax.Array  # i32[B, W]: window index of each node's parent, -1 = none
    inputs: jax.Array | None  # f[B, W, H]: hidden state fed with each token (EAGLE3)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def start(cls, root_tokens: jax.Array, with_root: bool) -> _Window:
        width = 1 if with_root else 0
        batch = root_tokens.shape[0]
        return cls(root_tokens[:, None][:, :width], jnp.full((batch, width), -1, jnp.int32),
                   None)

    def append(self, frontier: _Frontier) -> _Window:
        inputs = frontier.inputs
        if inputs is not None and self.inputs is not None:
            inputs = jnp.concatenate([self.inputs, inputs], axis=1)
        return _Window(jnp.concatenate([self.tokens, frontier.tokens], axis=1),
                       jnp.concatenate([self.parents, frontier.window_parent], axis=1), inputs)


def _run_window(draft, params, kv, window: _Window, prefix_lens, page_table, active,
                page_size, state_slots=None) -> tuple[jax.Array, ModelCache]:
    """hidden f[B, W, H] of every window node; a node at depth d sits at prefix_len + d
    counted from the first node after the committed prefix."""
    batch, width = window.tokens.shape
    positions = prefix_lens[:, None] + node_depths(window.parents)
    metadata = window_metadata(page_table, prefix_lens, jnp.where(active, width, 0), width,
                               page_size, ancestor_mask(window.parents))
    inputs = None if window.inputs is None else window.inputs.reshape(batch * width, -1)
    extra = {}
    if draft.recurrent:  # each window node from its parent's state; the pools stay as they are
        extra["tree"] = gated_delta_net.TreeLayout(
            jnp.where(active, state_slots, 0), window.parents,
            jnp.broadcast_to(active[:, None], window.parents.shape))
    hidden, kv = draft.forward(params, kv, window.tokens.reshape(-1), positions.reshape(-1),
                               inputs, metadata, from_target=False, **extra)
    return hidden.reshape(batch, width, -1), kv
