"""Verification lengths per request: packed chain rounds.

A round of chain shape S/1/N verifies N nodes in every row of its batch bucket B: B * N
target tokens, whatever each row's chance of getting that deep. Its packed variant of width
W verifies W * B nodes in all (the round's token count, static per program): every real row
its root, and the rest go to the (row, depth) pairs of highest survival

    S_r(d) = prod_{j<=d} q_r(j),

the chance that request r's draft is accepted down to depth d (q_r: the policy's estimates
of its acceptance at each depth, measured over its own past rounds and shrunk towards the
server's). It is a global top-k, as DSpark's scheduler (arXiv 2607.05147, Alg. 1) and vLLM's
adaptive verification allocate tokens; survival falls with depth, so each row's share is a
prefix of its chain, and a request the draft predicts well verifies a longer one than a
request it does not. The policy times every width like any other shape and picks the one
with the most expected tokens a second, so the round's token count follows the batch's
acceptance and the measured cost of each count.

Where the drafter scores its own drafts (DraftTree.scores: its path's draft probability,
or DSpark's confidence head), the round's program reallocates the same budget by them
(`confident_nodes`): q_r(d) is then the calibrated acceptance of the node's own draft
probability at its depth (acceptance.Calibration, measured online over earlier rounds), so
a request verifies deep exactly where this round's draft is sure of itself. The width (the
budget) stays the host's choice from a round-old estimate, so the loop never waits.

The decision uses only the draft and the outcomes of earlier rounds, never the target's
verdict on the tokens it is about to verify, so the output distribution is the target's
(the paper's Appendix A: a cut that looked at a token's own draw would bias it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.speculative.acceptance import Calibration
from sgl_jax.speculative.config import TreeShape
from sgl_jax.speculative.round import RoundRows, nodes_per_row, packed_nodes
from sgl_jax.speculative.tree import DraftTree, node_depths


def packed_shapes(shapes: Sequence[TreeShape]) -> tuple[TreeShape, ...]:
    """The packed variants of the chain shapes among `shapes` that have two draft depths or
    more: widths 2, 4, 8, ... below their N (a width of N is the chain itself)."""
    variants = []
    for shape in shapes:
        chain = shape.topk == 1 and shape.num_draft_tokens == shape.num_steps + 1
        if not chain or shape.verify_width or shape.num_steps < 2:
            continue
        width = 2
        while width < shape.num_draft_tokens:
            variants.append(TreeShape(shape.num_steps, 1, shape.num_draft_tokens, width))
            width *= 2
    return tuple(variants)


def draft_counts(survival: np.ndarray, budget: int) -> np.ndarray:
    """survival f64[R, D] (each row non-increasing: S_r(1..D)) and a budget of draft nodes
    -> i32[R], the draft nodes each row verifies: the `budget` highest survivals, ties to
    the shallower depth, so every row's share is a prefix."""
    rows, depth = survival.shape
    if budget >= rows * depth:
        return np.full(rows, depth, np.int32)
    order = np.lexsort((np.tile(np.arange(depth), rows), -survival.reshape(-1)))
    chosen = order[: max(budget, 0)]
    return np.bincount(chosen // depth, minlength=rows).astype(np.int32)


def packed_budget(shape: TreeShape, bucket: int, num_rows: int) -> int:
    """Draft nodes a packed round of `shape` over `num_rows` requests in batch bucket
    `bucket` can verify beyond the rows' roots."""
    return shape.verify_width * bucket - num_rows


def expected_packed_tokens(survival: np.ndarray, budget: int, num_rows: int) -> float:
    """Tokens a packed round commits over the batch: one per row, plus the survival of every
    draft node it verifies (survival f64[R, D] of the rows with a draft)."""
    counts = draft_counts(survival, budget)
    verified = np.arange(survival.shape[1])[None, :] < counts[:, None]
    return num_rows + float(survival[verified].sum())


def confident_nodes(
    scores: jax.Array,  # f32[B, N]: each node's draft log-survival (DraftTree.scores)
    parents: jax.Array,  # i32[B, N]: the tree (-1: the root, and nodes cut or unused)
    calibration: jax.Array,  # f32[S, K]: acceptance by depth and draft-probability bin
    max_depths: jax.Array,  # i32[B]: the deepest node each row may verify (0: no draft)
    real: jax.Array,  # bool[B]: rows holding a request
    num_tokens: int,  # T: the packed round's tokens
) -> jax.Array:
    """i32[T]: the packed round's nodes (round.packed_nodes' layout) chosen on the device:
    every real row's root, then the draft nodes of highest calibrated survival (the product
    down its path of each node's calibrated acceptance given its parent), ties to the
    earlier node. A row's share is its first nodes (keep_first_nodes), so a node counts
    with the least survival of the nodes before it: in a chain that is its own."""
    batch, width = scores.shape
    steps, bins = calibration.shape
    up = jnp.maximum(parents, 0)
    own = jnp.exp(scores - jnp.take_along_axis(scores, up, axis=1))  # given its parent
    which = jnp.clip((own * bins).astype(jnp.int32), 0, bins - 1)
    depth = node_depths(parents)
    accept = calibration[jnp.clip(depth, 1, steps) - 1, which]  # f32[B, N]
    survival = jnp.ones((batch, width), jnp.float32)
    for node in range(1, width):  # parents come first; N is static and small
        above = jnp.take_along_axis(survival, up[:, node : node + 1], axis=1)[:, 0]
        survival = survival.at[:, node].set(above * accept[:, node])
    allowed = real[:, None] & (parents >= 0) & (depth <= max_depths[:, None])
    survival = jax.lax.cummin(jnp.where(allowed, survival, -1.0)[:, 1:], axis=1)
    by_rank = survival.T.reshape(-1)  # node-major: a stable sort prefers the earlier node
    order = jnp.argsort(-by_rank, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    budget = num_tokens - real.sum()
    chosen = ((rank < budget) & (by_rank >= 0)).reshape(width - 1, batch)
    return first_nodes(real.astype(jnp.int32) + chosen.sum(0), width, num_tokens)


def first_nodes(counts: jax.Array, width: int, num_tokens: int) -> jax.Array:
    """round.packed_nodes on the device: counts i32[B] -> i32[T], the first counts[r]
    nodes of every row r as flat indices r * N + node, then padding (B * N)."""
    batch = counts.shape[0]
    ends = jnp.cumsum(counts)
    token = jnp.arange(num_tokens)
    row = jnp.minimum(jnp.searchsorted(ends, token, side="right"), batch - 1)
    node = token - (ends[row] - counts[row])
    return jnp.where(token < ends[-1], row * width + node, batch * width).astype(jnp.int32)


def rows_for(shape: TreeShape, rows: RoundRows) -> RoundRows:
    """`rows` as a round of `shape` takes them: a packed shape's with the nodes it verifies
    (W * B of them; where the caller chose none, padding alone: warm-up and timing runs)
    and a calibration (the draft's own probabilities where the caller sent none), any other
    shape's with neither."""
    if not shape.verify_width:
        return dataclasses.replace(rows, packed_nodes=None, calibration=None)
    if rows.packed_nodes is None:
        batch = len(rows.slots)
        rows = dataclasses.replace(rows, packed_nodes=packed_nodes(
            [0] * batch, shape.num_draft_tokens, shape.verify_width * batch))
    if rows.calibration is None:
        uncalibrated = Calibration(shape.num_steps, 1.0).table(shape.num_steps)
        rows = dataclasses.replace(rows, calibration=uncalibrated)
    return rows


def round_packing(tree: DraftTree, rows: RoundRows) -> jax.Array | None:
    """i32[T] or None (not packed): the nodes a round verifies, inside its program: by the
    draft's own scores where it has them (confident_nodes, the host's calibration), else the
    host's choice (rows.packed_nodes, from the requests' measured acceptance)."""
    if rows.packed_nodes is None or tree.scores is None:
        return rows.packed_nodes
    return confident_nodes(tree.scores, tree.parents, rows.calibration, rows.max_depths,
                           rows.slots >= 0, rows.packed_nodes.shape[0])


def packed_counts(packed: jax.Array, nodes: tuple[int, int]) -> jax.Array:
    """i32[B]: the draft nodes (the root not counted) each row of a [B, N] round verifies
    in a packed round of `packed` i32[T]."""
    return jnp.maximum(nodes_per_row(packed, nodes) - 1, 0)
