"""The device-side paged KV cache: one (K, V) pair of page arrays per layer, split across the
tensor-parallel mesh by KV head."""

import os

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import LayerKV
from sgl_jax.models.config import ModelConfig
from sgl_jax.parallel import TensorParallel


def allocate_kv_cache(
    config: ModelConfig, *, num_pages: int, page_size: int, dtype: jax.typing.DTypeLike,
    tp: TensorParallel | None = None,
) -> list[LayerKV]:
    """Per layer: (k_pages, v_pages), each [num_pages, kv_heads, page_size, head_dim] with
    kv_heads = tp.kv_heads(config) (the model's, or one per device when it has fewer)."""
    tp = tp or TensorParallel.of_size(1)
    shape = (num_pages, tp.kv_heads(config), page_size, config.head_dim)
    return [(tp.kv_pages(shape, dtype), tp.kv_pages(shape, dtype))
            for _ in range(config.num_layers)]


def kv_bytes_per_token(config: ModelConfig, dtype, tp: TensorParallel) -> int:
    """What one token's K and V cost on each device."""
    heads_per_device = tp.kv_heads(config) // tp.size
    return 2 * config.num_layers * heads_per_device * config.head_dim * jnp.dtype(dtype).itemsize


def device_memory_bytes(device: jax.Device) -> int:
    """Accelerator memory, or the host's RAM for the CPU backend."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_pool_pages(
    *,
    page_size: int,
    bytes_per_token: int,
    max_total_tokens: int | None,
    mem_fraction_static: float,
    param_bytes: int,
    max_useful_tokens: int,
) -> int:
    """Pages in the KV pool: max_total_tokens when given, else what the memory fraction of one
    device leaves after its share of the weights (`param_bytes`), never more than
    `max_useful_tokens` (every running request at full context length). `bytes_per_token`
    is the per-device KV cost of a token: a speculative draft's cache shares the page ids, so
    it includes the draft's K/V. One extra page is the null page."""
    if max_total_tokens is None:
        budget = mem_fraction_static * device_memory_bytes(jax.local_devices()[0]) - param_bytes
        max_total_tokens = min(int(budget // bytes_per_token), max_useful_tokens)
        if max_total_tokens < 2 * page_size:
            raise ValueError(
                f"mem_fraction_static={mem_fraction_static} leaves no room for the KV cache "
                f"after {param_bytes / 2**30:.2f} GiB of weights per device; raise it or set "
                "max_total_tokens")
    return max_total_tokens // page_size + 1
