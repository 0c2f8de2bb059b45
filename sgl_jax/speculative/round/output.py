"""What a round hands back to the host: its integer results packed into one array on the
device (`round_result`), so the engine thread makes one host copy of them, not one per
array, and reads them as views (`RoundOutput`).

The round's program also works out what the host's bookkeeping reads of each tree (each
node's depth, the deepest node, the deepest a packed round verified, what verification made
of each node), so the host walks no tree. Floating-point results stay arrays of their own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.model_executor.model_runner import start_host_copies
from sgl_jax.speculative.round.program import Verified
from sgl_jax.speculative.round.tree import DraftTree, node_depths

# What verification made of a draft node (RoundOutput.outcomes).
NODE_UNTRIED, NODE_REJECTED, NODE_ACCEPTED = 0, 1, 2


@dataclass(frozen=True)
class RoundOutput:
    """Host copies of one round's results, one row per request."""

    tokens: np.ndarray  # i32[B, S+1]: accepted tokens then the bonus token
    num_accepted: np.ndarray  # i32[B]: a; the row emits tokens[:a+1]
    logprobs: np.ndarray | None  # f32[B, S+1]: raw target log-probability (None: not asked)
    top_logprob_ids: np.ndarray | None  # i32[B, S+1, MAX_TOP_LOGPROBS] (None: not asked)
    top_logprobs: np.ndarray | None  # f32[B, S+1, MAX_TOP_LOGPROBS]
    # i32[B, N]: the tree this round verified (node 0 = the root)
    tree_tokens: np.ndarray
    tree_parents: np.ndarray
    # i32[B, N]: each node's depth in its tree (root and unused nodes 0), for the round's
    # bookkeeping: drafted depths, the deepest verified, calibration cells
    node_depths: np.ndarray
    deepest: np.ndarray  # i32[B]: the deepest node of each row's tree (node_depths' max)
    # i32[B] each: the draft nodes each row verified in a packed round, and the deepest of
    # them (None: not packed)
    verified_nodes: np.ndarray | None = None
    deepest_verified: np.ndarray | None = None
    # f32[B, N]: the draft's own log-survival of each node (DraftTree.scores; None: none)
    tree_scores: np.ndarray | None = None
    # i32[B, S+1]: the accepted path's node at each depth, -1 past it (Verdict.path), and
    # i32[B, N]: what verification made of each node (NODE_UNTRIED, NODE_REJECTED or
    # NODE_ACCEPTED; results.node_outcomes), both only with tree_scores, for calibration
    path: np.ndarray | None = None
    outcomes: np.ndarray | None = None


@dataclass(frozen=True)
class ResultColumns:
    """Which integer results a round hands back, each a contiguous block of its one flat
    i32[K] array (so each field's view is contiguous too, which numpy reads faster than a
    strided one); static: a compiled program's results carry it."""

    rows: int  # B
    steps: int  # S
    nodes: int  # N
    packed: bool  # verified_nodes and deepest_verified (a packed round)
    scored: bool  # the accepted path and the nodes' outcomes (a tree with scores: calibration)

    @functools.cached_property
    def blocks(self) -> dict[str, tuple[slice, tuple[int, ...]]]:
        """Each RoundOutput field's place in the flat array and its shape, [B] or [B, W]."""
        b, path, nodes = self.rows, (self.rows, self.steps + 1), (self.rows, self.nodes)
        shapes = {"tokens": path, "num_accepted": (b,), "tree_tokens": nodes,
                  "tree_parents": nodes, "node_depths": nodes, "deepest": (b,)}
        if self.packed:
            shapes |= {"verified_nodes": (b,), "deepest_verified": (b,)}
        if self.scored:
            shapes |= {"path": path, "outcomes": nodes}
        blocks, start = {}, 0
        for name, shape in shapes.items():
            size = int(np.prod(shape))
            blocks[name] = slice(start, start + size), shape
            start += size
        return blocks


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["ints", "logprobs", "top_ids", "top_logprobs", "scores"],
                   meta_fields=["columns"])
