"""RMSNorm, computed in float32 and cast back, as the Hugging Face reference does."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, zero_centered: bool = False
             ) -> jax.Array:
    """x: [..., D], weight: [D] -> [..., D] in x.dtype.

    zero_centered (Qwen3-Next): the weight is stored around 0 and the output is
    normed * (1 + weight), multiplied in float32 before the cast (Llama casts first)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)
