"""The device-side recurrent-state pool of hybrid models: for each linear-attention (Gated
DeltaNet) layer a `GdnState` whose leading axis is the slot, conv windows
[num_slots, K-1, conv_dim] in the activation dtype and delta-rule states
[num_slots, Hv, dk, dv] in float32, split across the tensor-parallel mesh by key head. Slot 0
is the null slot: padding rows point at it and never write it. A request owns one slot from
admission to finish, abort or retraction (`state_slots.StateSlotAllocator`)."""

from __future__ import annotations

import math

import jax

from sgl_jax.layers.gated_delta_net import GdnState, state_shapes
from sgl_jax.models.config import ModelConfig
from sgl_jax.parallel import TensorParallel


def allocate_state_pool(config: ModelConfig, *, num_slots: int, dtype: jax.typing.DTypeLike,
                        tp: TensorParallel) -> GdnState:
    """One linear layer's pool of `num_slots` zeroed states (slot 0 included)."""
    shapes = state_shapes(config.linear_attention, dtype)
    return tp.state_pool(GdnState(*(jax.ShapeDtypeStruct((num_slots, *s.shape), s.dtype)
                                    for s in shapes)))


def state_bytes_per_slot(config: ModelConfig, dtype: jax.typing.DTypeLike,
                         tp: TensorParallel) -> int:
    """What one request's states in every linear layer cost on each device (each device
    holds its key heads' share of every slot)."""
    if not config.is_hybrid:
        return 0
    per_layer = sum(math.prod(s.shape) * s.dtype.itemsize
                    for s in state_shapes(config.linear_attention, dtype))
    linear_layers = config.num_layers - config.num_attention_layers
    return linear_layers * per_layer // tp.size
