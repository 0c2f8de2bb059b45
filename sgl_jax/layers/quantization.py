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

`w8a8_int8` stores the same int8 weights and also quantizes each projection's input, per
token and at run time (symmetric, one f32 scale per row), so the product itself is int8 x
int8 accumulated in int32: the integer units of TPU v5e / v6e and of GPU tensor cores run it
at twice their bfloat16 rate, which helps where products are compute bound (prefill, large
batches). Decode at small batches is bound by reading the weights, which is the same for
both formats. The token tables stay weight-only int8: the logits are the product most
sensitive to rounding its input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

W8A8 = "w8a8_int8"  # int8 weights whose products also take int8 inputs
INT8_LARGEST = 127.0
# --quantization -> the stored values' dtype and its largest magnitude.
FORMATS = {"int8": (np.dtype(np.int8), INT8_LARGEST),
           "fp8": (np.dtype(jnp.float8_e4m3fn), 448.0),
           W8A8: (np.dtype(np.int8), INT8_LARGEST)}
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
    return PROJECTIONS if fmt == "fp8" else PROJECTIONS | TABLES


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"],
         meta_fields=["dtype", "int8_inputs"])
@dataclass(frozen=True)
class QuantizedWeight:
    values: jax.Array | np.ndarray  # int8 or float8_e4m3fn [*out, in]
    scales: jax.Array | np.ndarray  # f32[*out, in // block]
    dtype: np.dtype  # the model dtype it computes in (what an embedding row comes out as)
    int8_inputs: bool = False  # w8a8_int8: its products quantize their input rows to int8

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
        return replace(self, values=self.values.reshape(*out, self.shape[-1]),
                       scales=self.scales.reshape(*out, self.num_blocks))


def quantize_param(name: str, weight: np.ndarray, fmt: str) -> np.ndarray | QuantizedWeight:
    """Parameter `name` as --quantization `fmt` keeps it (unchanged where it stays float)."""
    if name not in quantized_params(fmt):
        return weight
    return quantize(weight, fmt, int8_inputs=fmt == W8A8 and name in PROJECTIONS)


def quantize(weight: np.ndarray, fmt: str, *, int8_inputs: bool = False) -> QuantizedWeight:
    """A float weight [*out, in] -> symmetric per-output-channel 8-bit values and scales
    f32[*out, 1] (host arrays)."""
    dtype, largest = FORMATS[fmt]
    w = weight.astype(np.float32)
    scales = np.abs(w).max(axis=-1, keepdims=True) / largest
    scales = np.where(scales > 0, scales, 1.0).astype(np.float32)
    scaled = w / scales
    if dtype.kind == "i":
        scaled = np.clip(np.rint(scaled), -largest, largest)
    return QuantizedWeight(scaled.astype(dtype), scales, np.dtype(weight.dtype), int8_inputs)


def dequantize(weight: QuantizedWeight, dtype: jax.typing.DTypeLike) -> jax.Array:
    """values * scales, each scale over its block of input features -> [*out, in] in dtype."""
    *out, features = weight.shape
    blocks = weight.num_blocks
    values = weight.values.astype(jnp.float32).reshape(*out, blocks, features // blocks)
    return (values * weight.scales[..., None]).reshape(*out, features).astype(dtype)


def is_quantized(weight) -> bool:
    return isinstance(weight, QuantizedWeight)


def int8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, in] -> int8 values [T, in] and f32 scales [T, 1]: symmetric, one scale per row
    (a token's input to a w8a8_int8 product; rows of zeros get scale 1)."""
    x32 = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / INT8_LARGEST
    scales = jnp.where(scales > 0, scales, 1.0)
    values = jnp.clip(jnp.round(x32 / scales), -INT8_LARGEST, INT8_LARGEST)
    return values.astype(jnp.int8), scales


Product = Callable[[jax.Array, jax.Array, Any], jax.Array]


def per_channel_product(x: jax.Array, weight: QuantizedWeight, product: Product) -> jax.Array:
    """`product(lhs [T, in], rhs, accumulator dtype) -> [T, ...]` of x and a per-output-channel
    weight's values, in float32 and before the weight's scales (which the caller applies to
    each output channel): int8 x int8 in int32 for w8a8_int8, else the values cast to x's
    dtype (the cast fuses into the dot)."""
    if weight.int8_inputs:
        values, scales = int8_rows(x)
        return product(values, weight.values, jnp.int32).astype(jnp.float32) * scales
    return product(x, weight.values.astype(x.dtype), jnp.float32)


def embedding_rows(table: jax.Array | QuantizedWeight, ids: jax.Array) -> jax.Array:
    """table[ids]: rows [*ids.shape, H] of a token table in the model dtype (an 8-bit table's
    rows dequantized alone)."""
    if not isinstance(table, QuantizedWeight):
        return table[ids]
    rows = QuantizedWeight(table.values[ids], table.scales[ids], table.dtype)
    return dequantize(rows, table.dtype)