@dataclass(frozen=True)
class RoundResult:
    """A round's results on the device, as its program returns them."""

    ints: jax.Array  # i32[K]: every integer result, laid out as `columns` says
    logprobs: jax.Array  # f32[B, S+1] (zeros unless asked)
    top_ids: jax.Array  # i32[B, S+1, MAX_TOP_LOGPROBS] (zeros unless asked)
    top_logprobs: jax.Array  # f32[B, S+1, MAX_TOP_LOGPROBS]
    scores: jax.Array | None  # f32[B, N] or None (DraftTree.scores)
    columns: ResultColumns


def round_result(verified: Verified, tree: DraftTree, verified_nodes: jax.Array | None
                 ) -> RoundResult:
    """Inside a round's program: its results from the verification, the tree it verified
    [B, N] and, in a packed round, each row's verified draft nodes i32[B] (None: every node;
    a row's count is of its first nodes, a subtree)."""
    verdict = verified.verdict
    batch, nodes = tree.tokens.shape
    columns = ResultColumns(batch, verdict.tokens.shape[1] - 1, nodes,
                            verified_nodes is not None, tree.scores is not None)
    depths = node_depths(tree.parents)
    values = {"tokens": verdict.tokens, "num_accepted": verdict.num_accepted,
              "tree_tokens": tree.tokens, "tree_parents": tree.parents, "node_depths": depths,
              "deepest": depths.max(axis=1)}
    counted = jnp.ones(tree.parents.shape, bool)  # bool[B, N]: the nodes verified
    if columns.packed:
        counted = jnp.arange(nodes)[None, :] <= verified_nodes[:, None]
        values |= {"verified_nodes": verified_nodes,
                   "deepest_verified": jnp.where(counted, depths, 0).max(axis=1)}
    if columns.scored:
        values |= {"path": verdict.path,
                   "outcomes": verification_outcomes(tree.parents, verdict.path, counted)}
    ints = jnp.concatenate([values[name].reshape(-1).astype(jnp.int32)
                            for name in columns.blocks])
    return RoundResult(ints, verified.logprobs, *verified.top, tree.scores, columns)


def verification_outcomes(parents: jax.Array, path: jax.Array, counted: jax.Array
                          ) -> jax.Array:
    """i32[B, N]: what verification made of each node of trees `parents` i32[B, N] whose
    accepted path is `path` i32[B, S+1] (Verdict.path), among the `counted` ones bool[B, N]:
    tried (its parent on the path), and accepted (it on the path too) or rejected."""
    on_path = (path[:, :, None] == jnp.arange(parents.shape[1])).any(axis=1)  # bool[B, N]
    tried = counted & (parents >= 0) & jnp.take_along_axis(
        on_path, jnp.maximum(parents, 0), axis=1)
    return jnp.where(tried, jnp.where(on_path, NODE_ACCEPTED, NODE_REJECTED), NODE_UNTRIED)


class PendingRound:
    """A dispatched round's results, still on the device: their copy to the host starts at
    once, and `result()` waits for it. Log-probabilities are copied only when asked for."""

    def __init__(self, num_rows: int, result: RoundResult, *, want_logprobs: bool,
                 want_top_logprobs: bool):
        self._num_rows = num_rows
        self._columns = result.columns
        self._ints = result.ints
        self._others = (result.logprobs if want_logprobs else None,
                        *((result.top_ids, result.top_logprobs) if want_top_logprobs
                          else (None, None)),
                        result.scores)
        start_host_copies((self._ints, *self._others))

    def result(self) -> RoundOutput:
        n = self._num_rows
        ints = np.asarray(self._ints)  # one copy; every integer field is a view of it
        logprobs, top_ids, top_logprobs, scores = (
            None if a is None else np.asarray(a)[:n] for a in self._others)
        views = {name: ints[where].reshape(shape)[:n]
                 for name, (where, shape) in self._columns.blocks.items()}
        return RoundOutput(logprobs=logprobs, top_logprob_ids=top_ids,
                           top_logprobs=top_logprobs, tree_scores=scores, **views)

