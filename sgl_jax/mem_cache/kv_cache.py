"""The device-side paged KV cache: one (K, V) pair of page arrays per layer."""

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import LayerKV
from sgl_jax.models.config import ModelConfig


def allocate_kv_cache(
    config: ModelConfig, *, num_pages: int, page_size: int, dtype: jax.typing.DTypeLike
) -> list[LayerKV]:
    """Per layer: (k_pages, v_pages), each [num_pages, page_size, n_kv_heads, head_dim]."""
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers)]


def kv_cache_bytes(config: ModelConfig, *, num_pages: int, page_size: int, dtype) -> int:
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return num_pages * page_size * per_token * jnp.dtype(dtype).itemsize
