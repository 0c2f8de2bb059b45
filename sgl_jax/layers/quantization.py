"""8-bit weights: a matrix kept as int8 or FP8 (e4m3) values with float32 scales, used by
the products in `linear` and `moe` without a float copy of the whole model.

One layout serves every source. `values` has the float weight's shape [*out, in] (the
checkpoint's [out, in] layout, out axes as the parameter fuses them). `scales` is
f32[*out, in // block]: one scale per output row and block of `block` input features. A
weight quantized here (`--quantization int8|fp8`) has one block, the whole row (symmetric
per output channel); an FP8 checkpoint's 128x128 block scales are kept exactly, repeated
over the rows of their block (1/128 of the values' elements, in float32).

Per-channel weights enter the product as values cast to the activations' dtype (exact for
int8 and e4m3 in bfloat16), with the scale applied to the product's output: the cast fuses
into the dot, so memory traffic is the 8-bit matrix. Block-scaled weights are dequantized
inside the jitted step right before their product (one layer's matrix at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

# --quantization -> the stored values' dtype and its largest magnitude.
FORMATS = {"int8": (np.dtype(np.int8), 127.0),
           "fp8": (np.dtype(jnp.float8_e4m3fn), 448.0)}
# Parameters stored in 8 bits: every projection of the decoder layers and of draft heads.
# Norms, biases, routers, convolutions and the shared expert's gate ([1, H]) keep the model
# dtype: they are small.
PROJECTIONS = frozenset({
    "w_qkv", "w_o", "w_gate_up", "w_down", "w_expert_gate_up", "w_expert_down",
    "w_shared_gate_up", "w_shared_down", "w_in", "w_out", "fc",
})
# The token tables (one scale per token's row) are int8 too: they are a third to a half of a
# small model's bytes and 13% of Llama-3.1-8B's. fp8 keeps them in the model dtype, as FP8
# checkpoints do: e4m3's 3 mantissa bits there doubled the demo model's KL from its float
# self (docs/models.md).
TABLES = frozenset({"embed", "lm_head"})


def quantized_params(fmt: str) -> frozenset[str]:
    """The parameters --quantization `fmt` stores in 8 bits."""
    return PROJECTIONS | TABLES if fmt == "int8" else PROJECTIONS


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"],
         meta_fields=["dtype"])
@dataclass(frozen=True)
class QuantizedWeight:
    values: jax.Array | np.ndarray  # int8 or float8_e4m3fn [*out, in]
    scales: jax.Array | np.ndarray  # f32[*out, in // block]
    dtype: np.dtype  # the model dtype it computes in (what an embedding row comes out as)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def num_blocks(self) -> int:
        """Scale blocks along the input features (1: one scale per output channel)."""
        return self.scales.shape[-1]

    def reshape(self, *shape: int) -> QuantizedWeight:
        """The out axes regrouped (`shape` ends with the input features, or -1 for them)."""
        out = shape[:-1]
        return QuantizedWeight(self.values.reshape(*out, self.shape[-1]),
                               self.scales.reshape(*out, self.num_blocks), self.dtype)


def quantize(weight: np.ndarray, fmt: str) -> QuantizedWeight:
    """A float weight [*out, in] -> symmetric per-output-channel 8-bit values and scales
    f32[*out, 1] (host arrays)."""
    dtype, largest = FORMATS[fmt]
    w = weight.astype(np.float32)
    scales = np.abs(w).max(axis=-1, keepdims=True) / largest
    scales = np.where(scales > 0, scales, 1.0).astype(np.float32)
    scaled = w / scales
    if dtype.kind == "i":
        scaled = np.clip(np.rint(scaled), -largest, largest)
    return QuantizedWeight(scaled.astype(dtype), scales, np.dtype(weight.dtype))


def dequantize(weight: QuantizedWeight, dtype: jax.typing.DTypeLike) -> jax.Array:
    """values * scales, each scale over its block of input features -> [*out, in] in dtype."""
    *out, features = weight.shape
    blocks = weight.num_blocks
    values = weight.values.astype(jnp.float32).reshape(*out, blocks, features // blocks)
    return (values * weight.scales[..., None]).reshape(*out, features).astype(dtype)


def is_quantized(weight) -> bool:
    return isinstance(weight, QuantizedWeight)


def per_channel_operand(weight: QuantizedWeight, dtype: jax.typing.DTypeLike
                        ) -> tuple[jax.Array, jax.Array]:
    """A per-output-channel weight as the product's operand (its values in `dtype`) and the
    scales [*out] that multiply the product's output."""
    return weight.values.astype(dtype), weight.scales[..., 0]


def embedding_rows(table: jax.Array | QuantizedWeight, ids: jax.Array) -> jax.Array:
    """table[ids]: rows [*ids.shape, H] of a token table in the model dtype (an 8-bit table's
    rows dequantized alone)."""
    if not isinstance(table, QuantizedWeight):
        return table[ids]
    rows = QuantizedWeight(table.values[ids], table.scales[ids], table.dtype)
    return dequantize(rows, table.dtype)
