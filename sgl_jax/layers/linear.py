"""Products with matrices kept in the checkpoint's [out, in] layout, in the model dtype or in
8 bits (`quantization.QuantizedWeight`)."""

from __future__ import annotations

import jax

from sgl_jax.layers.quantization import QuantizedWeight, dequantize, per_channel_product


def matmul_rows(x: jax.Array, weight: jax.Array | QuantizedWeight, **kwargs) -> jax.Array:
    """x [T, in] times weight [*out, in] -> [T, *out] (x @ weight.T without a transpose).

    The weight is flattened to 2-D first: XLA:CPU runs a product with several output axes
    several times slower than the same rows as one matrix."""
    out_shape = weight.shape[:-1]
    rows = weight.reshape(-1, weight.shape[-1])
    if isinstance(rows, QuantizedWeight):
        return _quantized_product(x, rows, **kwargs).reshape(x.shape[0], *out_shape)
    y = jax.lax.dot_general(x, rows, (((1,), (1,)), ((), ())), **kwargs)
    return y.reshape(x.shape[0], *out_shape)


def _quantized_product(x: jax.Array, rows: QuantizedWeight, preferred_element_type=None
                       ) -> jax.Array:
    """x [T, in] times 8-bit rows [R, in] -> [T, R] in preferred_element_type or x's dtype."""
    dtype = preferred_element_type or x.dtype
    if rows.num_blocks > 1:
        return jax.lax.dot_general(x, dequantize(rows, x.dtype), (((1,), (1,)), ((), ())),
                                   preferred_element_type=dtype)
    y = per_channel_product(x, rows, lambda a, b, acc: jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), preferred_element_type=acc))  # f32[T, R]
    return (y * rows.scales[:, 0]).astype(dtype)
