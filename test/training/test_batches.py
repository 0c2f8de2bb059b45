"""Training batches: every step's padded shape within --tokens-per-batch, few shapes, every
example once an epoch."""

import numpy as np
import pytest

from sgl_jax.training.data import Example
from sgl_jax.training.trainer import collate, plan_batches, row_width


def examples(lengths):
    return [Example(np.arange(n, dtype=np.int32) % 97 + 1, np.arange(n) % 3 == 0)
            for n in lengths]


@pytest.mark.parametrize("row_multiple", [1, 2])
def test_batches_hold_their_budget_in_few_shapes(row_multiple):
    lengths = np.random.default_rng(0).integers(20, 321, size=300).tolist()
    tokens = 1024
    plan = plan_batches(lengths, tokens, row_multiple, seed=3)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    data = examples(lengths)
    shapes = set()
    for batch in plan:
        chosen = [data[i] for i in batch]
        collated = collate(chosen, row_multiple, tokens)
        rows, width = collated.input_ids.shape
        assert rows * width <= tokens and rows % row_multiple == 0
        for r, e in enumerate(chosen):  # each row as given, then padding
            np.testing.assert_array_equal(collated.input_ids[r, : len(e.input_ids)],
                                          e.input_ids)
            assert not collated.loss_mask[r, len(e.input_ids):].any()
        assert not collated.loss_mask[len(chosen):].any()
        shapes.add((rows, width))
    assert len(shapes) <= 5  # one per width: 64, 128, ..., 320
    # Little padding beyond the widths: each row's tokens are at least half its width's.
    padded = sum(rows * width for rows, width in
                 (collate([data[i] for i in b], row_multiple, tokens).input_ids.shape
                  for b in plan))
    assert padded < 1.35 * sum(lengths)


def test_widths_coarsen_by_octave():
    assert [row_width(n) for n in (1, 64, 65, 300, 512, 513, 1000, 1025)] == [
        64, 64, 128, 320, 512, 640, 1024, 1280]


def test_a_row_longer_than_the_budget_is_a_batch_of_its_own():
    plan = plan_batches([3000, 100, 90], 1024, 1, seed=0)
    assert sorted(map(sorted, plan)) == [[0], [1, 2]]
    assert collate(examples([3000]), 1, 1024).input_ids.shape == (1, 3072)
