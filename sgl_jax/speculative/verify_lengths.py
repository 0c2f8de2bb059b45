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

The decision uses only the outcomes of earlier rounds, never the tokens it is about to
verify, so the output distribution is the target's (the paper's Appendix A: a cut that
looked at a token's own draw would bias it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sgl_jax.speculative.config import TreeShape


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
