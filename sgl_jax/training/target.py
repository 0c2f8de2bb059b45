"""What the draft learns from: the target's captured states and next-token logits over a batch.

The target runs through its own model code (`ModelImpl.forward`) with the capture layers the
server uses (`llama_eagle3.target_capture_layers`), with causal attention over dense rows
instead of the paged cache.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sgl_jax.models.loader import LoadedModel
from sgl_jax.training.ttt import DenseBatch, StepCache, ttt_attention


class TargetOutputs(NamedTuple):
    features: jax.Array  # f[B, T, 3*Ht]: the captured states of each position, concatenated
    logits: jax.Array  # f32[B, T, V]: the target's next-token logits at each position


def target_outputs(target: LoadedModel, params, input_ids: jax.Array,
                   capture_layers: tuple[int, ...]) -> TargetOutputs:
    """input_ids i32[B, T] (right-padded rows) -> the target's features and logits. No
    gradient flows into the target."""
    params = jax.lax.stop_gradient(params)
    impl, config = target.impl, target.config
    b, t = input_ids.shape
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)
    kv = StepCache.empty(config.num_layers)
    hidden, _, captured = impl.forward(params, kv, input_ids.reshape(-1), positions,
                                       DenseBatch(b), config=config, attention=ttt_attention,
                                       capture_layers=capture_layers)
    logits = impl.compute_logits(params, hidden, config)
    features = jnp.concatenate(captured, axis=-1)
    return TargetOutputs(features.reshape(b, t, -1), logits.reshape(b, t, -1))
