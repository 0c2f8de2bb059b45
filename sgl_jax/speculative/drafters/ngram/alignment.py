"""Model-free proposals (NGRAM / suffix decoding) aligned with what the device committed.

The host builds each request's proposal, a token trie of likely continuations rooted at the
last token the host knows: `tokens` / `parents` i32[M], node 0 the root, parents before
children, siblings with distinct tokens, unused nodes written as parent -1 and token 0.
The loop runs one round ahead, so by the time the proposal is verified the device has
committed 1 to S+1 more tokens (the `run`) that the host has not seen. Aligning walks the trie
along the run and re-roots it at the node reached; everything off that path is stale.

Everything is a dense [B, M] array op: a walk of R steps, log2(M) pointer-jumping rounds to
find the subtree, and one [B, N, M] compare to gather the kept nodes. No scatter, no callback.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.speculative.round.tree import DraftTree


def align_proposals(
    tokens: jax.Array,  # i32[B, M]: each row's proposal trie, node 0 = the host's last token
    parents: jax.Array,  # i32[B, M]: -1 for the root and for unused nodes
    run: jax.Array,  # i32[B, R]: tokens committed since the proposal's root, in order
    run_len: jax.Array,  # i32[B]: how many of `run` are real (0..R); 0 = same root
    root_tokens: jax.Array,  # i32[B]: each row's current root (the last committed token)
    *,
    num_nodes: int,  # N: nodes of the output tree, root included
    max_depth: int,  # S: deepest a node may sit below the new root
    scores: jax.Array | None = None,  # f32[B, M]: log path probability from node 0
) -> DraftTree:  # tokens / parents i32[B, N] (scores f32[B, N] from the new root)
    """Re-root each proposal at the node its run leads to and keep that node's descendants
    (depth <= S, the first N-1 in proposal order). A run that leaves the trie (a token with no
    matching child, or a run deeper than the trie) gives the root alone."""
    if num_nodes < 1 or max_depth < 0:
        raise ValueError(f"need num_nodes >= 1 and max_depth >= 0, got {num_nodes}, {max_depth}")
    new_root, matched = _walk_run(tokens, parents, run, run_len)
    reached, depth_below = _subtree_depths(parents, new_root)
    node = jnp.arange(parents.shape[1])[None, :]
    keep = matched[:, None] & reached & (node != new_root[:, None]) & (depth_below <= max_depth)
    if scores is not None:  # a kept node's given the new root: its path's less the root's
        scores = scores - jnp.take_along_axis(scores, new_root[:, None], axis=1)
    return _gather_kept(tokens, parents, keep, root_tokens, num_nodes, scores)


def _walk_run(
    tokens: jax.Array,  # i32[B, M]
    parents: jax.Array,  # i32[B, M]
    run: jax.Array,  # i32[B, R]
    run_len: jax.Array,  # i32[B]
) -> tuple[jax.Array, jax.Array]:  # new root i32[B], matched bool[B]
    """Follow run[:run_len] down the trie from node 0. Siblings carry distinct tokens, so at
    most one child matches per step; unused nodes have parent -1 and never match. R is static
    and small, so the loop unrolls."""
    batch = tokens.shape[0]
    current = jnp.zeros(batch, jnp.int32)
    matched = jnp.ones(batch, bool)
    for step in range(run.shape[1]):
        hit = (parents == current[:, None]) & (tokens == run[:, step : step + 1])  # bool[B, M]
        active = step < run_len
        matched &= ~active | hit.any(axis=1)
        current = jnp.where(active, jnp.argmax(hit, axis=1).astype(jnp.int32), current)
    return current, matched


def _subtree_depths(
    parents: jax.Array,  # i32[B, M]
    root: jax.Array,  # i32[B]
) -> tuple[jax.Array, jax.Array]:  # in subtree bool[B, M], depth below root i32[B, M]
    """Which nodes descend from (or are) `root`, and how many edges below it, by pointer
    jumping: each node points up and counts the edges it skipped; `root` and parentless nodes
    point to themselves and add nothing, so after ceil(log2 M) rounds every node points to
    where its upward path stops. That is log2(M) gathers instead of an M-step serial pass."""
    num = parents.shape[1]
    node = jnp.arange(num, dtype=jnp.int32)[None, :]
    stop = (parents < 0) | (node == root[:, None])  # bool[B, M]
    up = jnp.where(stop, node, parents)  # i32[B, M]
    hops = jnp.where(stop, 0, 1).astype(jnp.int32)  # edges from a node to `up`
    for _ in range(max(num - 1, 1).bit_length()):
        hops = hops + jnp.take_along_axis(hops, up, axis=1)
        up = jnp.take_along_axis(up, up, axis=1)
    return up == root[:, None], hops


def _gather_kept(
    tokens: jax.Array,  # i32[B, M]
    parents: jax.Array,  # i32[B, M]
    keep: jax.Array,  # bool[B, M]: candidates for output nodes 1.., the new root excluded
    root_tokens: jax.Array,  # i32[B]
    num_nodes: int,  # N
    scores: jax.Array | None,  # f32[B, M]: the nodes' log-probabilities below the new root
) -> DraftTree:
    """Output node j >= 1 is the j-th kept node in proposal order; the rest is padding.

    Proposal order puts every parent before its child, so a kept node's parent is the new
    root or a kept node with a smaller rank: taking the first N-1 stays ancestor-closed."""
    rank = jnp.cumsum(keep, axis=1, dtype=jnp.int32)  # i32[B, M]: kept nodes up to here
    slot = jnp.arange(1, num_nodes, dtype=jnp.int32)[None, :, None]  # output nodes 1..N-1
    # Source index of output node j: how many nodes come before the j-th kept one.
    source = jnp.sum(rank[:, None, :] < slot, axis=2, dtype=jnp.int32)  # i32[B, N-1]
    valid = slot[:, :, 0] <= rank[:, -1:]  # bool[B, N-1]
    source = jnp.minimum(source, tokens.shape[1] - 1)
    # A kept node's output index is its rank. Its parent is kept (same) or is the new root,
    # whose rank is 0 because all its descendants have larger indices: no remap needed.
    source_parent = jnp.maximum(jnp.take_along_axis(parents, source, axis=1), 0)
    kept_parents = jnp.take_along_axis(rank, source_parent, axis=1)
    kept_tokens = jnp.take_along_axis(tokens, source, axis=1)
    batch = tokens.shape[0]
    if scores is not None:
        kept_scores = jnp.where(valid, jnp.take_along_axis(scores, source, axis=1), 0.0)
        scores = jnp.concatenate([jnp.zeros((batch, 1), jnp.float32),
                                  kept_scores.astype(jnp.float32)], axis=1)
    return DraftTree(
        tokens=jnp.concatenate(
            [root_tokens[:, None].astype(jnp.int32), jnp.where(valid, kept_tokens, 0)], axis=1
        ),
        parents=jnp.concatenate(
            [jnp.full((batch, 1), -1, jnp.int32), jnp.where(valid, kept_parents, -1)], axis=1
        ),
        scores=scores,
    )
