"""Products with matrices kept in the checkpoint's [out, in] layout."""

from __future__ import annotations

import jax


def matmul_rows(x: jax.Array, weight: jax.Array, **kwargs) -> jax.Array:
    """x [T, in] times weight [*out, in] -> [T, *out] (x @ weight.T without a transpose).

    The weight is flattened to 2-D first: XLA:CPU runs a product with several output axes
    several times slower than the same rows as one matrix."""
    rows = weight.reshape(-1, weight.shape[-1])
    y = jax.lax.dot_general(x, rows, (((1,), (1,)), ((), ())), **kwargs)
    return y.reshape(x.shape[0], *weight.shape[:-1])
