"""Draft trees on the device: their shape, their attention mask, and the EAGLE-2 rerank.

A tree of N nodes per request is two arrays: `tokens` i32[B, N] and `parents` i32[B, N].
Node 0 is the root (the last committed token, whose logits give the first draft position);
every other node's parent has a smaller index, so one pass in index order sees parents first.
A chain is the tree whose parents are 0, 1, 2, ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftTree:
    tokens: jax.Array  # i32[B, N]; node 0 is the root
    parents: jax.Array  # i32[B, N]; -1 for the root, else an index smaller than the node's
    # f32[B, N, V] or None: for a chain whose drafts were sampled, the distribution node i's
    # child was drawn from (verification's q); None: drafts chosen without a draw
    child_q: jax.Array | None = None
    # f32[B, N] or None: each node's log-survival by the draft's own estimate (its path's
    # summed draft log-probabilities, or a confidence head's; 0 at the root): what a packed
    # round allocates its nodes by (request_lengths.confident_packing). None: no estimate (the
    # host's allocation then stands)
    scores: jax.Array | None = None

    def structure(self) -> DraftTree:
        """Tokens and parents alone: what a round reports of its tree."""
        return DraftTree(self.tokens, self.parents)


def node_depths(parents: jax.Array) -> jax.Array:
    """parents i32[B, W] (-1 = no parent inside the array) -> i32[B, W] edges to a parentless
    node; the number of nodes W is static and small, so the loop unrolls."""
    depth = jnp.zeros(parents.shape, jnp.int32)
    for i in range(parents.shape[1]):
        parent = parents[:, i]
        above = jnp.take_along_axis(depth, jnp.maximum(parent, 0)[:, None], axis=1)[:, 0]
        depth = depth.at[:, i].set(jnp.where(parent < 0, 0, above + 1))
    return depth


def host_node_depths(parents: np.ndarray) -> np.ndarray:
    """node_depths in numpy, the tests' reference for the depths a round's program hands
    back (RoundOutput.node_depths): parents i32[B, N] -> i32[B, N]. By pointer jumping (each
    node counts the edges to where it points, then points twice as far up)."""
    parentless = parents < 0
    up = np.where(parentless, np.arange(parents.shape[1])[None, :], parents)
    depths = (~parentless).astype(np.int32)  # the root, and unused nodes, point to themselves
    for _ in range(max(parents.shape[1] - 1, 1).bit_length()):
        depths = depths + np.take_along_axis(depths, up, axis=1)
        up = np.take_along_axis(up, up, axis=1)
    return depths


def limit_depth(tree: DraftTree, max_depths: jax.Array) -> DraftTree:
    """The tree with every node deeper than its row's max_depths (i32[B]) cut off: its
    parent becomes -1, so verification never reaches it or anything below it."""
    depths = node_depths(tree.parents)
    return dataclasses.replace(
        tree, parents=jnp.where(depths > max_depths[:, None], -1, tree.parents))


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """parents i32[B, W] -> bool[B, W, W]: row i marks node i and all its ancestors, which is
    what node i may attend to among the W nodes."""
    batch, width = parents.shape
    mask = jnp.zeros((batch, width, width), bool)
    for i in range(width):
        parent = parents[:, i]
        inherited = jnp.take_along_axis(mask, jnp.maximum(parent, 0)[:, None, None], axis=1)
        row = jnp.where((parent >= 0)[:, None], inherited[:, 0], False).at[:, i].set(True)
        mask = mask.at[:, i].set(row)
    return mask


def select_tree(
    root_tokens: jax.Array,  # i32[B]
    scores: jax.Array,  # f32[B, C]: cumulative log-probability of each candidate
    tokens: jax.Array,  # i32[B, C]
    candidate_parents: jax.Array,  # i32[B, C]: parent candidate index, -1 = the root
    num_draft_tokens: int,  # N, the root included
) -> DraftTree:
    """Keep the N-1 best candidates (EAGLE-2 rerank) and index them as a tree.

    Candidates are listed parents first, and a child's score never exceeds its parent's, so
    a stable descending sort (ties keep the earlier index) picks a set closed under ancestors.
    Kept candidates stay in candidate order, so parents keep smaller indices.
    """
    batch, _ = scores.shape
    best = jnp.argsort(-scores, axis=1, stable=True)[:, : num_draft_tokens - 1]
    kept = jnp.sort(best, axis=1)  # i32[B, N-1]
    node_of = jnp.zeros(scores.shape, jnp.int32)
    rows = jnp.arange(batch)[:, None]
    node_of = node_of.at[rows, kept].set(jnp.arange(1, num_draft_tokens, dtype=jnp.int32))
    kept_parents = jnp.take_along_axis(candidate_parents, kept, axis=1)
    parent_nodes = jnp.where(
        kept_parents < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(kept_parents, 0), axis=1)
    )
    return DraftTree(
        tokens=jnp.concatenate([root_tokens[:, None], jnp.take_along_axis(tokens, kept, 1)], 1),
        parents=jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parent_nodes], axis=1),
        scores=jnp.concatenate([jnp.zeros((batch, 1), jnp.float32),
                                jnp.take_along_axis(scores, kept, 1).astype(jnp.float32)], 1),
    )
