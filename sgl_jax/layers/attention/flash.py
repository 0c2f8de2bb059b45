"""The `fa` attention backend: the Pallas ragged paged FlashAttention kernel of the platform.

TPUs run the Mosaic TPU kernel, GPUs the Triton one. A CPU has no Pallas compiler, so there the
GPU kernel runs in Pallas interpret mode: slow, but the very kernel code, which is what lets CI
check that `fa` and `native` agree token for token.
"""

from __future__ import annotations

import functools

import jax

from sgl_jax.layers.attention.metadata import AttentionMetadata, LayerKV
from sgl_jax.layers.attention.native import paged_attention
from sgl_jax.layers.attention.pallas_gpu import ragged_paged_attention_gpu
from sgl_jax.layers.attention.pallas_tpu import ragged_paged_attention_tpu


def platform_kernel(platform: str):
    """The kernel `fa` runs on a JAX platform ('tpu', 'gpu', 'cuda', 'rocm' or 'cpu')."""
    if platform == "tpu":
        return ragged_paged_attention_tpu
    if platform in ("gpu", "cuda", "rocm"):
        return ragged_paged_attention_gpu
    if platform == "cpu":
        return functools.partial(ragged_paged_attention_gpu, interpret=True)
    raise ValueError(f"no Pallas attention kernel for platform {platform!r}; "
                     "use --attention-backend native")


def flash_attention(
    q: jax.Array,  # [T, n_heads, hd]
    k: jax.Array,  # [T, n_kv, hd]
    v: jax.Array,  # [T, n_kv, hd]
    layer_kv: LayerKV,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> tuple[jax.Array, LayerKV]:
    # The scatter runs in the same jitted step as the kernel, on the donated cache, so it
    # updates the pages in place before the kernel reads them.
    return paged_attention(platform_kernel(jax.default_backend()), q, k, v, layer_kv,
                           metadata, scale=scale, sliding_window=sliding_window)
