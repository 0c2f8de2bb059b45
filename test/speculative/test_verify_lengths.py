"""Verification lengths per request (packed chain rounds): the allocation against an
exhaustive search, the policy's shares for requests its estimates tell apart, the packed
shapes offered and how a packed round cuts its trees; through the Engine, greedy output
equals plain decoding's with packed rounds for a draft model (the target as its own draft,
accepted all along) and for NGRAM (drafts from the text). With DSPARK, per-request shares
of a fitted head and sampled exactness: test_dflash_engine; the attention of a packed
batch: layers/test_native_attention."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.speculative.policy.acceptance import Acceptance, Calibration, calibration_cells
from sgl_jax.speculative.policy.request_lengths import (
    confident_packing,
    draft_counts,
    node_survival,
    packed_budget,
    packed_row_tokens,
    packed_shapes,
    round_tokens,
)
from sgl_jax.speculative.policy.shape_policy import PLAIN, SpeculationPolicy, candidate_shapes
from sgl_jax.speculative.round.output import PendingRound, RoundOutput, round_result
from sgl_jax.speculative.round.program import Verified, keep_first_nodes, packed_nodes
from sgl_jax.speculative.round.results import node_outcomes
from sgl_jax.speculative.round.tree import DraftTree, host_node_depths
from sgl_jax.speculative.round.verify import Verdict
from sgl_jax.speculative.spec_config import TreeShape
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.engines import believe_round_costs

CHAIN7 = TreeShape(7, 1, 8)
CHAIN3 = TreeShape(3, 1, 4)


def best_prefixes(survival: np.ndarray, budget: int) -> float:
    """The most survival any choice of per-row prefixes within `budget` nodes covers."""
    rows, depth = survival.shape
    best = 0.0
    for counts in itertools.product(range(depth + 1), repeat=rows):
        if sum(counts) <= budget:
            best = max(best, sum(survival[r, :c].sum() for r, c in enumerate(counts)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_allocation_covers_the_most_survival_any_prefixes_can(seed):
    rng = np.random.default_rng(seed)
    survival = np.cumprod(rng.uniform(0.2, 1.0, (3, 4)), axis=1)
    survival[1] = 0.0  # a row with nothing worth verifying
    for budget in range(0, 13):
        counts = draft_counts(survival, budget)
        assert counts.sum() == min(budget, survival.size)  # every node has a place
        covered = sum(survival[r, :c].sum() for r, c in enumerate(counts))
        assert covered == pytest.approx(best_prefixes(survival, budget))
        assert packed_row_tokens(survival, budget).sum() == pytest.approx(3 + covered)


def test_ties_go_to_the_shallower_depth_so_every_share_is_a_prefix():
    survival = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.5]])
    assert draft_counts(survival, 4).tolist() == [2, 2]
    assert draft_counts(survival, 5).tolist() == [3, 2]
    assert draft_counts(survival, 9).tolist() == [3, 3]


@pytest.mark.parametrize("seed", range(4))
def test_the_round_program_allocates_by_the_drafts_calibrated_scores(seed):
    """confident_packing (inside the round's program) against the host's allocation of the
    survival computed here: the calibrated acceptance of each node's own draft probability
    at its depth, multiplied down the chain; padding rows and depths past a row's cap get
    nothing, every real row its root."""
    rng = np.random.default_rng(seed)
    batch, width, bins = 5, 6, 4
    own = rng.uniform(0.05, 1.0, (batch, width - 1))
    scores = np.concatenate([np.zeros((batch, 1)), np.cumsum(np.log(own), 1)], 1)
    chain = np.tile(np.arange(-1, width - 1, dtype=np.int32), (batch, 1))
    # depths past 3 take row 3's; a chain's nodes are first choices: the left half
    table = rng.uniform(0.1, 1.0, (3, 2 * bins)).astype(np.float32)
    table[0, 0] = table[0, 1]  # a tie across rows
    max_depths = np.array([5, 2, 0, 5, 5], np.int32)
    real = np.array([True, True, True, False, True])
    steps = np.minimum(np.arange(width - 1), 2)
    cond = table[steps[None, :], np.clip((own * bins).astype(int), 0, bins - 1)]
    survival = np.cumprod(cond, axis=1)
    allowed = real[:, None] & (np.arange(1, width)[None, :] <= max_depths[:, None])
    for tokens in (5, 9, 14, 30):
        budget = min(tokens - real.sum(), int(allowed.sum()))
        expected = draft_counts(np.where(allowed, survival, -1.0), budget) + real
        assert allocated(scores, chain, table, max_depths, real, tokens) == packed_nodes(
            expected, width, tokens).tolist()


def allocated(scores, parents, table, max_depths, real, tokens) -> list[int]:
    return packing(scores, parents, table, max_depths, real, tokens)[1]


def packing(scores, parents, table, max_depths, real, tokens, node_tokens=None):
    """confident_packing on a tree of these scores and parents (tokens: each node's index
    unless given): the tree it returns as numpy arrays, and its packed nodes."""
    parents = jnp.asarray(parents)
    node_tokens = (jnp.broadcast_to(jnp.arange(parents.shape[1]), parents.shape)
                   if node_tokens is None else jnp.asarray(node_tokens))
    tree = DraftTree(node_tokens.astype(jnp.int32), parents,
                     scores=jnp.asarray(scores, jnp.float32))
    tree, packed = confident_packing(tree, jnp.asarray(table), jnp.asarray(max_depths),
                                     jnp.asarray(real), tokens)
    return jax.tree.map(np.asarray, tree), np.asarray(packed).tolist()


def test_a_tree_is_verified_best_first_so_a_share_is_its_most_probable_subtree():
    """Uncalibrated bins of 0.1 (each at its midpoint). Row 0: nodes 1 (p 0.93) and 2 (0.23)
    under the root, 3 (0.93) under 1: survival 0.95, 0.25, 0.9025, so the round verifies
    it as root, 1, 3, 2 (node 3's parent now 1, node 2's 0) and its second share is node 3,
    not the weak sibling. Row 1, a chain of 0.55s (0.55, 0.3025, 0.166), keeps its order."""
    table = np.tile((np.arange(10) + 0.5) / 10, (3, 2)).astype(np.float32)
    scores = np.log([[1, 0.93, 0.23, 0.93 ** 2], [1, 0.55, 0.55 ** 2, 0.55 ** 3]])
    parents = np.array([[-1, 0, 0, 1], [-1, 0, 1, 2]], np.int32)
    args = (table, np.array([3, 3], np.int32), np.array([True, True]))
    tree, packed = packing(scores, parents, *args, 5)
    assert tree.tokens.tolist() == [[0, 1, 3, 2], [0, 1, 2, 3]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0], [-1, 0, 1, 2]]
    assert tree.scores[0] == pytest.approx(np.log([1, 0.93, 0.93 ** 2, 0.23]), abs=1e-6)
    assert packed == [0, 1, 2, 4, 5]  # 0.95, 0.9025, then row 1's 0.55
    assert allocated(scores, parents, *args, 6) == [0, 1, 2, 4, 5, 6]  # then 0.3025
    assert allocated(scores, parents, *args, 7) == [0, 1, 2, 3, 4, 5, 6]  # the sibling's 0.25


def survival_reference(scores, parents, table, max_depths, real) -> np.ndarray:
    """calibrated_survival in numpy, node by node: -1 where a node may not be verified (a
    padding row, a node cut from the tree, past the row's cap) and below such a node. A
    node's column: its probability's bin, plus `bins` unless it is its parent's first
    choice (no sibling scores higher, or as high at a smaller index)."""
    batch, width = parents.shape
    steps, bins = table.shape[0], table.shape[1] // 2
    survival = np.ones((batch, width))
    depth = np.zeros((batch, width), int)
    for r, i in itertools.product(range(batch), range(1, width)):
        p = parents[r, i]
        depth[r, i] = 0 if p < 0 else depth[r, p] + 1
        own = np.exp(scores[r, i] - scores[r, max(p, 0)])
        first = p < 0 or not any(parents[r, j] == p and (scores[r, j], -j) > (scores[r, i], -i)
                                 for j in range(width))
        column = min(int(own * bins), bins - 1) + (0 if first else bins)
        accept = table[min(max(depth[r, i], 1), steps) - 1, column]
        ok = real[r] and p >= 0 and depth[r, i] <= max_depths[r] and survival[r, p] >= 0
        survival[r, i] = survival[r, p] * accept if ok else -1.0
    return survival


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_are_verified_best_first_with_shares_that_are_subtrees(seed):
    """Random trees (parents first, a child's draft probability below its parent's, a node
    cut, caps, a padding row): the round's order is the descending survival of the
    reference (the root first), every parent comes before its children, and each row's
    share is a subtree holding the budget's highest survivals across rows."""
    rng = np.random.default_rng(seed)
    batch, width, bins = 4, 7, 4
    parents = np.full((batch, width), -1, np.int32)
    for i in range(1, width):
        parents[:, i] = rng.integers(0, i, batch)
    parents[0, 3] = -1  # cut (its children, if any, go with it)
    own = rng.uniform(0.05, 1.0, (batch, width))
    scores = np.zeros((batch, width))
    for i in range(1, width):
        scores[:, i] = scores[np.arange(batch), np.maximum(parents[:, i], 0)] + np.log(own[:, i])
    table = rng.uniform(0.1, 1.0, (3, 2 * bins)).astype(np.float32)
    max_depths = np.array([3, 1, 3, 3], np.int32)
    real = np.array([True, True, False, True])
    survival = survival_reference(scores, parents, table, max_depths, real)
    for tokens in (4, 7, 11, 28):
        tree, packed = packing(scores, parents, table, max_depths, real, tokens)
        counts = np.bincount(np.asarray(packed) // width, minlength=batch + 1)[:batch]
        for r in range(batch):
            order = tree.tokens[r]  # each node's old index
            assert order[0] == 0
            assert np.all(np.diff(survival[r, order[1:]]) <= 1e-6), (r, order)
            new_parents = tree.parents[r]
            for i in range(1, width):
                if parents[r, order[i]] >= 0:
                    assert order[new_parents[i]] == parents[r, order[i]] and new_parents[i] < i
            kept = order[: counts[r]]
            assert all(parents[r, n] in kept for n in kept[1:])  # a subtree
        chosen = [survival[r, tree.tokens[r, i]] for r in range(batch)
                  for i in range(1, counts[r])]
        left = [survival[r, tree.tokens[r, i]] for r in range(batch)
                for i in range(max(counts[r], 1), width)]
        budget = tokens - real.sum()
        assert len(chosen) == min(budget, int((survival[:, 1:] >= 0).sum()))
        assert min(chosen, default=2.0) >= max([x for x in left if x >= 0], default=-1.0) - 1e-6


def test_calibration_learns_each_cells_acceptance_and_the_raw_error():
    """Rounds whose first choice at depth 1 claims 0.3 but is accepted 60% of the time, and
    whose second choice claims 0.25 (the same bin) and is accepted 5%: each cell moves from
    its prior to what it measures, apart although their bins are the same; the raw draft's
    calibration error shows the gaps (0.3 and 0.2), the table's own nearly none; an untried
    cell keeps its probability."""
    rng = np.random.default_rng(0)
    calibration = Calibration(depth=2, decay=1.0, bins=4)
    scores = np.log([[1.0, 0.3, 0.25, 0.3 * 0.9]])  # depth 2 (under node 1) claims 0.9
    parents = np.array([[-1, 0, 0, 1]])
    tried = np.array([[False, True, True, False]])  # depth 2 unverified
    for _ in range(400):
        draw = rng.random()
        hit = np.array([[False, draw < 0.6, 0.6 <= draw < 0.65, False]])
        calibration.record(scores, parents, host_node_depths(parents), tried, hit)
    table = calibration.table(2)
    assert table.shape == (2, 8)
    assert table[0, 1] == pytest.approx(0.6, abs=0.06)  # first choices, bin [0.25, 0.5)
    assert table[0, 4 + 1] == pytest.approx(0.05, abs=0.03)  # other children, same bin
    assert table[1].tolist() == pytest.approx([0.125, 0.375, 0.625, 0.875] * 2)
    error = calibration.error()
    assert error["ece"] == pytest.approx(0.25, abs=0.04) and error["nodes"] == 800
    assert error["calibrated_ece"] < 0.05  # the table, as each round found it, is close


def test_calibration_counts_rounds_together_as_it_would_one_by_one():
    """Rounds of different sizes and tree widths, counted as recorded (FOLD_EVERY 1) and all
    at once when the table is read: both the decayed counts of a round-by-round reference
    (each round scales the counts by the decay of its rows, then adds its nodes)."""
    rng = np.random.default_rng(1)
    one_by_one, together = Calibration(3, decay=0.9, bins=4), Calibration(3, decay=0.9, bins=4)
    one_by_one.FOLD_EVERY = 1
    expected = {"tried": np.zeros((3, 8)), "accepted": np.zeros((3, 8))}
    trees = [np.array([-1, 0, 0, 1, 2, 3]), np.array([-1, 0, 1])]  # two shapes' widths
    for round_index, rows in enumerate((3, 1, 4, 2, 5)):
        tree = np.tile(trees[round_index % 2], (rows, 1))
        scores = np.cumsum(np.log(rng.uniform(0.05, 1.0, tree.shape)), axis=1)
        tried = (rng.random(tree.shape) < 0.7) & (tree >= 0)
        hit = tried & (rng.random(tree.shape) < 0.5)
        for calibration in (one_by_one, together):
            calibration.record(scores, tree, host_node_depths(tree), tried, hit)
        which, _ = calibration_cells(scores, tree, 4)
        depth = host_node_depths(tree) - 1
        for name, nodes in (("tried", tried), ("accepted", hit)):
            expected[name] *= 0.9 ** rows
            np.add.at(expected[name], (depth[nodes], which[nodes]), 1.0)
    assert not together.tried.any()  # nothing counted until the table is read
    np.testing.assert_allclose(together.table(3), one_by_one.table(3), rtol=1e-6)
    for name, counts in expected.items():
        np.testing.assert_allclose(getattr(together, name), counts, rtol=1e-9)
        np.testing.assert_allclose(getattr(one_by_one, name), counts, rtol=1e-9)


def round_output(parents: np.ndarray, tokens: np.ndarray, path: np.ndarray,
                 emitted: np.ndarray, counts: np.ndarray | None, scores: np.ndarray | None,
                 num_rows: int) -> RoundOutput:
    """The host's view of a round of trees `parents` and `tokens` i32[B, N] whose accepted
    path is `path` i32[B, S+1] (emitting `emitted`; `counts`: a packed round's verified
    draft nodes i32[B]), as its program hands it back for the first `num_rows` rows."""
    accepted = (path[:, 1:] >= 0).sum(axis=1).astype(np.int32)
    logprobs = np.linspace(-1, 0, path.size, dtype=np.float32).reshape(path.shape)
    top = (np.zeros((*path.shape, 2), np.int32), np.zeros((*path.shape, 2), np.float32))
    verified = Verified(Verdict(path, accepted, emitted), logprobs, top, None)
    result = jax.jit(round_result)(verified, DraftTree(tokens, parents, scores=scores), counts)
    return PendingRound(num_rows, result, want_logprobs=True, want_top_logprobs=False).result()


def test_node_outcomes_read_the_accepted_path_of_each_tree():
    """Which nodes verification tried (parent on the accepted path) and accepted, as the
    round's program finds them from its accepted path, against a walk of the emitted tokens
    down each tree; a packed round counts only the nodes each row verified."""
    parents = np.array([[-1, 0, 0, 1, 1, 3, -1], [-1, 0, 1, 0, 3, 2, 2]], np.int32)
    tokens = np.array([[7, 4, 5, 8, 9, 6, 0], [3, 1, 2, 2, 4, 5, 6]], np.int32)
    path = np.array([[0, 1, 3, 5], [0, 3, -1, -1]], np.int32)  # -1 past the path
    accepted = (path[:, 1:] >= 0).sum(axis=1)
    emitted = np.where(path[:, 1:] >= 0, np.take_along_axis(tokens, np.maximum(path, 0),
                                                            axis=1)[:, 1:], 0).astype(np.int32)
    emitted = np.concatenate([emitted, np.zeros((2, 1), np.int32)], axis=1)  # the bonus
    on_path = np.zeros(parents.shape, bool)
    for row in range(2):  # walk the emitted tokens from the root
        node, on_path[row, 0] = 0, True
        for token in emitted[row, :accepted[row]]:
            node = next(n for n in range(7) if parents[row, n] == node and tokens[row, n] == token)
            on_path[row, node] = True
    expect_tried = (parents >= 0) & on_path[np.arange(2)[:, None], np.maximum(parents, 0)]
    scores = np.zeros(parents.shape, np.float32)
    for verified in (None, [5, 2]):
        counts = None if verified is None else np.array(verified, np.int32)
        output = round_output(parents, tokens, path, emitted, counts, scores, 2)
        counted = np.ones(parents.shape, bool) if verified is None else (
            np.arange(7)[None, :] <= np.array(verified)[:, None])
        for rows in ([0, 1], [1]):
            _, kept, depths, tried, hit = node_outcomes(output, rows)
            np.testing.assert_array_equal(kept, parents[rows])
            np.testing.assert_array_equal(tried, (expect_tried & counted)[rows])
            np.testing.assert_array_equal(hit, (expect_tried & counted & on_path)[rows])
            np.testing.assert_array_equal(depths, host_node_depths(parents)[rows])
    _, _, _, _, hit = node_outcomes(output, [0, 1])
    assert hit[0].tolist() == [False, True, False, True, False, True, False]


@pytest.mark.parametrize(("packed", "scored"), [(False, False), (False, True), (True, True)])
def test_a_rounds_integer_results_come_back_as_views_of_one_array(packed, scored):
    """A round's program packs its integer results into one array, with each node's depth,
    each tree's deepest node and, in a packed round, the deepest node each row verified
    (cut-off nodes, parent -1, count from themselves), and the accepted path where the tree
    has scores; the host reads the first rows back, each field a view of one copy equal to
    the array it came from."""
    rng = np.random.default_rng(3)
    parents = np.array([[-1, 0, 0, 1, 1, 3, -1], [-1, 0, 1, 0, 3, 2, 2],
                        [-1, 0, 1, 2, 3, 4, 5]], np.int32)
    tokens = rng.integers(0, 50, parents.shape).astype(np.int32)
    path = np.array([[0, 1, 3, 5], [0, 3, -1, -1], [0, 1, 2, 3]], np.int32)
    accepted = (path[:, 1:] >= 0).sum(axis=1).astype(np.int32)
    emitted = rng.integers(0, 50, path.shape).astype(np.int32)
    logprobs = np.linspace(-1, 0, path.size, dtype=np.float32).reshape(path.shape)  # as sent
    scores = rng.normal(size=parents.shape).astype(np.float32) if scored else None
    counts = np.array([5, 2, 6], np.int32) if packed else None
    output = round_output(parents, tokens, path, emitted, counts, scores, 2)
    depths = host_node_depths(parents)
    expected = {"tokens": emitted, "num_accepted": accepted, "tree_tokens": tokens,
                "tree_parents": parents, "node_depths": depths, "logprobs": logprobs}
    if scored:
        expected |= {"path": path, "tree_scores": scores}
    else:
        assert output.path is None and output.tree_scores is None
    for name, array in expected.items():
        np.testing.assert_array_equal(getattr(output, name), array[:2])
    assert output.deepest.tolist() == [3, 3]
    assert output.tokens.base is output.node_depths.base is not None  # one copy
    assert output.node_depths.flags.c_contiguous
    assert output.top_logprob_ids is None and output.top_logprobs is None
    if packed:
        assert output.verified_nodes.tolist() == [5, 2]
        assert output.deepest_verified.tolist() == [3, 2]
    else:
        assert output.verified_nodes is None and output.deepest_verified is None


def test_packed_variants_of_chains_and_trees():
    assert packed_shapes(candidate_shapes(CHAIN7)) == (TreeShape(7, 1, 8, 2),
                                                       TreeShape(7, 1, 8, 4))
    assert packed_shapes(candidate_shapes(TreeShape(3, 4, 8))) == (
        TreeShape(3, 1, 4, 2), TreeShape(3, 4, 8, 2), TreeShape(3, 4, 8, 4))
    assert packed_shapes([PLAIN, TreeShape(1, 1, 2), TreeShape(3, 1, 6)]) == ()
    assert TreeShape(7, 1, 8, 4).name == "7/1/8:4"


def test_a_full_bucket_of_alike_requests_shares_a_packed_rounds_nodes_evenly():
    """The admission rule's typical batch: at width W every row verifies W - 1 drafts."""
    alike = np.tile(np.cumprod(np.full(7, 0.5)), (8, 1))
    shapes = [CHAIN7, TreeShape(7, 1, 8, 2), TreeShape(7, 1, 8, 4)]
    tokens = round_tokens(shapes, {"chain": alike, "tree": alike}, 8, 8)
    assert [tokens[s] / 8 for s in shapes] == pytest.approx([2 - 0.5**7, 1.5, 1.875])
    counts = draft_counts(alike, packed_budget(TreeShape(7, 1, 8, 4), 8, 8))
    assert counts.tolist() == [3] * 8


def test_a_packed_tree_is_priced_as_its_top_chain_then_the_rest_of_the_tree():
    """The host's model of a tree's nodes: its first nodes are the top-1 chain's depths, the
    others share what the whole tree adds; all of them together are the whole tree."""
    tree_shape = TreeShape(3, 2, 6)
    survival = {"chain": np.array([[0.5, 0.25, 0.125], [0.9, 0.8, 0.7]]),
                "tree": np.array([[0.7, 0.5, 0.3], [0.95, 0.9, 0.85]])}
    nodes = node_survival(tree_shape, survival)
    assert nodes[0].tolist() == pytest.approx([0.5, 0.3125, 0.3125, 0.25, 0.125])
    assert nodes[1].tolist() == pytest.approx([0.9, 0.8, 0.7, 0.15, 0.15])
    whole = round_tokens([tree_shape, TreeShape(3, 2, 6, 4)], survival, 4, 2)
    assert whole[tree_shape] == pytest.approx(2 + 1.5 + 2.7)
    assert whole[TreeShape(3, 2, 6, 4)] == pytest.approx(2 + 1.5 + 2.7)  # 14 nodes for 10
    narrow = round_tokens([TreeShape(3, 2, 6, 2)], survival, 2, 2)
    assert narrow[TreeShape(3, 2, 6, 2)] == pytest.approx(2 + 0.9 + 0.8)  # the 2 best


def test_a_packed_round_teaches_only_the_depths_it_verified():
    """A row that verified 2 of 7 drafts and accepted both tried nothing deeper; one that
    verified 3 and accepted 1 was rejected at depth 2."""
    acceptance = Acceptance(7, 1.0)
    acceptance.record(TreeShape(7, 1, 8, 2), [2, 1], [2, 3])
    counts = acceptance.counts["chain"]
    assert counts.tried.tolist() == [2, 2, 0, 0, 0, 0, 0]
    assert counts.accepted.tolist() == [2, 1, 0, 0, 0, 0, 0]


def record(policy: SpeculationPolicy, accepted: int, rounds: int = 12) -> Acceptance:
    """A request whose chain rounds of 7 each accepted `accepted` drafts."""
    acceptance = policy.new_request()
    for _ in range(rounds):
        acceptance.record(CHAIN7, accepted)
        policy.server.record(CHAIN7, accepted)
    return acceptance


def costs(width_ms: dict[int, float], bucket: int = 4) -> dict:
    """Round seconds of CHAIN7 and its packed variants by verify width (8: the whole chain)."""
    table = {(PLAIN, bucket): 0.010, (TreeShape(1, 1, 2), bucket): 0.011}
    for width, ms in width_ms.items():
        shape = CHAIN7 if width == 8 else TreeShape(7, 1, 8, width)
        table[shape, bucket] = ms / 1000
    return table


def test_requests_the_draft_predicts_verify_longer_prefixes():
    shapes = candidate_shapes(CHAIN7) + packed_shapes(candidate_shapes(CHAIN7))
    policy = SpeculationPolicy(shapes, CHAIN7, costs({2: 12, 4: 14, 8: 20}), adaptive=True)
    good, poor = record(policy, 7), record(policy, 0)
    batch = [good, poor, good, None]  # the last request has no draft
    packed = TreeShape(7, 1, 8, 2)
    counts = policy.verify_counts(batch, packed, 4)
    assert counts.sum() <= packed_budget(packed, 4, len(batch)) == 4
    assert counts[3] == 0 and counts[1] < counts[0] and counts[1] < counts[2]
    wide = policy.verify_counts(batch, TreeShape(7, 1, 8, 4), 4)
    assert wide.sum() == 12 and min(wide[0], wide[2]) > wide[1]


def test_the_round_takes_the_width_whose_tokens_per_second_are_highest():
    shapes = candidate_shapes(CHAIN7) + packed_shapes(candidate_shapes(CHAIN7))
    cheap_packing = SpeculationPolicy(shapes, CHAIN7, costs({2: 11, 4: 12, 8: 30}),
                                      adaptive=True)
    batch = [record(cheap_packing, 7), record(cheap_packing, 1), record(cheap_packing, 0),
             record(cheap_packing, 1)]
    chosen = cheap_packing.choose(batch, 4)
    assert chosen.verify_width in (2, 4)
    lengths = cheap_packing.expected_tokens(batch, 4)
    assert lengths[TreeShape(7, 1, 8, 4)] <= lengths[CHAIN7]  # fewer nodes, fewer tokens
    flat_costs = SpeculationPolicy(shapes, CHAIN7, costs({2: 20, 4: 20, 8: 20}), adaptive=True)
    assert flat_costs.choose([record(flat_costs, 7)] * 4, 4) == CHAIN7


def test_keep_first_nodes_cuts_each_tree_after_its_count():
    tree = DraftTree(jnp.arange(12, dtype=jnp.int32).reshape(3, 4) + 5,
                     jnp.array([[-1, 0, 1, 2]] * 3, jnp.int32))
    packed = packed_nodes([4, 1, 2], 4, 8)
    assert packed.tolist() == [0, 1, 2, 3, 4, 8, 9, 12]
    cut, counts = jax.jit(keep_first_nodes)(tree, packed)
    assert counts.tolist() == [4, 1, 2]
    assert cut.parents.tolist() == [[-1, 0, 1, 2], [-1, -1, -1, -1], [-1, 0, -1, -1]]
    with pytest.raises(ValueError, match="7 nodes do not fit a packed round of 6 tokens"):
        packed_nodes([4, 1, 2], 4, 6)


BASE = dict(dtype="float32", precompile_token_paddings=[16, 64], precompile_bs_paddings=[4],
            max_prefill_tokens=64, context_length=256, page_size=16)
PACKED_CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=4, speculative_per_request_lengths=True)
# A whole chain of 3 costs four plain steps, its packed round (8 nodes over 4 rows) less
# than one: every round packs, whatever acceptance the policy measures.
PACKED_COSTS_MS = {"plain": 10, "1/1/2": 11, "3/1/4": 40, "3/1/4:2": 8}
MAX_NEW = [24, 17, 30, 12]


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    repeated = [7, 8, 9, 10, 11] * 6  # text NGRAM can draft from
    return [repeated, *(rng.integers(3, 500, n).tolist() for n in (9, 40, 21))]


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("packed") / "llama", "llama")


@pytest.fixture(scope="module")
def reference(target):
    with Engine(model_path=str(target), skip_server_warmup=True, **BASE) as engine:
        return [o["output_ids"] for o in engine.generate(
            input_ids=prompts(), sampling_params=[greedy(n) for n in MAX_NEW])]


PACKED_TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=6, speculative_per_request_lengths=True)
# The same for a tree of 3 levels, 2 branches, 6 nodes: only its packed round of width 4 is
# cheap, so every round verifies a best-first subtree of each row's tree.
PACKED_TREE_COSTS_MS = {"plain": 10, "1/1/2": 11, "3/1/4": 40, "3/1/4:2": 40, "3/2/6": 40,
                        "3/2/6:2": 40, "3/2/6:4": 8}
