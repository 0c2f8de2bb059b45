"""The device-side paged KV cache: one (K, V) pair of page arrays holding every attention
layer's pages (`ModelCache`), split across the tensor-parallel mesh by KV head (a hybrid
model's linear-attention layers hold a recurrent-state pool each, see `state_pool`).

The pages' dtype is `--kv-cache-dtype` (`kv_cache_dtype`): the model dtype, bfloat16 or an
fp8 format. Values are cast when written (no scales: SGLang's and vLLM's default scale 1.0)
and every attention backend casts what it reads to the query's dtype before computing."""

import os

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import ModelCache
from sgl_jax.mem_cache.state_pool import allocate_state_pool
from sgl_jax.models.config import ModelConfig
from sgl_jax.parallel import TensorParallel

# --kv-cache-dtype -> what the pages store ("auto": the model dtype).
_KV_CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "fp8_e5m2": jnp.float8_e5m2,
                    "fp8_e4m3": jnp.float8_e4m3fn}


def kv_cache_dtype(name: str, model_dtype: jax.typing.DTypeLike) -> jnp.dtype:
    """The dtype of the KV pages for a `--kv-cache-dtype` value."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name not in _KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of auto, "
                         f"{', '.join(_KV_CACHE_DTYPES)}")
    return jnp.dtype(_KV_CACHE_DTYPES[name])


def allocate_kv_cache(
    config: ModelConfig, *, num_pages: int, page_size: int, dtype: jax.typing.DTypeLike,
    tp: TensorParallel | None = None, num_state_slots: int = 0,
    kv_dtype: jax.typing.DTypeLike | None = None,
) -> ModelCache:
    """Every attention layer's `num_pages` pages in one (K, V) pair of kv_dtype[A * num_pages,
    kv_heads, page_size, head_dim] arrays (A attention layers, layer a's pages from row
    a * num_pages on), kv_heads = tp.kv_heads(config.num_kv_heads) (the model's, or one per
    device when it has fewer) and kv_dtype the model's `dtype` unless given. Per
    linear-attention layer of a hybrid model: its pool of `num_state_slots` recurrent states,
    in the dtypes `state_pool` gives them from the model's `dtype`, never kv_dtype (a
    recurrent state is rewritten every step: rounding it to 8 bits each time would
    compound)."""
    tp = tp or TensorParallel.of_size(1)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    states = tuple(allocate_state_pool(config, num_slots=num_state_slots, dtype=dtype, tp=tp)
                   if config.is_linear_layer(i) else None for i in range(config.num_layers))
    layers = sum(state is None for state in states)
    shape = (layers * num_pages, tp.kv_heads(config.num_kv_heads), page_size, config.head_dim)
    k, v = ((tp.kv_pages(shape, kv_dtype), tp.kv_pages(shape, kv_dtype)) if layers
            else (None, None))
    return ModelCache(k, v, states, num_pages)


def kv_bytes_per_token(config: ModelConfig, dtype, tp: TensorParallel) -> int:
    """What one token's K and V cost on each device (attention layers only), `dtype` being
    the pages' (`kv_cache_dtype`): fp8 pages cost half of bfloat16's."""
    heads_per_device = tp.kv_heads(config.num_kv_heads) // tp.size
    return (2 * config.num_attention_layers * heads_per_device * config.head_dim
            * jnp.dtype(dtype).itemsize)


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
    state_bytes: int = 0,
) -> int:
    """Pages in the KV pool: max_total_tokens when given, else what the memory fraction of one
    device leaves after its share of the weights (`param_bytes`) and of the recurrent-state
    pool (`state_bytes`, hybrid models: taken before any page is counted), never more than
    `max_useful_tokens` (every running request at full context length). `bytes_per_token`
    is the per-device KV cost of a token: a speculative draft's cache shares the page ids, so
    it includes the draft's K/V. One extra page is the null page."""
    if max_total_tokens is None:
        budget = (mem_fraction_static * device_memory_bytes(jax.local_devices()[0])
                  - param_bytes - state_bytes)
        max_total_tokens = min(int(budget // bytes_per_token), max_useful_tokens)
        if max_total_tokens < 2 * page_size:
            states = (f" and {state_bytes / 2**30:.2f} GiB of recurrent states"
                      if state_bytes else "")
            raise ValueError(
                f"mem_fraction_static={mem_fraction_static} leaves no room for the KV cache "
                f"after {param_bytes / 2**30:.2f} GiB of weights{states} per device; raise it "
                "or set max_total_tokens")
    return max_total_tokens // page_size + 1
