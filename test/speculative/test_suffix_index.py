"""The suffix-decoding index against a brute-force reference, plus hand-worked cases.

The reference counts continuations by scanning the token lists with plain loops, enumerates
every draft node that passes the probability and depth limits, and orders them with a
recursive key, so it shares no code or data structure with the index.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from sgl_jax.speculative.drafters.ngram.suffix_config import SuffixConfig
from sgl_jax.speculative.drafters.ngram.suffix_index import Proposal, SuffixIndex

# ---------------------------------------------------------------- the brute-force reference


def ref_counts(texts: list[list[int]], context: list[int]) -> dict[int, int]:
    """N(context, c): places where `context` occurs in one text, followed there by c."""
    counts: dict[int, int] = {}
    size = len(context)
    for text in texts:
        for end in range(size, len(text)):  # context = text[end - size:end], next = text[end]
            if text[end - size:end] == context:
                counts[text[end]] = counts.get(text[end], 0) + 1
    return counts


def ref_tree(texts, pattern, depth, budget, min_prob):
    """Every node with path probability >= min_prob and depth <= depth, best `budget` kept.

    The order key of a node is (-prob, depth, key of its parent, token): comparing the
    parents' keys is comparing their places in the output.
    """
    found = []  # (key, token, parent key, prob)

    def visit(context, prob, level, key):
        if level == depth:
            return
        counts = ref_counts(texts, context)
        total = sum(counts.values())
        for token, count in counts.items():
            child_prob = prob * (count / total)
            if child_prob >= min_prob:
                child_key = (-child_prob, level + 1, key, token)
                found.append((child_key, token, key, child_prob))
                visit(context + [token], child_prob, level + 1, child_key)

    visit(list(pattern), 1.0, 0, ())
    found.sort(key=lambda item: item[0])
    index_of = {(): 0}
    nodes, score = [], 0.0
    for i, (key, token, parent_key, prob) in enumerate(found[:budget], start=1):
        index_of[key] = i
        nodes.append((token, index_of[parent_key], prob))
        score += prob
    return score, nodes


def ref_propose(cfg: SuffixConfig, text, responses, max_nodes, max_depth):
    """Best tree over every match length (longest first) and both text sets (own first)."""
    best_score, best = 0.0, []
    for m in range(min(cfg.max_match, len(text)), cfg.min_match - 1, -1):
        trusted = math.ceil(cfg.spec_factor * m + cfg.spec_offset)
        depth = max(0, min(max_depth, cfg.branch_length, trusted))
        for texts in ([text], responses):
            score, nodes = ref_tree(texts, text[len(text) - m:], depth, max_nodes - 1,
                                    cfg.min_token_prob)
            if score > best_score + 1e-9:
                best_score, best = score, nodes
    tokens = [text[-1]] + [t for t, _, _ in best] + [0] * (max_nodes - 1 - len(best))
    parents = [-1] + [p for _, p, _ in best] + [-1] * (max_nodes - 1 - len(best))
    probs = [1.0] + [q for _, _, q in best] + [0.0] * (max_nodes - 1 - len(best))
    return tokens, parents, probs


class RefIndex:
    """The index's bookkeeping with lists: texts per request, recent responses FIFO."""

    def __init__(self, cfg: SuffixConfig):
        self.cfg, self.texts, self.prompt_lens, self.responses = cfg, {}, {}, []

    def add_request(self, key, prompt):
        self.texts[key], self.prompt_lens[key] = list(prompt), len(prompt)

    def extend(self, key, tokens):
        self.texts[key] += list(tokens)

    def finish(self, key):
        output = self.texts.pop(key)[self.prompt_lens.pop(key):][: self.cfg.capacity]
        if not output:
            return
        while self.responses and sum(map(len, self.responses)) + len(output) > self.cfg.capacity:
            self.responses.pop(0)
        self.responses.append(output)

    def propose(self, key, max_nodes, max_depth):
        return ref_propose(self.cfg, self.texts[key], self.responses, max_nodes, max_depth)


