"""The training-time-test (TTT) objective of EAGLE3 (shared/EAGLE3.md, "Training a head").

Step k of TTT predicts, at position t, the token after t + k: its logits are compared with the
target's distribution at position t + k, and the loss mask moves left with it. At each step

    p      = softmax(target_logits[t + k] restricted to the draft vocabulary)
    loss_k = mean over valid t of  -sum_d p[d] * log_softmax(draft_logits_k[t])[d]
    acc_k  = mean over valid t of  [draft argmax (as a target id) == target argmax]

where t is valid when loss_mask[t + k] is on and the target's argmax at t + k lies in the
draft vocabulary, and the total is sum_k decay^k * loss_k (decay 0.8).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

STEP_DECAY = 0.8


class TTTLoss(NamedTuple):
    total: jax.Array  # f32[]: sum_k decay^k * loss_k
    losses: jax.Array  # f32[K]
    accuracies: jax.Array  # f32[K]
    counts: jax.Array  # i32[K]: valid positions per step


def ttt_loss(
    draft_logits: jax.Array,  # f32[K, B, T, Vd]: step k's logits at every position
    target_logits: jax.Array,  # f[B, T, V]: the target's next-token logits at every position
    loss_mask: jax.Array,  # bool[B, T]: assistant tokens
    draft_to_target: jax.Array,  # i32[Vd]: the target id of each draft id (id + d2t[id])
    *,
    decay: float = STEP_DECAY,
) -> TTTLoss:
    target_logits = target_logits.astype(jnp.float32)
    in_draft = jnp.zeros(target_logits.shape[-1], bool).at[draft_to_target].set(True)  # bool[V]
    target_argmax = jnp.argmax(target_logits, axis=-1)  # i32[B, T]
    valid = loss_mask & in_draft[target_argmax]  # bool[B, T]
    target_probs = jax.nn.softmax(target_logits[..., draft_to_target], axis=-1)  # f32[B, T, Vd]
    steps = [_step(draft_logits[k], target_probs, target_argmax, valid, draft_to_target, k)
             for k in range(draft_logits.shape[0])]
    losses, accuracies, counts = (jnp.stack(x) for x in zip(*steps, strict=True))
    weights = decay ** jnp.arange(len(steps), dtype=jnp.float32)
    return TTTLoss(jnp.sum(weights * losses), losses, accuracies, counts)


def _step(logits, target_probs, target_argmax, valid, draft_to_target, k: int):
    """Loss, accuracy and count of one step: position t is scored against t + k (positions
    whose t + k is past the end drop out; slices, not shifted copies, of the big arrays)."""
    t = max(logits.shape[1] - k, 0)
    logits = logits[:, :t].astype(jnp.float32)  # f32[B, T-k, Vd]
    probs, argmax, mask = target_probs[:, k:], target_argmax[:, k:], valid[:, k:]
    cross_entropy = -jnp.sum(probs * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    hits = draft_to_target[jnp.argmax(logits, axis=-1)] == argmax  # bool[B, T-k]
    count = jnp.sum(mask)
    denominator = jnp.maximum(count, 1).astype(jnp.float32)
    return (jnp.sum(jnp.where(mask, cross_entropy, 0.0)) / denominator,
            jnp.sum(mask & hits) / denominator, count.astype(jnp.int32))
