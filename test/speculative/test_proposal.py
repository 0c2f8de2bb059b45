"""Aligning host proposals with the tokens the device committed (and their scores
re-rooted), against a plain-Python reference: hand-worked tries first, then many random
tries with a small vocabulary so that runs often match, fail part way, or go deeper than
the trie."""

import jax
import numpy as np
import pytest

from sgl_jax.speculative.drafters.ngram.alignment import align_proposals
from sgl_jax.speculative.round.tree import node_depths

align = jax.jit(align_proposals, static_argnames=("num_nodes", "max_depth"))


def reference(tokens, parents, run, run_len, root_token, num_nodes, max_depth):
    """One row, by dicts and loops: walk the run, then list the reached node's descendants."""
    children = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, {})[tokens[i]] = i
    node = 0
    for token in run[:run_len]:
        node = children.get(node, {}).get(token)
        if node is None:
            break
    out_tokens, out_parents, reference.sources = [root_token], [-1], [None]
    if node is not None:
        out_of, depth = {node: 0}, {node: 0}
        for i in range(len(parents)):
            p = parents[i]
            if p in depth:  # parents come first, so a descendant's parent is already seen
                depth[i] = depth[p] + 1
                if depth[i] <= max_depth and len(out_tokens) < num_nodes:
                    out_of[i] = len(out_tokens)
                    out_tokens.append(tokens[i])
                    reference.sources.append((i, node))
                    assert p in out_of, "kept set must be closed under ancestors"
                    out_parents.append(out_of[p])
    pad = num_nodes - len(out_tokens)
    return out_tokens + [0] * pad, out_parents + [-1] * pad


def batch_arrays(rows, num_slots, run_slots):
    """rows: (tokens, parents, run, run_len, root_token); pads tries with unused nodes."""
    tokens = np.zeros((len(rows), num_slots), np.int32)
    parents = np.full((len(rows), num_slots), -1, np.int32)
    run = np.zeros((len(rows), run_slots), np.int32)
    for b, (tok, par, r, _, _) in enumerate(rows):
        tokens[b, : len(tok)], parents[b, : len(par)], run[b, : len(r)] = tok, par, r
    run_len = np.array([row[3] for row in rows], np.int32)
    root = np.array([row[4] for row in rows], np.int32)
    return tokens, parents, run, run_len, root


def check(rows, num_slots, run_slots, num_nodes, max_depth):
    tokens, parents, run, run_len, root = batch_arrays(rows, num_slots, run_slots)
    scores = -np.arange(tokens.size, dtype=np.float32).reshape(tokens.shape) % 7 / 3
    tree = align(tokens, parents, run, run_len, root, num_nodes=num_nodes, max_depth=max_depth,
                 scores=scores)
    got_tokens, got_parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    assert got_tokens.shape == got_parents.shape == (len(rows), num_nodes)
    assert got_tokens.dtype == got_parents.dtype == np.int32
    for b in range(len(rows)):
        want = reference(
            tokens[b].tolist(),
            parents[b].tolist(),
            run[b].tolist(),
            int(run_len[b]),
            int(root[b]),
            num_nodes,
            max_depth,
        )
        assert got_tokens[b].tolist() == want[0], b
        assert got_parents[b].tolist() == want[1], b
        # each kept node's score is its path's less the new root's (0 at root and padding)
        want_scores = [0.0 if kept is None else scores[b, kept[0]] - scores[b, kept[1]]
                       for kept in reference.sources]
        want_scores += [0.0] * (num_nodes - len(want_scores))
        assert np.asarray(tree.scores[b]).tolist() == pytest.approx(want_scores), b
    check_invariants(got_tokens, got_parents, max_depth)
    return got_tokens, got_parents


def check_invariants(tokens, parents, max_depth):
    index = np.arange(parents.shape[1])[None, :]
    real = parents >= 0
    assert np.all(parents[:, 0] == -1)
    assert np.all(parents[real] < np.broadcast_to(index, parents.shape)[real])
    assert np.all(np.asarray(node_depths(parents)) <= max_depth)
    # Real nodes form a prefix: padding (parent -1, token 0) only after the last real node.
    real_count = real.sum(axis=1) + 1
    assert np.all(real[:, 1:] == (index[:, 1:] < real_count[:, None]))
    assert np.all(tokens[:, 1:][~real[:, 1:]] == 0)


# Hand-worked cases -------------------------------------------------------------------------

CHAIN = ([10, 11, 12, 13, 14, 15], [-1, 0, 1, 2, 3, 4])
# 0(10) -> 1(20) -> {3(22) -> 5(24), 4(23)}; 0 -> 2(21) -> 6(25) -> 7(26)
BRANCHY = ([10, 20, 21, 22, 23, 24, 25, 26], [-1, 0, 0, 1, 1, 3, 2, 6])
SLOTS, RUN_SLOTS = 8, 4


@pytest.mark.parametrize(
    "run,root,want_tokens,want_parents",
    [
        ([], 99, [99, 11, 12, 13, 14, 15, 0], [-1, 0, 1, 2, 3, 4, -1]),  # same root
        ([11], 11, [11, 12, 13, 14, 15, 0, 0], [-1, 0, 1, 2, 3, -1, -1]),
        ([11, 12, 13], 13, [13, 14, 15, 0, 0, 0, 0], [-1, 0, 1, -1, -1, -1, -1]),
        ([11, 12, 13, 14], 14, [14, 15] + [0] * 5, [-1, 0] + [-1] * 5),
    ],
)
def test_chain_is_cut_at_the_committed_run(run, root, want_tokens, want_parents):
    rows = [(*CHAIN, run, len(run), root)]
    tokens, parents = check(rows, SLOTS, RUN_SLOTS, num_nodes=7, max_depth=6)
    assert tokens[0].tolist() == want_tokens and parents[0].tolist() == want_parents


