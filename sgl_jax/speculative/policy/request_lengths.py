"""Verification lengths per request: packed rounds, for chains and trees.

A round of shape S/K/N verifies N nodes in every row of its batch bucket B: B * N target
tokens, whatever each row's chance of getting that deep. Its packed variant of width W
verifies W * B nodes in all (the round's token count, static per program): every real row
its root, and the rest go to the (row, node) pairs of highest survival, for a chain

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
(`confident_packing`): a node's survival is then the product down its path of each node's
calibrated acceptance given its parent (acceptance.Calibration, by depth, by the node's
draft probability and by whether it is its parent's first choice, measured online over
earlier rounds), so a request verifies deep exactly where this round's draft is sure of
itself. A tree is first put in best-first order (a child never outranks its parent), so a
row's share, its first nodes, is the subtree of its most probable paths. The width (the
budget) stays the host's choice from a round-old estimate, so the loop never waits.

The decision uses only the draft and the outcomes of earlier rounds, never the target's
verdict on the tokens it is about to verify, so the output distribution is the target's
(the paper's Appendix A: a cut that looked at a token's own draw would bias it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.speculative.policy.acceptance import Calibration, calibration_cells, family
from sgl_jax.speculative.round.program import RoundRows, nodes_per_row, packed_nodes
from sgl_jax.speculative.round.tree import DraftTree, node_depths
from sgl_jax.speculative.spec_config import TreeShape


def packed_shapes(shapes: Sequence[TreeShape]) -> tuple[TreeShape, ...]:
    """The packed variants of the shapes among `shapes` with two draft nodes or more (chains
    of two steps or more, and trees): widths 2, 4, 8, ... below their N (a width of N is the
    shape itself)."""
    variants = []
    for shape in shapes:
        valid = shape.topk > 1 or shape.num_draft_tokens == shape.num_steps + 1
        if not valid or shape.verify_width or shape.num_draft_tokens < 3:
            continue
        width = 2
        while width < shape.num_draft_tokens:
            variants.append(dataclasses.replace(shape, verify_width=width))
            width *= 2
    return tuple(variants)


def node_survival(shape: TreeShape, survival: Mapping[str, np.ndarray]) -> np.ndarray:
    """f64[R, N-1]: what each draft node a row of `shape` may verify is worth, best first
    (each row non-increasing), from its request's survival by depth (f64[R, D] for each
    family, "chain" and "tree"). A chain's nodes are its depths. A tree is modelled as its
    top-1 chain, whose depths are the first nodes, plus the other nodes sharing evenly what
    the whole tree commits beyond that chain: the host's estimate for choosing a width; the
    round's program allocates a tree's nodes by their own draft scores (confident_packing)."""
    chain = survival["chain"][:, : min(shape.num_steps, shape.num_draft_tokens - 1)]
    if shape.topk == 1:
        return chain
    others = shape.num_draft_tokens - 1 - chain.shape[1]
    whole = survival["tree"][:, : shape.num_steps].sum(axis=1)
    gain = np.maximum(whole - chain.sum(axis=1), 0.0) / max(others, 1)
    nodes = np.concatenate([chain, np.repeat(gain[:, None], others, axis=1)], axis=1)
    return -np.sort(-nodes, axis=1)


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


def packed_row_tokens(survival: np.ndarray, budget: int) -> np.ndarray:
    """f64[R]: the tokens a packed round commits for each row with a draft (survival
    f64[R, D]): its root, plus the survival of every draft node the round verifies of it."""
    counts = draft_counts(survival, budget)
    verified = np.arange(survival.shape[1])[None, :] < counts[:, None]
    return 1.0 + np.where(verified, survival, 0.0).sum(axis=1)


def row_tokens(shape: TreeShape, survival: Mapping[str, np.ndarray], bucket: int,
               num_rows: int) -> np.ndarray:
    """f64[R]: the tokens a round of `shape` over `num_rows` requests in batch bucket
    `bucket` commits for each of the R with a draft (survival f64[R, D] by family): its root,
    plus the survival of each draft node it verifies (a packed round's by its packing)"""
    if shape.verify_width:
        return packed_row_tokens(node_survival(shape, survival),
                                 packed_budget(shape, bucket, num_rows))
    return 1.0 + survival[family(shape)][:, : shape.num_steps].sum(axis=1)


def round_tokens(shapes: Sequence[TreeShape], survival: Mapping[str, np.ndarray], bucket: int,
                 num_rows: int) -> dict[TreeShape, float]:
    """Per shape, the tokens a round over `num_rows` requests commits: one for each request
    without a draft, row_tokens for the others."""
    undrafted = num_rows - len(survival["chain"])
    return {s: undrafted + float(row_tokens(s, survival, bucket, num_rows).sum()) for s in shapes}


def calibrated_survival(
    tree: DraftTree,  # [B, N] with scores: each node's draft log-survival
    calibration: jax.Array,  # f32[S, 2K]: acceptance by depth and cell (calibration_cells)
    max_depths: jax.Array,  # i32[B]: the deepest node each row may verify (0: no draft)
    real: jax.Array,  # bool[B]: rows holding a request
) -> jax.Array:
    """f32[B, N]: each node's chance of being accepted, the product down its path of each
    node's calibrated acceptance given its parent (the root 1); -1 for a node the round may
    not verify (a padding row's, one cut from the tree or past its row's cap) and every node
    below it. A child's survival never exceeds its parent's (the table is at most 1)."""
    batch, width = tree.parents.shape
    steps, cells = calibration.shape
    up = jnp.maximum(tree.parents, 0)
    which, _ = calibration_cells(tree.scores, tree.parents, cells // 2, jnp)
    depth = node_depths(tree.parents)
    accept = calibration[jnp.clip(depth, 1, steps) - 1, which]  # f32[B, N]
    allowed = real[:, None] & (tree.parents >= 0) & (depth <= max_depths[:, None])
    survival = jnp.ones((batch, width), jnp.float32)
    for node in range(1, width):  # parents come first; N is static and small
        above = jnp.take_along_axis(survival, up[:, node : node + 1], axis=1)[:, 0]
        survival = survival.at[:, node].set(
            jnp.where(allowed[:, node] & (above >= 0), above * accept[:, node], -1.0))
    return survival


def best_first(tree: DraftTree, survival: jax.Array) -> tuple[DraftTree, jax.Array]:
    """The tree with each row's nodes in order of survival f32[B, N], highest first, and
    the survival in that order. The root stays first; a stable sort keeps parents before
    children (a child's survival is at most its parent's, a tie keeps the earlier index),
    so every prefix of a row is a subtree. A sampled chain (child_q) is already in order."""
    if tree.child_q is not None:
        return tree, survival
    order = jnp.argsort(-survival.at[:, 0].set(2.0), axis=1, stable=True)  # i32[B, N]
    position = jnp.argsort(order, axis=1)  # where each old node went

    def take(values: jax.Array) -> jax.Array:
        return jnp.take_along_axis(values, order, axis=1)

    parents = take(tree.parents)
    parents = jnp.where(parents >= 0, jnp.take_along_axis(
        position, jnp.maximum(parents, 0), axis=1), -1)
    return dataclasses.replace(tree, tokens=take(tree.tokens), parents=parents,
                               scores=take(tree.scores)), take(survival)


def confident_packing(
    tree: DraftTree,  # [B, N] with scores (DraftTree.scores)
    calibration: jax.Array,  # f32[S, 2K]
    max_depths: jax.Array,  # i32[B]
    real: jax.Array,  # bool[B]
    num_tokens: int,  # T: the packed round's tokens
) -> tuple[DraftTree, jax.Array]:
    """The round's tree in best-first order and its packed nodes i32[T] (round.packed_nodes'
    layout), chosen on the device: every real row's root, then the draft nodes of highest
    calibrated survival (calibrated_survival), ties to the earlier node. In best-first
    order each row's share is its first nodes (keep_first_nodes): a prefix of a chain, a
    subtree of a tree, the most probable paths first."""
    tree, survival = best_first(tree, calibrated_survival(tree, calibration, max_depths, real))
    batch, width = survival.shape
    by_rank = survival[:, 1:].T.reshape(-1)  # node-major: a stable sort prefers the earlier
    order = jnp.argsort(-by_rank, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    budget = num_tokens - real.sum()
    chosen = ((rank < budget) & (by_rank >= 0)).reshape(width - 1, batch)
    return tree, first_nodes(real.astype(jnp.int32) + chosen.sum(0), width, num_tokens)


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


def round_packing(tree: DraftTree, rows: RoundRows) -> tuple[DraftTree, jax.Array | None]:
    """The round's tree and the nodes it verifies, i32[T] or None (not packed), inside its
    program: by the draft's own scores where it has them (confident_packing, with the
    host's calibration; the tree comes back best first), else the host's choice
    (rows.packed_nodes, from the requests' measured acceptance) over the tree as drafted."""
    if rows.packed_nodes is None or tree.scores is None:
        return tree, rows.packed_nodes
    return confident_packing(tree, rows.calibration, rows.max_depths, rows.slots >= 0,
                             rows.packed_nodes.shape[0])


def packed_counts(packed: jax.Array, nodes: tuple[int, int]) -> jax.Array:
    """i32[B]: the draft nodes (the root not counted) each row of a [B, N] round verifies
    in a packed round of `packed` i32[T]."""
    return jnp.maximum(nodes_per_row(packed, nodes) - 1, 0)
