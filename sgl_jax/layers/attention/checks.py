"""Input validators shared by the attention kernels.

`check_static_inputs` runs while tracing (shapes and dtypes only); `check_dynamic_inputs` needs
concrete metadata and is for tests, benchmarks and debugging, never inside a jitted step.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers.attention.metadata import MASK_WORD_BITS, AttentionMetadata


def check_static_inputs(
    q: jax.Array,  # [T, n_heads, hd]
    k_pages: jax.Array,  # [num_pages, n_kv, page_size, hd]
    v_pages: jax.Array,  # [num_pages, n_kv, page_size, hd]
    metadata: AttentionMetadata,
    *,
    head_dim_ok: Callable[[int], bool] = lambda hd: True,
    head_dim_rule: str = "",
    sliding_window: int | None = None,
) -> None:
    """Raise ValueError naming the first shape, dtype or window the kernels cannot take."""
    check_sliding_window(sliding_window)
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"q must be [T, n_heads, head_dim] and the pages [num_pages, n_kv, "
                         f"page_size, head_dim]; got {q.shape} and {k_pages.shape}")
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {k_pages.shape} {k_pages.dtype} and v_pages {v_pages.shape} "
                         f"{v_pages.dtype} differ")
    # The pages' dtype may differ from q's (--kv-cache-dtype fp8): kernels cast what they read.
    if not jnp.issubdtype(k_pages.dtype, jnp.floating):
        raise ValueError(f"the KV pages must hold floats, got {k_pages.dtype}")
    num_tokens, n_heads, head_dim = q.shape
    n_kv = k_pages.shape[1]
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, the cache {k_pages.shape[3]}")
    if not head_dim_ok(head_dim):
        raise ValueError(f"head_dim {head_dim} is not supported by this kernel: {head_dim_rule}")
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads do not share {n_kv} KV heads evenly")
    num_blocks = metadata.num_blocks
    if num_tokens != num_blocks * metadata.q_block:
        raise ValueError(f"{num_tokens} tokens are not {num_blocks} query blocks of "
                         f"{metadata.q_block}")
    for name in ("kv_lens", "window_starts", "q_starts"):
        if getattr(metadata, name).shape != (num_blocks,):
            raise ValueError(f"{name} must be i32[{num_blocks}], got "
                             f"{getattr(metadata, name).shape}")
    if metadata.page_table.ndim != 2 or metadata.page_table.shape[0] != num_blocks:
        raise ValueError(f"page_table must be i32[{num_blocks}, P], got "
                         f"{metadata.page_table.shape}")
    if metadata.slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be i32[{num_tokens}], got "
                         f"{metadata.slot_mapping.shape}")
    bits = metadata.tree_bits
    if bits is not None and (bits.ndim != 2 or bits.shape[0] != num_tokens
                             or bits.dtype != np.int32):
        raise ValueError(f"tree_bits must be i32[{num_tokens}, words], got {bits.shape} "
                         f"{bits.dtype}")


def check_sliding_window(sliding_window: int | None) -> None:
    """A window is a static positive Python int (it shapes the compiled mask), or None."""
    if sliding_window is not None and (not isinstance(sliding_window, int)
                                       or isinstance(sliding_window, bool)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got "
                         f"{sliding_window!r}")


def check_dynamic_inputs(metadata: AttentionMetadata, *, num_pages: int, page_size: int) -> None:
    """Raise ValueError when concrete metadata would make a kernel read outside its sequence."""
    page_table = np.asarray(metadata.page_table)
    kv_lens = np.asarray(metadata.kv_lens)
    window_starts = np.asarray(metadata.window_starts)
    q_starts = np.asarray(metadata.q_starts)
    if (page_table < 0).any() or (page_table >= num_pages).any():
        raise ValueError(f"page ids must lie in [0, {num_pages})")
    capacity = page_table.shape[1] * page_size
    if (kv_lens < 0).any() or (kv_lens > capacity).any():
        raise ValueError(f"kv_lens must lie in [0, {capacity}] (page table width x page size)")
    live = kv_lens > 0
    if ((window_starts < 0) | (window_starts > kv_lens))[live].any():
        raise ValueError("window_starts must lie in [0, kv_len] for every live block")
    if (window_starts + q_starts >= kv_lens)[live].any():
        raise ValueError("a live query block starts past its sequence's new tokens")
    slots = np.asarray(metadata.slot_mapping)
    if (slots < 0).any() or (slots >= num_pages * page_size).any():
        raise ValueError(f"slot_mapping must lie in [0, {num_pages * page_size})")
    if metadata.tree_bits is not None:
        words = np.asarray(metadata.tree_bits).shape[1]
        if ((kv_lens - window_starts)[live] > words * MASK_WORD_BITS).any():
            raise ValueError(f"a window is longer than the {words * MASK_WORD_BITS} tokens its "
                             "tree mask words cover")