def test_run_picks_one_branch_and_failures_give_the_root_alone():
    rows = [
        (*BRANCHY, [21], 1, 21),  # the second branch: 2 -> 6 -> 7
        (*BRANCHY, [20], 1, 20),  # the first: 1 -> {3 -> 5, 4}
        (*BRANCHY, [20, 23], 2, 23),  # a leaf: nothing below it
        (*BRANCHY, [20, 25], 2, 25),  # 25 sits in the other branch: the walk fails
        (*BRANCHY, [21, 25, 26, 27], 4, 27),  # deeper than the trie
        (*BRANCHY, [30, 21], 1, 30),  # only run_len tokens count; 30 is no child
    ]
    tokens, parents = check(rows, SLOTS, RUN_SLOTS, num_nodes=5, max_depth=3)
    assert tokens.tolist() == [
        [21, 25, 26, 0, 0],
        [20, 22, 23, 24, 0],
        [23, 0, 0, 0, 0],
        [25, 0, 0, 0, 0],
        [27, 0, 0, 0, 0],
        [30, 0, 0, 0, 0],
    ]
    assert parents[:2].tolist() == [[-1, 0, 1, -1, -1], [-1, 0, 0, 1, -1]]
    assert np.all(parents[2:, 1:] == -1)


def test_truncation_at_num_nodes_and_at_max_depth():
    rows = [(*BRANCHY, [], 0, 10)]
    tokens, parents = check(rows, SLOTS, RUN_SLOTS, num_nodes=4, max_depth=3)
    assert tokens[0].tolist() == [10, 20, 21, 22] and parents[0].tolist() == [-1, 0, 0, 1]
    tokens, parents = check(rows, SLOTS, RUN_SLOTS, num_nodes=8, max_depth=1)
    assert tokens[0].tolist() == [10, 20, 21] + [0] * 5
    assert parents[0].tolist() == [-1, 0, 0] + [-1] * 5
    tokens, parents = check(rows, SLOTS, RUN_SLOTS, num_nodes=8, max_depth=0)
    assert tokens[0].tolist() == [10] + [0] * 7


def test_num_nodes_above_the_trie_size_pads():
    rows = [(*CHAIN, [11], 1, 11), (*BRANCHY, [], 0, 10)]
    check(rows, SLOTS, RUN_SLOTS, num_nodes=12, max_depth=9)


# Random tries --------------------------------------------------------------------------------


def random_trie(rng, num_slots, vocab):
    """A trie in host order (each prefix closed under ancestors): every new node hangs under an
    earlier used node with a token none of its siblings has. Unused nodes sit at the tail or,
    sometimes, in between."""
    used = int(rng.integers(1, num_slots + 1))
    tokens, parents = [int(rng.integers(vocab))], [-1]
    live, taken = [0], {0: set()}
    while len(tokens) < num_slots:
        if len(live) >= used or rng.random() < 0.1:
            tokens.append(0)
            parents.append(-1)
            continue
        p = live[int(rng.integers(len(live)))]
        free = [t for t in range(vocab) if t not in taken[p]]
        if not free:
            continue
        t = int(rng.choice(free))
        taken[p].add(t)
        taken[len(tokens)] = set()
        live.append(len(tokens))
        tokens.append(t)
        parents.append(p)
    return tokens, parents


def random_run(rng, tokens, parents, run_slots, vocab):
    """Mostly a path down the trie (continued with random tokens past a leaf); sometimes with a
    token replaced, which may or may not still match."""
    run_len = int(rng.integers(0, run_slots + 1))
    node, run = 0, []
    for _ in range(run_len):
        kids = [i for i, p in enumerate(parents) if p == node]
        if kids and rng.random() < 0.9:
            node = kids[int(rng.integers(len(kids)))]
            run.append(tokens[node])
        else:
            node = -2  # off the trie
            run.append(int(rng.integers(vocab)))
    if run and rng.random() < 0.15:
        run[int(rng.integers(len(run)))] = int(rng.integers(vocab))
    run += [int(rng.integers(vocab)) for _ in range(run_slots - run_len)]  # ignored tail
    root = run[run_len - 1] if run_len else int(rng.integers(vocab))
    return run, run_len, root


@pytest.mark.parametrize(
    "num_slots,run_slots,num_nodes,max_depth",
    [(16, 3, 8, 3), (24, 5, 12, 5), (40, 9, 20, 8), (12, 2, 16, 4)],
)
def test_random_tries_match_the_reference(num_slots, run_slots, num_nodes, max_depth):
    rng = np.random.default_rng(num_slots * 100 + run_slots)
    vocab, batch = 8, 16
    outcomes = set()
    for _ in range(12):  # same shapes every round: one compilation per parameter set
        rows = []
        for _ in range(batch):
            tokens, parents = random_trie(rng, num_slots, vocab)
            run, run_len, root = random_run(rng, tokens, parents, run_slots, vocab)
            rows.append((tokens, parents, run, run_len, root))
        got_tokens, got_parents = check(rows, num_slots, run_slots, num_nodes, max_depth)
        real = (got_parents[:, 1:] >= 0).sum(axis=1)
        for (_, _, _, run_len, _), n in zip(rows, real, strict=True):
            outcomes.add(("same root" if run_len == 0 else "moved", "empty" if n == 0 else "kept"))
            outcomes.add("full" if n == num_nodes - 1 else "partial")
    # The generator reaches every kind of row: same root or moved, empty or kept, and (when the
    # trie can fill it) a full tree.
    assert {("same root", "kept"), ("moved", "kept"), ("moved", "empty")} <= outcomes
    assert "full" in outcomes or num_nodes > num_slots
