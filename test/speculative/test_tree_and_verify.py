"""Draft trees and verification against plain-Python references, and the lossless test:
tokens emitted by tree verification follow the target distribution exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.layers.sampler import sample
from sgl_jax.model_executor.model_runner import greedy_sampling_batch
from sgl_jax.speculative.round.tree import (
    DraftTree,
    ancestor_mask,
    host_node_depths,
    node_depths,
    select_tree,
)
from sgl_jax.speculative.round.verify import AcceptThresholds, verify_tree

# A fixed tree of 6 nodes: 0 -> {1, 2}, 1 -> {3, 4}, 3 -> {5}
PARENTS = [-1, 0, 0, 1, 1, 3]
TOKENS = [9, 2, 4, 1, 3, 0]  # node 0 is the root; tokens below it are draft proposals


def random_parents(rng, n):
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def test_depths_and_ancestor_mask_follow_parent_links():
    rng = np.random.default_rng(0)
    parents = np.array([random_parents(rng, 9) for _ in range(4)], np.int32)
    depths, mask = np.asarray(node_depths(parents)), np.asarray(ancestor_mask(parents))
    for b in range(4):
        for i in range(9):
            chain, node = {i}, i
            while parents[b, node] >= 0:
                node = parents[b, node]
                chain.add(node)
            assert depths[b, i] == len(chain) - 1
            assert set(np.flatnonzero(mask[b, i])) == chain


def expand_reference(rng, k, steps):
    """Candidates as EAGLE-2 lists them: root's top-k, then per step k*k children of the
    frontier (the best k by cumulative score)."""
    scores = list(np.sort(np.log(rng.uniform(0.05, 1, k)))[::-1])
    parents, frontier = [-1] * k, list(range(k))
    for _ in range(1, steps):
        children = []
        for f in frontier:
            logp = np.sort(np.log(rng.uniform(0.05, 1, k)))[::-1]
            children += [(scores[f] + lp, f) for lp in logp]
        offset = len(scores)
        scores += [s for s, _ in children]
        parents += [p for _, p in children]
        order = sorted(range(len(children)), key=lambda j: -children[j][0])
        frontier = [offset + j for j in order[:k]]
    return np.array(scores, np.float32), np.array(parents, np.int32)


@pytest.mark.parametrize("k,steps,n", [(1, 5, 6), (4, 3, 8), (3, 4, 12), (2, 3, 11)])
def test_select_tree_keeps_the_best_candidates_closed_under_ancestors(k, steps, n):
    rng = np.random.default_rng(k * 10 + steps)
    scores, parents = expand_reference(rng, k, steps)
    tokens = np.arange(100, 100 + len(scores), dtype=np.int32)
    tree = select_tree(jnp.array([7]), scores[None], tokens[None], parents[None], n)
    kept = sorted(np.argsort(-scores, kind="stable")[: n - 1])
    assert np.asarray(tree.tokens)[0].tolist() == [7] + [int(tokens[c]) for c in kept]
    node_of = {c: i + 1 for i, c in enumerate(kept)}
    got_parents = np.asarray(tree.parents)[0].tolist()
    assert got_parents[0] == -1
    for i, c in enumerate(kept, start=1):
        assert parents[c] < 0 or parents[c] in node_of, "a kept node lost its parent"
        assert got_parents[i] == (0 if parents[c] < 0 else node_of[parents[c]])
        assert got_parents[i] < i


def sampling_rows(rows, vocab, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None,
                  positions=None):
    seeds = np.arange(rows, dtype=np.uint32) if seeds is None else seeds
    return dataclasses.replace(
        greedy_sampling_batch(rows, vocab),
        temperature=np.full(rows, temperature, np.float32), top_p=np.full(rows, top_p, np.float32),
        top_k=np.full(rows, top_k, np.int32), min_p=np.full(rows, min_p, np.float32), seed=seeds,
        position=np.zeros(rows, np.int32) if positions is None else positions,
    )


def greedy_walk(parents, tokens, argmax, steps):
    """Reference: follow the child equal to the target's argmax; bonus = argmax at the end."""
    node, emitted = 0, []
    for _ in range(steps):
        match = [c for c in range(len(parents)) if parents[c] == node and tokens[c] == argmax[node]]
        if not match:
            break
        node = match[0]
        emitted.append(tokens[node])
    return emitted + [int(argmax[node])]


def test_greedy_verification_matches_a_reference_walk():
    rng = np.random.default_rng(3)
    batch, n, vocab, steps = 64, len(PARENTS), 5, 3
    logits = rng.normal(size=(batch, n, vocab)).astype(np.float32)
    tree = DraftTree(np.tile(np.array(TOKENS, np.int32) % vocab, (batch, 1)),
                     np.tile(np.array(PARENTS, np.int32), (batch, 1)))
    verdict = verify(tree, logits.reshape(batch * n, vocab), sampling_rows(batch * n, vocab),
                     num_steps=steps, thresholds=AcceptThresholds())
    accepted = np.asarray(verdict.num_accepted)
    for b in range(batch):
        expected = greedy_walk(PARENTS, np.asarray(tree.tokens)[b], logits[b].argmax(-1), steps)
        assert np.asarray(verdict.tokens)[b, : accepted[b] + 1].tolist() == expected
    assert 0 < accepted.mean() < steps  # both outcomes occur


