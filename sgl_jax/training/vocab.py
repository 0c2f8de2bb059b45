"""The draft vocabulary: the target ids an EAGLE3 head predicts, as d2t / t2d (as SpecForge)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from sgl_jax.training.data import Example


def count_tokens(examples: Iterable[Example], target_vocab_size: int) -> np.ndarray:
    """How often each target id occurs under the loss mask: i64[target_vocab_size]."""
    counts = np.zeros(target_vocab_size, np.int64)
    for example in examples:
        ids = example.input_ids[example.loss_mask]  # i32[n]
        if ids.size and (ids.min() < 0 or ids.max() >= target_vocab_size):
            raise ValueError(f"token id outside the target vocabulary [0, {target_vocab_size})")
        counts += np.bincount(ids, minlength=target_vocab_size)
    return counts


def draft_vocab(examples_or_token_counts: Iterable[Example] | np.ndarray, target_vocab_size: int,
                draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t i64[draft_vocab_size], t2d bool[target_vocab_size]) of the most frequent ids.

    Takes the draft_vocab_size ids counted most often (ties: smaller id first); unseen ids
    tie at zero, so a short count fills up with the smallest unseen ids. The chosen ids are
    sorted, and target_id = draft_id + d2t[draft_id].
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in "
                         f"[1, target_vocab_size={target_vocab_size}]")
    counts = _as_counts(examples_or_token_counts, target_vocab_size)  # i64[V]
    by_frequency = np.lexsort((np.arange(target_vocab_size), -counts))  # last key is primary
    chosen = np.sort(by_frequency[:draft_vocab_size])  # i64[draft_vocab_size]
    d2t = chosen - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(target_vocab_size, bool)
    t2d[chosen] = True
    return d2t, t2d


def _as_counts(examples_or_token_counts, target_vocab_size: int) -> np.ndarray:
    if isinstance(examples_or_token_counts, np.ndarray):
        if examples_or_token_counts.shape != (target_vocab_size,):
            raise ValueError(f"token counts have shape {examples_or_token_counts.shape}, "
                             f"expected ({target_vocab_size},)")
        return examples_or_token_counts.astype(np.int64)
    return count_tokens(examples_or_token_counts, target_vocab_size)
