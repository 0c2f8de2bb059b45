"""The device-side paged KV cache: one (K, V) pair of page arrays per layer."""

import os

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


def device_memory_bytes(device: jax.Device) -> int:
    """Accelerator memory, or the host's RAM for the CPU backend."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_pool_pages(
    config: ModelConfig,
    *,
    page_size: int,
    dtype,
    max_total_tokens: int | None,
    mem_fraction_static: float,
    param_bytes: int,
    max_useful_tokens: int,
    draft_config: ModelConfig | None = None,
) -> int:
    """Pages in the KV pool: max_total_tokens when given, else what the memory fraction leaves
    after the weights, never more than `max_useful_tokens` (every running request at full
    context length). A speculative draft's cache shares the page ids, so each token also
    costs its draft K/V. One extra page is the null page."""
    if max_total_tokens is None:
        budget = mem_fraction_static * device_memory_bytes(jax.devices()[0]) - param_bytes
        per_token = sum(kv_cache_bytes(c, num_pages=1, page_size=1, dtype=dtype)
                        for c in (config, draft_config) if c is not None)
        max_total_tokens = min(int(budget // per_token), max_useful_tokens)
        if max_total_tokens < 2 * page_size:
            raise ValueError(
                f"mem_fraction_static={mem_fraction_static} leaves no room for the KV cache "
                f"after {param_bytes / 2**30:.2f} GiB of weights; raise it or set max_total_tokens"
            )
    return max_total_tokens // page_size + 1
