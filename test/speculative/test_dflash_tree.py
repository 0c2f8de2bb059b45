"""DFLASH trees: a block's per-position top-k tokens grown into the best N-1 paths, a path
scored by the sum of its tokens' log-probabilities (positions independent). Against brute
force over every path of the top-k lattice: with N-1 <= K+1 the frontier of K never drops a
node of the global best N-1."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.speculative.drafters.dflash import position_topk_tree
from sgl_jax.speculative.round.tree import node_depths


def tree_paths(tokens: np.ndarray, parents: np.ndarray) -> set[tuple[int, ...]]:
    """Each non-root node's token path from the root (root excluded)."""
    paths = {}
    for i in range(1, len(tokens)):
        parent = parents[i]
        paths[i] = (paths[parent] if parent > 0 else ()) + (int(tokens[i]),)
    return set(paths.values())


def best_paths(logprobs: np.ndarray, topk: int, count: int) -> set[tuple[int, ...]]:
    steps = logprobs.shape[0]
    top = [np.argsort(-logprobs[d])[:topk] for d in range(steps)]
    scored = []
    for depth in range(1, steps + 1):
        for path in itertools.product(*top[:depth]):
            scored.append((sum(logprobs[d, t] for d, t in enumerate(path)), path))
    scored.sort(key=lambda item: -item[0])
    return {tuple(int(t) for t in path) for _, path in scored[:count]}


@pytest.mark.parametrize("topk,steps,num_draft_tokens", [(3, 4, 5), (2, 3, 4), (1, 5, 6)])
def test_trees_hold_the_best_paths_of_the_top_k_lattice(topk, steps, num_draft_tokens):
    rng = np.random.default_rng(topk * 10 + steps)
    batch, vocab = 3, 11
    logprobs = jax.nn.log_softmax(jnp.asarray(2 * rng.standard_normal((batch, steps, vocab)),
                                              jnp.float32), -1)
    roots = jnp.arange(batch, dtype=jnp.int32) + 100
    tree = position_topk_tree(roots, logprobs, topk=topk, num_draft_tokens=num_draft_tokens)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    assert tokens.shape == parents.shape == (batch, num_draft_tokens)
    for row in range(batch):
        assert tokens[row, 0] == roots[row] and parents[row, 0] == -1
        assert (parents[row, 1:] < np.arange(1, num_draft_tokens)).all()  # parents first
        assert tree_paths(tokens[row], parents[row]) == best_paths(
            np.asarray(logprobs[row]), topk, num_draft_tokens - 1)


def test_top_1_is_the_chain_of_argmaxes():
    rng = np.random.default_rng(0)
    logprobs = jnp.asarray(rng.standard_normal((2, 6, 9)), jnp.float32)
    tree = position_topk_tree(jnp.zeros(2, jnp.int32), logprobs, topk=1, num_draft_tokens=7)
    np.testing.assert_array_equal(tree.tokens[:, 1:], jnp.argmax(logprobs, -1))
    np.testing.assert_array_equal(node_depths(tree.parents)[0], np.arange(7))