def filtered_reference(logits, temperature, top_k, top_p):
    """The target distribution per row, in numpy: temperature, top-k, then top-p."""
    z = logits / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(p)
    for r in range(len(p)):
        order = np.argsort(-p[r], kind="stable")[:top_k]
        kept = p[r, order] / p[r, order].sum()
        before = np.cumsum(kept) - kept
        keep = before < top_p
        out[r, order[keep]] = kept[keep] / kept[keep].sum()
    return out


def chi_square(counts, probs):
    expected = counts.sum() * probs
    assert counts[probs == 0].sum() == 0, "a filtered-out token was emitted"
    live = probs > 0
    return float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())


verify = jax.jit(verify_tree, static_argnames=("num_steps", "thresholds"))
CHI2_LIMIT = 30.0  # df <= 5: far beyond the 99.99th percentile (25.7)


@pytest.mark.parametrize("thresholds,lossless", [
    (AcceptThresholds(), True),
    (AcceptThresholds(acc=0.5), False),  # accepts drafts too eagerly: biased
    (AcceptThresholds(single=0.2), False),
])
def test_tree_sampling_emits_the_target_distribution(thresholds, lossless):
    """Many requests verify the same tree over a 6-token vocabulary. The first emitted token
    must follow the root's distribution, and after an accepted child c the second must follow
    c's distribution, as closely as plain sampling follows them."""
    rng = np.random.default_rng(11)
    vocab, samples, n = 6, 20000, len(PARENTS)
    node_logits = rng.normal(size=(n, vocab)).astype(np.float32) * 1.5
    temperature, top_k, top_p = 0.9, 5, 0.95
    probs = filtered_reference(node_logits, temperature, top_k, top_p)
    tokens = np.array([0, 2, 4, 1, 3, 0], np.int32)
    tree = DraftTree(np.tile(tokens, (samples, 1)), np.tile(np.array(PARENTS, np.int32),
                                                           (samples, 1)))
    seeds = np.repeat(np.arange(samples, dtype=np.uint32), n)
    depths = np.asarray(node_depths(tree.parents))
    sampling = sampling_rows(samples * n, vocab, temperature=temperature, top_k=top_k,
                             top_p=top_p, seeds=seeds, positions=depths.reshape(-1))
    logits = np.tile(node_logits, (samples, 1))
    verdict = jax.device_get(verify(tree, logits, sampling, num_steps=3, thresholds=thresholds))
    first = verdict.tokens[:, 0]
    stats = [chi_square(np.bincount(first, minlength=vocab), probs[0])]
    for child in (1, 2):  # the root's children
        rows = (verdict.num_accepted >= 1) & (verdict.path[:, 1] == child)
        if rows.sum() < 500:  # a biased rule may never reach this child
            continue
        stats.append(chi_square(np.bincount(verdict.tokens[rows, 1], minlength=vocab),
                                probs[child]))
    plain = jax.jit(sample)(jnp.tile(node_logits[:1], (samples, 1)),
                   sampling_rows(samples, vocab, temperature=temperature, top_k=top_k,
                                 top_p=top_p),
                   None, None)
    plain_stat = chi_square(np.bincount(np.asarray(plain.tokens), minlength=vocab), probs[0])
    assert plain_stat < CHI2_LIMIT
    if lossless:
        assert max(stats) < CHI2_LIMIT, stats
        assert verdict.num_accepted.mean() > 0.3  # drafts were really accepted
    else:
        assert max(stats) > 10 * CHI2_LIMIT, stats