# ---------------------------------------------------------------- helpers


def check_invariants(proposal: Proposal, max_nodes: int, max_depth: int) -> None:
    tokens, parents, probs = proposal.tokens, proposal.parents, proposal.probs
    assert tokens.shape == parents.shape == probs.shape == (max_nodes,)
    assert (tokens.dtype, parents.dtype, probs.dtype) == (np.int32, np.int32, np.float32)
    assert parents[0] == -1 and probs[0] == 1.0
    used = proposal.num_nodes
    assert (parents[1:used] >= 0).all() and (parents[used:] == -1).all()
    assert (probs[used:] == 0).all() and (tokens[used:] == 0).all()
    depth = [0] * max_nodes
    for i in range(1, used):
        parent = parents[i]
        assert parent < i
        depth[i] = depth[parent] + 1
        assert depth[i] <= max_depth
        assert probs[i] <= probs[parent] + 1e-6
        assert probs[i] > 0
    # Sorted by descending probability (exact ties, which f32 cannot show, are checked
    # against the reference).
    assert (np.diff(probs[1:used]) <= 1e-6).all()
    siblings = {}
    for i in range(1, used):
        siblings.setdefault(int(parents[i]), []).append(int(tokens[i]))
    assert all(len(set(s)) == len(s) for s in siblings.values())
    assert proposal.expected_tokens == pytest.approx(float(probs[1:used].sum()))


def assert_same(proposal: Proposal, expected) -> None:
    tokens, parents, probs = expected
    assert proposal.tokens.tolist() == tokens
    assert proposal.parents.tolist() == parents
    np.testing.assert_allclose(proposal.probs, np.asarray(probs, np.float32), rtol=1e-6)