CASES = {"STANDALONE chain": ("STANDALONE", PACKED_CHAIN, PACKED_COSTS_MS, "3/1/4"),
         "NGRAM chain": ("NGRAM", PACKED_CHAIN, PACKED_COSTS_MS, "3/1/4"),
         "STANDALONE tree": ("STANDALONE", PACKED_TREE, PACKED_TREE_COSTS_MS, "3/2/6")}


@pytest.mark.parametrize("case", CASES)
def test_packed_rounds_give_plain_decodings_greedy_output(target, reference, case):
    algorithm, flags, costs_ms, whole = CASES[case]
    draft = {"speculative_draft_model_path": str(target)} if algorithm == "STANDALONE" else {}
    with Engine(model_path=str(target), speculative_algorithm=algorithm, **draft,
                **flags, **BASE) as engine:
        assert engine.runtime.builder.wait_idle(timeout=600)
        believe_round_costs(engine, costs_ms)
        out = engine.generate(input_ids=prompts(),
                              sampling_params=[greedy(n) for n in MAX_NEW])
        info = engine.get_server_info()
        assert engine.flush_cache() and engine.get_server_info()["kv_pages_in_use"] == 0
    assert [o["output_ids"] for o in out] == reference
    rounds = info["spec_rounds_by_shape"]
    packed = min(costs_ms, key=costs_ms.get)
    assert rounds[packed] > 0 and rounds[whole] == 0, rounds
    verified = np.sum([o["meta_info"]["spec_verified_per_position"] for o in out], axis=0)
    assert verified[0] > 0, verified
    if algorithm == "STANDALONE":  # its drafts are the target's: packed rows went deep and
        # what they verified was accepted (a tree's share the best-first subtree); a tiny
        # target's flat distribution keeps a tree of 6 nodes two levels deep
        depth = -1 if flags["speculative_eagle_topk"] == 1 else 1
        accepted = info["spec_accepted_per_position"][depth]
        assert accepted >= 0.8 * verified[depth] > 0, (verified, info)