@pytest.mark.parametrize("told_q", ["drawn", "flattened"])
def test_sampled_chain_verification_emits_the_target_distribution(told_q):
    """Chains of 2 drafts sampled in numpy from q (node 0's row for the first draft, the
    first draft's own row for the second, as a Markov head makes it), verified with that q
    (DraftTree.child_q): the first emitted token follows the root's p, the second after an
    accepted first draft x follows p given x, and the first draft is accepted at the rate
    exact speculative sampling gives, sum(min(p, q)). Told a q other than the one the drafts
    were drawn from, verification is biased."""
    rng = np.random.default_rng(7)
    vocab, samples = 6, 20000
    p_root = filtered_reference(rng.normal(size=(1, vocab)) * 1.5, 1.0, vocab, 1.0)[0]
    p_after = filtered_reference(rng.normal(size=(vocab, vocab)) * 1.5, 1.0, vocab, 1.0)
    q_root = filtered_reference(rng.normal(size=(1, vocab)), 1.0, 4, 1.0)[0]  # 2 ids never
    q_after = filtered_reference(rng.normal(size=(vocab, vocab)), 1.0, vocab, 1.0)
    first = rng.choice(vocab, samples, p=q_root)
    second = np.array([rng.choice(vocab, p=q_after[x]) for x in first])
    tokens = np.stack([np.zeros(samples, int), first, second], 1).astype(np.int32)
    child_q = np.stack([np.tile(q_root, (samples, 1)), q_after[first], np.zeros((samples, vocab))],
                       1).astype(np.float32)
    if told_q == "flattened":
        child_q = np.full_like(child_q, 1 / vocab)
    tree = DraftTree(tokens, np.tile(np.array([-1, 0, 1], np.int32), (samples, 1)), child_q)
    # The target's logits at each node: the root's, then after each node's own token.
    logits = np.log(np.stack([np.tile(p_root, (samples, 1)), p_after[first], p_after[second]], 1)
                    + 1e-30).astype(np.float32).reshape(-1, vocab)
    seeds = np.repeat(np.arange(samples, dtype=np.uint32), 3)
    sampling = sampling_rows(samples * 3, vocab, temperature=1.0, top_k=vocab, seeds=seeds,
                             positions=np.tile(np.arange(3, dtype=np.int32), samples))
    verdict = jax.device_get(verify(tree, logits, sampling, num_steps=2,
                                    thresholds=AcceptThresholds()))
    stats = [chi_square(np.bincount(verdict.tokens[:, 0], minlength=vocab), p_root)]
    for x in range(vocab):
        rows = (verdict.num_accepted >= 1) & (first == x)
        if rows.sum() >= 500:
            stats.append(chi_square(np.bincount(verdict.tokens[rows, 1], minlength=vocab),
                                    p_after[x]))
    accept_rate = (verdict.num_accepted >= 1).mean()
    if told_q == "drawn":
        assert len(stats) >= 3 and max(stats) < CHI2_LIMIT, stats
        expected = np.minimum(p_root, q_root).sum()
        assert abs(accept_rate - expected) < 4 * np.sqrt(expected * (1 - expected) / samples)
        assert expected > (q_root * p_root).sum() + 0.05  # more than a one-hot rule accepts
    else:
        assert max(stats) > 10 * CHI2_LIMIT, stats


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verification_applies_a_logit_bias_and_suppression_once(temperature):
    """Rows with a logit bias and a suppressed id: the first emitted token follows the root's
    logits with the bias added once and the id banned, as plain sampling applies them (greedy:
    its argmax, though the draft offered the raw argmax; sampled: its distribution, every
    row's root the same)."""
    rng = np.random.default_rng(5)
    vocab, samples = 6, 20000 if temperature else 256
    root = rng.normal(size=(1 if temperature else samples, vocab)).astype(np.float32)
    root = np.broadcast_to(root, (samples, vocab))
    bias_ids, bias_values, banned = [0, 3], [1.2, -0.8], 5
    edited = root.copy()
    edited[:, bias_ids] += bias_values
    edited[:, banned] = -np.inf
    draft = root.argmax(-1).astype(np.int32)  # what an unedited target would pick
    tree = DraftTree(np.stack([np.zeros(samples, np.int32), draft], 1),
                     np.tile(np.array([-1, 0], np.int32), (samples, 1)))
    sampling = sampling_rows(samples * 2, vocab, temperature=temperature, top_k=vocab,
                             seeds=np.repeat(np.arange(samples, dtype=np.uint32), 2),
                             positions=np.tile(np.arange(2, dtype=np.int32), samples))
    sampling.bias_ids[:, :2], sampling.bias_values[:, :2] = bias_ids, bias_values
    sampling.suppress_ids[:, 0] = banned
    logits = np.stack([root, rng.normal(size=(samples, vocab))], 1).astype(np.float32)
    verdict = jax.device_get(verify(tree, logits.reshape(-1, vocab), sampling, num_steps=1,
                                    thresholds=AcceptThresholds()))
    first = verdict.tokens[:, 0]
    if temperature:
        once = filtered_reference(edited[:1], 1.0, vocab, 1.0)[0]
        assert chi_square(np.bincount(first, minlength=vocab), once) < CHI2_LIMIT
    else:
        assert (first == edited.argmax(-1)).all()
        assert (first != draft).any()  # the edits changed some choices


def test_node_depths_on_host_and_device_count_the_edges_to_the_root():
    """Random trees (parents before children, some nodes unused or cut off: parent -1), up
    to 64 nodes: each node's depth by walking its parents up, on the host and the device."""
    rng = np.random.default_rng(0)
    for num in (1, 2, 7, 8, 33, 64):
        parents = np.array([[-1] + [int(rng.integers(-1, node)) for node in range(1, num)]
                            for _ in range(4)], np.int32)
        expected = np.zeros_like(parents)
        for row, node in np.ndindex(parents.shape):
            up = parents[row, node]
            while up >= 0:
                expected[row, node] += 1
                up = parents[row, up]
        np.testing.assert_array_equal(host_node_depths(parents), expected)
        np.testing.assert_array_equal(np.asarray(node_depths(jnp.asarray(parents))), expected)
