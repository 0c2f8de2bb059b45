"""The TTT loss against a PyTorch reference written here, position by position, from the
formulas of shared/EAGLE3.md: losses, accuracies, counts and gradients."""

import jax
import numpy as np
import pytest
import torch

from sgl_jax.training.loss import ttt_loss

K, B, T, V, VD = 4, 2, 9, 40, 12


def reference(draft_logits, target_logits, loss_mask, draft_ids, decay=0.8):
    """Plain loops: step k scores position t against the target at t + k."""
    in_draft = set(draft_ids.tolist())
    total, losses, accuracies, counts = 0.0, [], [], []
    for k in range(draft_logits.shape[0]):
        terms, hits = [], 0
        for b in range(B):
            for t in range(T - k):
                target = target_logits[b, t + k]
                if not loss_mask[b, t + k] or int(target.argmax()) not in in_draft:
                    continue
                p = torch.softmax(target[draft_ids], dim=-1)
                logits = draft_logits[k, b, t]
                terms.append(-(p * torch.log_softmax(logits, dim=-1)).sum())
                hits += int(draft_ids[int(logits.argmax())]) == int(target.argmax())
        loss = torch.stack(terms).mean() if terms else torch.zeros(())
        losses.append(loss)
        accuracies.append(hits / max(len(terms), 1))
        counts.append(len(terms))
        total = total + decay**k * loss
    return total, losses, accuracies, counts


def problem(seed):
    rng = np.random.default_rng(seed)
    draft_ids = np.sort(rng.choice(V, VD, replace=False)).astype(np.int32)
    target = rng.normal(size=(B, T, V)).astype(np.float32) * 3
    # Make most argmaxes fall in the draft vocabulary, a few outside it.
    boost = rng.choice(draft_ids, (B, T))
    target[np.arange(B)[:, None], np.arange(T), boost] += 6 * (rng.random((B, T)) < 0.8)
    draft = rng.normal(size=(K, B, T, VD)).astype(np.float32) * 2
    mask = rng.random((B, T)) < 0.7
    return draft, target, mask, draft_ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ttt_loss_and_gradients_equal_the_reference(seed):
    draft, target, mask, draft_ids = problem(seed)
    ours = ttt_loss(draft, target, mask, draft_ids)
    draft_t = torch.tensor(draft, requires_grad=True)
    total, losses, accuracies, counts = reference(draft_t, torch.tensor(target),
                                                  torch.tensor(mask), torch.tensor(draft_ids))
    total.backward()
    assert ours.counts.tolist() == counts and min(counts) > 0
    np.testing.assert_allclose(ours.losses, [x.item() for x in losses], rtol=1e-5)
    np.testing.assert_allclose(ours.accuracies, accuracies, rtol=1e-6)
    np.testing.assert_allclose(ours.total, total.item(), rtol=1e-5)
    grad = jax.grad(lambda d: ttt_loss(d, target, mask, draft_ids).total)(draft)
    np.testing.assert_allclose(grad, draft_t.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_a_step_with_no_valid_position_costs_nothing():
    draft, target, mask, draft_ids = problem(3)
    mask[:] = False
    out = ttt_loss(draft, target, mask, draft_ids)
    assert out.counts.tolist() == [0] * K and float(out.total) == 0.0


def test_steps_longer_than_the_sequence_score_nothing():
    draft, target, mask, draft_ids = problem(4)
    long = np.concatenate([draft] * 3)  # 12 steps over 9 positions
    out = ttt_loss(long, target, mask, draft_ids)
    assert out.counts[T:].tolist() == [0] * (3 * K - T)