def random_text(rng: random.Random, vocab: int, size: int, pool: list[list[int]]) -> list[int]:
    """Random tokens with copied runs from `pool`, so that long matches occur."""
    out: list[int] = []
    while len(out) < size:
        source = rng.choice(pool) if pool and rng.random() < 0.5 else None
        if source and len(source) > 2:
            start = rng.randrange(len(source) - 1)
            out += source[start:start + rng.randint(2, 12)]
        else:
            out += [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    return out[:size]


def random_config(rng: random.Random) -> SuffixConfig:
    max_match = rng.randint(1, 6)
    return SuffixConfig(
        min_match=rng.randint(1, max_match), max_match=max_match,
        branch_length=rng.randint(1, 6), capacity=rng.choice([0, 20, 60, 150, 1000]),
        min_token_prob=rng.choice([0.05, 0.1, 0.25]),
        spec_factor=rng.choice([0.5, 1.0, 2.0]), spec_offset=rng.choice([-0.5, 0.0, 1.0]))


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("seed", range(60))
def test_matches_reference(seed):
    rng = random.Random(seed)
    cfg = random_config(rng)
    vocab = rng.choice([2, 3, 4, 6])
    index, ref = SuffixIndex(cfg), RefIndex(cfg)
    pool: list[list[int]] = []
    live: list[int] = []
    for step in range(40):
        action = rng.random()
        if action < 0.2 or not live:
            prompt = random_text(rng, vocab, rng.randint(1, 30), pool)
            index.add_request(step, prompt)
            ref.add_request(step, prompt)
            live.append(step)
            pool.append(prompt)
        elif action < 0.3:
            key = live.pop(rng.randrange(len(live)))
            pool.append(ref.texts[key][ref.prompt_lens[key]:])
            index.finish(key)
            ref.finish(key)
            assert index.response_tokens == sum(map(len, ref.responses)) <= cfg.capacity
        else:
            key = rng.choice(live)
            chunk = random_text(rng, vocab, rng.randint(1, 6), pool)
            index.extend(key, chunk)
            ref.extend(key, chunk)
        for key in live:
            max_nodes, max_depth = rng.randint(1, 10), rng.randint(0, 7)
            proposal = index.propose(key, max_nodes, max_depth)
            check_invariants(proposal, max_nodes, max_depth)
            assert_same(proposal, ref.propose(key, max_nodes, max_depth))


def test_a_frequent_token_under_churn_matches_reference():
    # One frequent token followed by many different ones, outputs coming and going: its
    # counts rise and fall as the pool of responses turns over.
    rng = random.Random(5)
    cfg = SuffixConfig(capacity=400, min_token_prob=0.03, max_match=3, branch_length=3)
    index, ref = SuffixIndex(cfg), RefIndex(cfg)
    for key in range(120):
        skew = rng.randint(1, 60)  # how many continuations of 0 this output draws from
        output = []
        for _ in range(rng.randint(5, 40)):
            output += [0, rng.randint(1, skew)] if rng.random() < 0.6 else [rng.randint(1, 60)]
        for target in (index, ref):
            target.add_request(key, [0])
            target.extend(key, output)
            target.finish(key)
        if key % 10 == 9:
            for probe in ([7, 0], [0], [3, 0], [0, 5]):
                for target in (index, ref):
                    target.add_request("probe", probe)
                assert_same(index.propose("probe", 12, 3), ref.propose("probe", 12, 3))
                index.finish("probe", record=False)
                ref.texts.pop("probe")
                ref.prompt_lens.pop("probe")


_SINGLES = [x for k in range(10, 25) for x in (0, k)]  # "0" followed by 15 different tokens


@pytest.mark.parametrize("outputs", [
    # After the first output is evicted, the total under "0" falls from 123 to 16: tokens
    # too rare to draft before become frequent enough.
    [[0, 1] * 100, [0, 2, 0, 3] * 4 + _SINGLES, [0, 30]],
    # It falls from 123 to 73: 2 and 3 (4 of 123 before, 4 of 73 after) cross the
    # threshold.
    [[0, 1] * 100, [0, 2, 0, 3] * 4 + _SINGLES, [0, 1] * 50],
])
def test_drafts_follow_falling_totals(outputs):
    capacity = sum(map(len, outputs)) - 1  # the last output evicts the first
    cfg = SuffixConfig(capacity=capacity, min_token_prob=0.04, max_match=1, branch_length=1)
    index, ref = SuffixIndex(cfg), RefIndex(cfg)
    for key, output in enumerate(outputs):
        for target in (index, ref):
            target.add_request(key, [9])
            target.extend(key, output)
            target.finish(key)
        index.add_request("probe", [0])
        ref.add_request("probe", [0])
        assert_same(index.propose("probe", 24, 1), ref.propose("probe", 24, 1))
        index.finish("probe", record=False)
        ref.texts.pop("probe")
    assert ref.responses == outputs[1:]


def test_a_batch_extends_and_proposes_as_each_request_alone():
    # The engine feeds a round's tokens to every request in one call and asks for every
    # tree in one call; texts grow well past their first arrays (relinked on the way).
    rng = random.Random(13)
    one_by_one, batched = SuffixIndex(), SuffixIndex()
    keys = list(range(5))
    for index in (one_by_one, batched):
        for key in keys:
            index.add_request(key, [key, 1, 2])
    for _ in range(40):
        runs = [random_text(rng, 30, rng.randint(0, 9), []) for _ in keys]
        for key, run in zip(keys, runs, strict=True):
            one_by_one.extend(key, run)
        batched.extend_many(keys, runs)
        tokens, parents = np.empty((2, len(keys) + 1, 9), np.int32)
        probs = np.empty((len(keys) + 1, 9))
        parents[-1] = 7  # a row past the keys is left as it is
        batched.propose_into(keys, 5, tokens, parents, probs)
        assert (parents[-1] == 7).all()
        for row, key in enumerate(keys):
            alone = one_by_one.propose(key, 9, 5)
            assert tokens[row].tolist() == alone.tokens.tolist()
            assert parents[row].tolist() == alone.parents.tolist()
            np.testing.assert_array_equal(probs[row].astype(np.float32), alone.probs)


# ---------------------------------------------------------------- hand-worked cases


# A match of m tokens drafts at most m tokens.
BY_MATCH = SuffixConfig(spec_factor=1.0, spec_offset=0.0)


def test_repeated_phrase_drafts_its_continuation_as_a_chain():
    index = SuffixIndex(BY_MATCH)
    index.add_request("r", [10, 11, 12, 13, 14, 15, 16, 99, 10, 11, 12])
    proposal = index.propose("r", max_nodes=6, max_depth=8)
    # Matched "10 11 12" (3 tokens) -> at most 3 draft tokens, each seen every time (p = 1).
    assert proposal.tokens.tolist() == [12, 13, 14, 15, 0, 0]
    assert proposal.parents.tolist() == [-1, 0, 1, 2, -1, -1]
    assert proposal.probs.tolist() == [1, 1, 1, 1, 0, 0]
    assert proposal.expected_tokens == 3.0


def test_default_draft_depth_is_match_plus_one():
    index = SuffixIndex()  # spec_factor 1, spec_offset 1
    index.add_request("r", [1, 2, 3, 4, 9, 1])
    assert index.propose("r", 8, 8).tokens.tolist()[:4] == [1, 2, 3, 0]  # "1" -> 2 tokens
    index.extend("r", [2])
    assert index.propose("r", 8, 8).tokens.tolist()[:5] == [2, 3, 4, 9, 0]  # "1 2" -> 3


def test_pending_occurrence_does_not_dilute():
    # "5" occurred once before, followed by 7; its current occurrence has no continuation
    # yet and is not an observation: p(7) = 1, not 1/2.
    index = SuffixIndex(BY_MATCH)
    index.add_request("r", [5, 7, 5])
    assert_same(index.propose("r", 3, 4), ([5, 7, 0], [-1, 0, -1], [1.0, 1.0, 0.0]))


def test_branching_probabilities():
    index = SuffixIndex(SuffixConfig(min_token_prob=0.2, spec_factor=1.0, spec_offset=0.0))
    # After "1": 2 three times, 3 once -> 0.75 / 0.25; after "1 2": always 4.
    index.add_request("r", [1, 2, 4, 1, 3, 1, 2, 4, 1, 2, 4, 9, 1])
    proposal = index.propose("r", 8, 8)
    assert proposal.tokens.tolist()[:3] == [1, 2, 3]
    np.testing.assert_allclose(proposal.probs[:3], [1.0, 0.75, 0.25])
    assert proposal.num_nodes == 3  # the match has length 1, so the draft depth is 1


def test_finished_response_drafts_a_repeated_answer():
    question, answer = [100, 101, 102, 103], list(range(200, 220))
    index = SuffixIndex(BY_MATCH)
    index.add_request("a", question)
    index.extend("a", answer)
    index.finish("a")
    index.add_request("b", question)
    assert index.propose("b", 8, 6).num_nodes == 1  # answers are kept, questions are not
    index.extend("b", answer[:5])
    proposal = index.propose("b", 8, 6)
    assert proposal.tokens.tolist()[:6] == [204] + answer[5:10]
    assert proposal.parents.tolist()[:6] == [-1, 0, 1, 2, 3, 4]
    assert proposal.expected_tokens == 5.0


def test_eviction_removes_exactly_the_oldest_response():
    responses = [[1, 2, 3, 4, 1, 2, 5], [1, 2, 6, 1, 2, 6, 7], [2, 6, 7, 1, 2, 3, 1, 2]]
    kept = SuffixIndex(SuffixConfig(capacity=16))
    for key, response in enumerate(responses):
        kept.add_request(key, [50])
        kept.extend(key, response)
        kept.finish(key)
    assert kept.response_tokens == 15  # 7 + 8: the first response made room
    fresh = SuffixIndex(SuffixConfig(capacity=16))
    for key, response in enumerate(responses[1:]):
        fresh.add_request(key, [50])
        fresh.extend(key, response)
        fresh.finish(key)
    for probe in ([1, 2], [2], [1], [3, 4], [1, 2, 3], [6, 7, 1], [4, 1, 2]):
        for index in (kept, fresh):
            index.add_request("probe", [60] + probe)
        a, b = kept.propose("probe", 8, 4), fresh.propose("probe", 8, 4)
        for field in ("tokens", "parents", "probs"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), probe
        for index in (kept, fresh):
            index.finish("probe", record=False)
    kept.add_request("probe", [60, 3, 4])  # 3 4 -> 1 was only in the evicted response
    assert kept.propose("probe", 8, 4).num_nodes == 1


def test_eviction_cycles_keep_memory_bounded_and_drafts_exact():
    cfg = SuffixConfig(capacity=30)
    index, ref = SuffixIndex(cfg), RefIndex(cfg)
    rng = random.Random(3)
    for key in range(200):
        output = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        for target in (index, ref):
            target.add_request(key, [0])
            target.extend(key, output)
            target.finish(key)
        assert index.response_tokens == sum(map(len, ref.responses)) <= 30
        # Evicted responses are dropped once they are most of the pool.
        assert index.responses_held <= 2 * (30 + 30)
        if key % 20 == 19:
            for target in (index, ref):
                target.add_request("probe", [1, 2])
            assert_same(index.propose("probe", 8, 4), ref.propose("probe", 8, 4))
            index.finish("probe", record=False)
            ref.texts.pop("probe")
            ref.prompt_lens.pop("probe")
    while index.evict_oldest_response():  # evicting everything leaves nothing to draft from
        pass
    assert index.response_tokens == 0
    index.add_request("probe", [1, 2])
    assert index.propose("probe", 8, 4).num_nodes == 1


def test_no_match_proposes_only_the_root():
    index = SuffixIndex()
    index.add_request("r", [1, 2, 3, 4, 5])
    proposal = index.propose("r", 4, 4)
    assert_same(proposal, ([5, 0, 0, 0], [-1, -1, -1, -1], [1.0, 0.0, 0.0, 0.0]))
    assert proposal.expected_tokens == 0.0 and proposal.num_nodes == 1
    assert index.propose("r", 1, 4).tokens.tolist() == [5]


def test_deterministic_across_instances_and_inputs():
    rng = random.Random(11)
    text = random_text(rng, 4, 400, [])
    a, b = SuffixIndex(), SuffixIndex()
    a.add_request("x", text)
    b.add_request(("another", "key"), np.asarray(text, np.int32))
    pa, pb = a.propose("x", 12, 6), b.propose(("another", "key"), 12, 6)
    for field in ("tokens", "parents", "probs"):
        assert np.array_equal(getattr(pa, field), getattr(pb, field))


def test_api_errors():
    index = SuffixIndex()
    index.add_request("r", [1])
    with pytest.raises(ValueError, match="already"):
        index.add_request("r", [1])
    with pytest.raises(ValueError, match="at least one token"):
        index.add_request("s", [])
    with pytest.raises(ValueError, match=">= 0"):
        index.extend("r", [-1])
    with pytest.raises(ValueError, match="max_nodes"):
        index.propose("r", 0, 3)
    with pytest.raises(KeyError):
        index.extend("unknown", [1])


@pytest.mark.parametrize("field, value, flag", [
    ("min_match", 0, "min-match-window-size"),
    ("max_match", 0, "max-match-window-size"),
    ("branch_length", 0, "branch-length"),
    ("capacity", -1, "capacity"),
    ("min_token_prob", 1.5, None),
    ("spec_factor", -1.0, None),
    ("spec_offset", float("nan"), None),
])
def test_config_validation(field, value, flag):
    with pytest.raises(ValueError, match=rf"SuffixConfig\.{field}\b") as error:
        SuffixConfig(**{field: value}).validate()
    assert "\n" not in str(error.value) and "[" in str(error.value)
    if flag:
        assert flag in str(error.value)
    with pytest.raises(ValueError):
        SuffixIndex(SuffixConfig(min_match=13, max_match=12))
