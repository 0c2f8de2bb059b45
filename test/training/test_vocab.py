"""The draft vocabulary against collections.Counter."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from sgl_jax.training.data import Example
from sgl_jax.training.vocab import count_tokens, draft_vocab

TARGET_VOCAB = 300


def random_examples(seed: int, n: int = 20) -> list[Example]:
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        length = int(rng.integers(1, 60))
        # Few distinct, Zipf-like ids so that counts tie often.
        ids = np.minimum(rng.zipf(1.5, length), TARGET_VOCAB - 1).astype(np.int32)
        examples.append(Example(ids, rng.random(length) < 0.6))
    return examples


def counter_top(examples: list[Example], n: int) -> list[int]:
    counter = Counter(int(t) for e in examples
                      for t, on in zip(e.input_ids, e.loss_mask, strict=True) if on)
    ranked = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
    return sorted(token for token, _ in ranked[:n])


@pytest.mark.parametrize("seed", range(5))
def test_chosen_ids_match_counter(seed):
    examples = random_examples(seed)
    d2t, t2d = draft_vocab(examples, TARGET_VOCAB, draft_vocab_size=8)
    assert d2t.dtype == np.int64 and d2t.shape == (8,)
    assert t2d.dtype == np.bool_ and t2d.shape == (TARGET_VOCAB,)
    assert (np.arange(8) + d2t).tolist() == counter_top(examples, 8)
    # Unmasked tokens are not counted.
    counts = count_tokens(examples, TARGET_VOCAB)
    assert counts.sum() == sum(int(e.loss_mask.sum()) for e in examples)


def test_d2t_t2d_round_trip():
    d2t, t2d = draft_vocab(random_examples(7), TARGET_VOCAB, draft_vocab_size=16)
    target_ids = np.arange(16) + d2t
    assert np.all(np.diff(target_ids) > 0)  # sorted ascending, distinct
    np.testing.assert_array_equal(np.flatnonzero(t2d), target_ids)
    # Draft id of each chosen target id: its rank among the chosen ones.
    np.testing.assert_array_equal(np.cumsum(t2d)[target_ids] - 1, np.arange(16))


def test_counts_array_and_fill_up_with_smallest_unseen_ids():
    counts = np.zeros(10, np.int64)
    counts[[7, 3, 9]] = [5, 5, 1]  # 3 and 7 tie: both in before 9
    d2t, t2d = draft_vocab(counts, 10, draft_vocab_size=6)
    assert (np.arange(6) + d2t).tolist() == [0, 1, 2, 3, 7, 9]
    d2t, _ = draft_vocab(counts, 10, draft_vocab_size=2)
    assert (np.arange(2) + d2t).tolist() == [3, 7]


def test_errors():
    with pytest.raises(ValueError, match="draft_vocab_size=11"):
        draft_vocab(np.zeros(10, np.int64), 10, draft_vocab_size=11)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        draft_vocab([Example(np.array([10], np.int32), np.array([True]))], 10, 4)
