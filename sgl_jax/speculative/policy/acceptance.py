"""Acceptance estimates for the adaptive policy (shape_policy.py): per draft depth, how often a
request's (or the server's) rounds that verified the depth accepted it, given the depth
above was accepted; decayed counts, shrunk towards a prior."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sgl_jax.speculative.policy.acceptance_stats import rows_reaching
from sgl_jax.speculative.spec_config import TreeShape

INITIAL_RATE = 0.6  # the server-wide prior of every depth's acceptance before any round
PRIOR_WEIGHT = 2.0  # a request's estimate counts the server-wide one as this many tries


def family(shape: TreeShape) -> str:
    return "tree" if shape.topk > 1 else "chain"


@dataclass
class DepthCounts:
    """Decayed counts, per draft depth, of rounds that tried the depth and that accepted it."""

    depth: int  # the deepest a shape may draft
    decay: float
    tried: np.ndarray = field(init=False)  # f64[depth]
    accepted: np.ndarray = field(init=False)  # f64[depth]
    version: int = field(init=False, default=0)  # records so far: what a cached estimate read

    def __post_init__(self) -> None:
        self.tried = np.zeros(self.depth)
        self.accepted = np.zeros(self.depth)

    def record(self, steps: int | Sequence[int], num_accepted: int | Sequence[int]) -> None:
        """Rounds of `steps` draft depths (one for all, or one each: a packed round's rows
        verify their own) that accepted `num_accepted` each (one or several requests):
        depths 1..a were accepted, depth a+1 (if verified) was tried and rejected."""
        if np.ndim(num_accepted) == 0 and np.ndim(steps) == 0:  # one request's round
            self._record_one(int(steps), int(num_accepted))
            return
        accepted = [int(a) for a in np.atleast_1d(num_accepted)]
        steps = [int(s) for s in steps] if np.ndim(steps) else [int(steps)] * len(accepted)
        scale = self.decay ** len(accepted)
        self.tried = self.tried * scale + rows_reaching(
            [min(a + 1, s) for a, s in zip(accepted, steps, strict=True)], self.depth)
        self.accepted = self.accepted * scale + rows_reaching(accepted, self.depth)
        self.version += 1

    def _record_one(self, steps: int, num_accepted: int) -> None:
        """record() of one round, in place: a few slices where the general case builds
        [R, depth] masks (a request's record is updated each round it drafts)."""
        self.tried *= self.decay
        self.tried[: min(num_accepted + 1, steps)] += 1
        self.accepted *= self.decay
        self.accepted[:num_accepted] += 1
        self.version += 1


class Acceptance:
    """One request's (or the server's) depth counts for chains and for trees."""

    def __init__(self, depth: int, decay: float):
        self.counts = {f: DepthCounts(depth, decay) for f in ("chain", "tree")}

    @property
    def version(self) -> int:
        """Changes with every record (policy.expected_row_tokens caches on it)."""
        return self.counts["chain"].version + self.counts["tree"].version

    def record(self, shape: TreeShape, num_accepted: int | Sequence[int],
               steps: int | Sequence[int] | None = None) -> None:
        """A round of `shape` (`steps`: the depths each row verified, default the shape's)."""
        if shape.num_steps:
            self.counts[family(shape)].record(shape.num_steps if steps is None else steps,
                                              num_accepted)

    def rates(self, kind: str, server: Acceptance | None) -> np.ndarray:
        """f64[depth] for the family `kind` ("chain" or "tree"); see batch_rates. Without
        `server` (the server's own): each depth shrunk towards the estimate of the depth
        above, the first towards INITIAL_RATE."""
        if server is None:
            return carried(self.counts[kind])
        return batch_rates([self], kind, server)[0]


def record_each(records: Sequence[Acceptance], shape: TreeShape, num_accepted: Sequence[int],
                steps: Sequence[int]) -> None:
    """One round of `shape` for several requests, each in its own record (all of one decay):
    `Acceptance.record` for each, in a few array operations over the round's rows instead of
    several per row. Each record's counts become a row of the round's [R, depth] arrays."""
    if not shape.num_steps or not records:
        return
    counts = [record.counts[family(shape)] for record in records]
    decay = counts[0].decay
    if any(c.decay != decay for c in counts):
        raise ValueError("records of one round must share their decay")
    accepted = np.asarray(num_accepted)[:, None]  # [R, 1]
    depths = np.arange(counts[0].depth)[None, :]
    tried = np.stack([c.tried for c in counts]) * decay + (
        depths < np.minimum(accepted + 1, np.asarray(steps)[:, None]))
    hits = np.stack([c.accepted for c in counts]) * decay + (depths < accepted)
    for c, row_tried, row_accepted in zip(counts, tried, hits, strict=True):
        c.tried, c.accepted = row_tried, row_accepted
        c.version += 1


def shrunk(counts: DepthCounts, prior: np.ndarray) -> np.ndarray:
    """f64[depth]: acceptance of each depth given the one above, shrunk to `prior`."""
    return _shrink(counts.accepted, counts.tried, prior)


def carried(counts: DepthCounts) -> np.ndarray:
    """f64[depth]: like `shrunk`, each depth's prior being the estimate of the depth above
    (INITIAL_RATE for depth 1), so an untried depth inherits the deepest tried one's rate."""
    rates = np.empty(counts.depth)
    prior = INITIAL_RATE
    for depth in range(counts.depth):
        rates[depth] = prior = _shrink(counts.accepted[depth], counts.tried[depth], prior)
    return rates


def _shrink(accepted: np.ndarray, tried: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """Accepted over tried, with `prior` counted as PRIOR_WEIGHT tries (any leading shape)."""
    return (accepted + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)


def batch_rates(requests: Sequence[Acceptance], kind: str, server: Acceptance) -> np.ndarray:
    """f64[R, depth]: each request's rates for the family `kind`, shrunk towards the server's.
    What a request showed in the other family scales the server's rates first: text that
    defeats trees defeats chains too. One pass over the batch (this runs every round)."""
    other = "tree" if kind == "chain" else "chain"
    typical, typical_other = server.rates(kind, None), server.rates(other, None)
    def stacked(family_kind: str) -> tuple[np.ndarray, np.ndarray]:  # accepted, tried [R, D]
        counts = [r.counts[family_kind] for r in requests]
        return np.stack([c.accepted for c in counts]), np.stack([c.tried for c in counts])

    accepted_other, tried_other = stacked(other)
    mine_other = _shrink(accepted_other, tried_other, typical_other)
    base = np.where(tried_other.any(axis=1, keepdims=True),
                    np.clip(typical * mine_other / typical_other, 0.0, 1.0), typical)
    return _shrink(*stacked(kind), base)


CALIBRATION_BINS = 8  # draft-probability bins of Calibration
CALIBRATION_PRIOR = 4.0  # a cell's prior (its own draft probability) counts as this many tries


def calibration_cells(scores, parents, bins: int, xp=np):
    """Each node's column in a Calibration table and its draft probability given its
    parent, (i32[B, N], f[B, N]), from scores f[B, N] (DraftTree.scores) and parents
    i32[B, N]; `xp`: numpy on the host, jax.numpy in a round's program. Columns 0..bins-1
    hold the nodes that are their parent's most probable child, by bin of that probability;
    bins..2*bins-1 the other children: by probability alone a flat draft's first choice
    (often right) looks like its siblings (rarely right)."""
    up = xp.maximum(parents, 0)
    own = xp.exp(scores - xp.take_along_axis(scores, up, axis=1))
    which = xp.clip((own * bins).astype(xp.int32), 0, bins - 1)
    index = xp.arange(parents.shape[1])
    siblings = (parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0)
    beaten = (scores[:, None, :] > scores[:, :, None]) | (
        (scores[:, None, :] == scores[:, :, None]) & (index[None, None, :] < index[None, :, None]))
    first = ~xp.any(siblings & beaten, axis=2)  # [B, N]: no sibling ranks above it
    return which + bins * (~first).astype(xp.int32), own


class Calibration:
    """The server's online calibration of a drafter's own confidence: per draft depth and
    cell (calibration_cells: whether the node is its parent's most probable child, and the
    bin of its draft probability given its parent, DraftTree.scores), the decayed counts of
    verified nodes whose parent was accepted, and of those accepted. A cell's estimate
    starts at its draft probability and moves to what verification measures.

    Rounds are kept as recorded and counted together when the table or the error is read,
    or every FOLD_EVERY rounds: the counts are the same as round by round (each row weighted
    by the decay of the rows recorded after it), at a fraction of the host's work per round
    where only the error is read. A round's estimate ("predicted") is the table as it stood
    when its rounds were counted."""

    FOLD_EVERY = 32

    def __init__(self, depth: int, decay: float, bins: int = CALIBRATION_BINS):
        self.decay, self.bins = decay, bins
        self.tried = np.zeros((depth, 2 * bins))
        self.accepted = np.zeros((depth, 2 * bins))
        self.claimed = np.zeros((depth, 2 * bins))  # the tried nodes' summed draft probabilities
        self.predicted = np.zeros((depth, 2 * bins))  # ... and their calibrated estimates
        self.midpoints = np.tile((np.arange(bins) + 0.5) / bins, 2)
        self._recorded: list[tuple[np.ndarray, ...]] = []  # rounds not counted yet

    def record(self, scores: np.ndarray, parents: np.ndarray, depths: np.ndarray,
               tried: np.ndarray, accepted: np.ndarray) -> None:
        """Rounds' trees: scores f32[R, N] (DraftTree.scores), parents and node depths
        i32[R, N] each (RoundOutput.node_depths), and the nodes verification tried (its parent
        accepted) and accepted, bool[R, N] each (results.node_outcomes)."""
        self._recorded.append((scores, parents, depths, tried, accepted))
        if len(self._recorded) >= self.FOLD_EVERY:
            self._count_recorded()

    def _count_recorded(self) -> None:
        if not self._recorded:
            return
        rounds, self._recorded = self._recorded, []
        # A round's nodes decay with every row of the rounds recorded after it, as when each
        # round scaled the counts by the decay of its rows before adding its own.
        sizes = np.array([len(part[1]) for part in rounds])
        weights = self.decay ** (np.cumsum(sizes[::-1])[::-1] - sizes).astype(np.float64)
        estimates = self._rates(self.tried.shape[0]).ravel()  # the table before these rounds
        added = [np.zeros(self.tried.size) for _ in range(4)]  # tried, claimed, predicted, hit
        for width in {part[1].shape[1] for part in rounds}:  # shapes differ in tree width
            chosen = [i for i, part in enumerate(rounds) if part[1].shape[1] == width]
            arrays = (np.concatenate([rounds[i][k] for i in chosen]) for k in range(5))
            weight = np.repeat(weights[chosen], sizes[chosen])  # f64[R]: per row
            for total, part in zip(added, self._cell_counts(*arrays, weight, estimates),
                                   strict=True):
                total += part
        scale = self.decay ** float(sizes.sum())
        for counts, part in zip((self.tried, self.claimed, self.predicted, self.accepted), added,
                                strict=True):
            counts *= scale
            counts += part.reshape(counts.shape)

    def _cell_counts(self, scores, parents, depths, tried, accepted, weight: np.ndarray,
                     estimates: np.ndarray) -> tuple[np.ndarray, ...]:
        """Rows of one tree width (record's arrays, `weight` f64[R]): their weighted counts
        per flat cell of tried nodes, of their draft probabilities, of their `estimates`
        (f[depth * 2K]) and of accepted nodes."""
        some = tried.any(axis=1)  # rows without a tried node add nothing
        scores, parents, depths = scores[some], parents[some], depths[some]
        tried, accepted, weight = tried[some], accepted[some], weight[some]
        which, own = calibration_cells(np.asarray(scores, np.float64), parents, self.bins)
        depth = depths - 1  # a table row per draft depth
        tried = tried & (parents >= 0) & (depth < self.tried.shape[0])
        cells = depth * self.tried.shape[1] + which  # [R, N]: flat index into a table
        hit = tried & accepted
        node_weight = np.broadcast_to(weight[:, None], tried.shape)
        weight_tried, size = node_weight[tried], self.tried.size
        return tuple(np.bincount(index, w, minlength=size) for index, w in (
            (cells[tried], weight_tried), (cells[tried], weight_tried * own[tried]),
            (cells[tried], weight_tried * estimates[cells[tried]]),
            (cells[hit], node_weight[hit])))

    def table(self, steps: int) -> np.ndarray:
        """f32[steps, 2K]: each depth's acceptance by cell (confident_packing's calibration)."""
        self._count_recorded()
        return self._rates(steps)

    def _rates(self, steps: int) -> np.ndarray:
        rates = ((self.accepted + CALIBRATION_PRIOR * self.midpoints)
                 / (self.tried + CALIBRATION_PRIOR))
        return np.clip(rates[:steps], 1e-3, 1.0).astype(np.float32)

    def error(self) -> dict[str, float]:
        """The expected calibration error over the nodes counted (per depth and cell, the
        gap between the summed estimates and the nodes accepted, over all nodes tried) of
        the raw draft probabilities ("ece") and of the table's estimates as each round's
        nodes were counted ("calibrated_ece"), and the nodes counted."""
        self._count_recorded()
        total = float(self.tried.sum())
        if not total:
            return {"ece": 0.0, "calibrated_ece": 0.0, "nodes": 0.0}

        def gap(estimates: np.ndarray) -> float:
            return round(float(np.abs(self.accepted - estimates).sum()) / total, 4)

        return {"ece": gap(self.claimed), "calibrated_ece": gap(self.predicted),
                "nodes": round(total, 1)}
