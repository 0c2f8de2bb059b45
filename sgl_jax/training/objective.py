"""What a trainer step optimises: an `Objective` says what the frozen target contributes to a
batch and how the draft's loss is computed from it. `Eagle3Objective` is EAGLE3's
training-time test (ttt.py, loss.py); DFlash's block objective lives in training/dflash.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from sgl_jax.models.llama_eagle3 import Eagle3Config
from sgl_jax.models.loader import LoadedModel
from sgl_jax.training.loss import TTTLoss, ttt_loss
from sgl_jax.training.target import target_outputs
from sgl_jax.training.ttt import ttt_logits


class Batch(NamedTuple):
    """Host arrays from `collate`, device arrays inside the jitted steps."""

    input_ids: jax.Array  # i32[B, T], right-padded with 0
    loss_mask: jax.Array  # bool[B, T]


class Objective(Protocol):
    frozen: tuple[str, ...]  # draft tensors that are not trained

    def target(self, target: LoadedModel, target_params, batch: Batch) -> Any:
        """What the frozen target gives the loss for `batch` (jitted, no gradient)."""

    def loss(self, draft_params: dict, target_params, outputs: Any, batch: Batch,
             key: jax.Array) -> tuple[jax.Array, Any]:
        """The scalar to minimise and the metrics: a named tuple with per-step `losses`,
        `accuracies` and `counts` (steps: TTT steps or block positions). `key` draws
        whatever the objective samples (DFlash's anchors)."""


class Eagle3Objective:
    frozen = ("d2t",)

    def __init__(self, config: Eagle3Config, capture_layers: tuple[int, ...],
                 ttt_length: int):
        self.config, self.capture_layers, self.ttt_length = config, capture_layers, ttt_length

    def target(self, target: LoadedModel, target_params, batch: Batch):
        return target_outputs(target, target_params, batch.input_ids, self.capture_layers)

    def loss(self, draft_params, target_params, outputs, batch: Batch, key
             ) -> tuple[jax.Array, TTTLoss]:
        features, logits = outputs
        draft_logits = ttt_logits(draft_params, target_params["embed"], draft_params["lm_head"],
                                  features.astype(draft_params["fc"].dtype), batch.input_ids,
                                  config=self.config, length=self.ttt_length)
        # Index t predicts token t + 2: the target's distribution for it sits at t + 1.
        d2t = draft_params["d2t"]
        result = ttt_loss(draft_logits, shift(logits, 1), shift(batch.loss_mask, 2),
                          jnp.arange(d2t.shape[0], dtype=d2t.dtype) + d2t)
        return result.total, result


def shift(x: jax.Array, k: int) -> jax.Array:
    """x[:, t + k] at index t along axis 1, zeros past the end."""
    pad = [(0, 0), (0, k)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, k:], pad)
