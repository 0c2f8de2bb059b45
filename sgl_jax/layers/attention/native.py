"""The `native` attention backend: ragged paged attention in plain jnp.

It is also the reference every attention kernel is tested against. Queries come in blocks
that each belong to one sequence (see metadata.py); keys and values are gathered a block of
pages at a time and folded in with an online softmax, so memory stays bounded by the block,
and a loop over as many blocks as the longest sequence needs keeps sequence length out of the
compiled shapes. Masked keys and
values are zeroed so that garbage (even NaN) in unused pages can never leak into an output.
A sliding window (a static int) only narrows the mask; every KV block is still walked.

The pages may be stored in another dtype than the queries (`--kv-cache-dtype`, e.g. fp8):
`LayerKV.write` casts this step's K/V to the pages' dtype, and each gathered block is cast to the
query's dtype before any arithmetic.
"""

import dataclasses

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention.checks import check_sliding_window
from sgl_jax.layers.attention.metadata import (
    AttentionMetadata,
    LayerKV,
    from_windows,
    to_windows,
    token_slots,
    window_visible,
    within_sliding_window,
)

_MASKED = -1e30  # finite, so fully masked padding rows give zeros instead of NaN




def ragged_paged_attention_reference(
    q: jax.Array,  # [T, n_heads, hd]
    k_pages: jax.Array,  # [num_pages, n_kv, page_size, hd], this step's K already written;
    v_pages: jax.Array,  # [num_pages, n_kv, page_size, hd]; any float dtype (read as q's)
    metadata: AttentionMetadata,
    *,
    scale: float,
    block_tokens: int = 32,
    sliding_window: int | None = None,  # static: hide keys this far or further behind
    page_offset: jax.Array | int = 0,  # i32[]: the layer's first page (LayerKV.first_page)
) -> jax.Array:  # [T, n_heads, hd]
    """Each query block walks its sequence's KV in blocks of pages with an online softmax.

    The loop runs as many KV blocks as the longest sequence needs (a traced count), so the
    compiled shape does not depend on how long the sequences are, only on the page table width.
    """
    check_sliding_window(sliding_window)
    num_tokens, n_heads, hd = q.shape
    n_kv, page_size = k_pages.shape[1], k_pages.shape[2]
    num_blocks, q_block = metadata.num_blocks, metadata.q_block
    page_table, pages_per_block = _pad_page_table(metadata.page_table, page_size, block_tokens)
    block_len = pages_per_block * page_size
    queries = q.reshape(num_blocks, q_block, n_kv, n_heads // n_kv, hd)
    q_offsets = metadata.q_starts[:, None] + jnp.arange(q_block)[None, :]  # i32[NB, Bq]
    mask_words = None
    if metadata.tree_bits is not None:
        bits = metadata.tree_bits.reshape(num_blocks, q_block, -1)  # i32[NB, Bq, words]
        mask_words = [bits[:, :, j : j + 1] for j in range(bits.shape[2])]

    def kv_block(b: jax.Array, carry: tuple) -> tuple:
        pages = jax.lax.dynamic_slice_in_dim(page_table, b * pages_per_block, pages_per_block,
                                             1) + page_offset
        kv_index = b * block_len + jnp.arange(block_len)  # i32[B]: KV positions of this block
        kv_valid = kv_index[None, :] < metadata.kv_lens[:, None]  # bool[NB, B]
        # Scores of invisible keys are overwritten, so garbage keys need no masking; values
        # must be zeroed, since 0 * NaN would still poison the weighted sum.
        # Read in the pages' dtype, computed in the query's.
        keys = _gather_pages(k_pages, pages).astype(q.dtype)  # [NB, n_kv, B, hd]
        values = jnp.where(kv_valid[:, None, :, None],
                           _gather_pages(v_pages, pages).astype(q.dtype), 0)
        visible = _visibility(kv_index, metadata.window_starts, q_offsets, mask_words, kv_valid,
                              sliding_window)
        return _online_softmax_step(carry, queries, keys, values, visible, scale)

    num_kv_blocks = _cdiv(jnp.max(metadata.kv_lens), block_len)
    shape = (num_blocks, n_kv, n_heads // n_kv, q_block)
    init = (
        jnp.full(shape, _MASKED, jnp.float32),  # running max of the scores
        jnp.zeros(shape, jnp.float32),  # running sum of exp(score - max)
        jnp.zeros(shape + (hd,), jnp.float32),  # running weighted sum of values
    )
    _, denominator, acc = jax.lax.fori_loop(0, num_kv_blocks, kv_block, init)
    out = acc / jnp.maximum(denominator, 1e-30)[..., None]  # fully masked rows stay 0
    out = jnp.moveaxis(out, 3, 1).reshape(num_tokens, n_heads, hd)
    return out.astype(q.dtype)


def _pad_page_table(page_table: jax.Array, page_size: int, block_tokens: int):
    """Widen the table to whole blocks (with the null page) so every block slice is in range."""
    pages_per_block = max(1, block_tokens // page_size)
    pad = -page_table.shape[1] % pages_per_block
    return jnp.pad(page_table, ((0, 0), (0, pad))), pages_per_block


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


def _online_softmax_step(carry, queries, keys, values, visible, scale):
    """Fold one KV block into the running (max, sum, acc) of every query row."""
    running_max, denominator, acc = carry
    scores = jnp.einsum(
        "sqkgd,skcd->skgqc", queries, keys, preferred_element_type=jnp.float32
    ) * scale  # f32[S, n_kv, group, Q, B]
    visible = visible[:, None, None]  # bool[S, 1, 1, Q, B]
    scores = jnp.where(visible, scores, _MASKED)
    new_max = jnp.maximum(running_max, scores.max(axis=-1))
    correction = jnp.exp(running_max - new_max)
    # Multiplying by `visible` keeps masked keys at exactly zero weight even when a whole
    # block is masked (then scores == new_max == _MASKED and exp would give 1).
    weights = jnp.exp(scores - new_max[..., None]) * visible
    denominator = denominator * correction + weights.sum(axis=-1)
    update = jnp.einsum(
        "skgqc,skcd->skgqd", weights.astype(values.dtype), values,
        preferred_element_type=jnp.float32,
    )
    return new_max, denominator, acc * correction[..., None] + update


def _gather_pages(pages: jax.Array, page_ids: jax.Array) -> jax.Array:
    """pages [N, n_kv, ps, hd], page_ids i32[S, P] -> [S, n_kv, P * ps, hd]."""
    num_seqs, num_pages = page_ids.shape
    _, n_kv, page_size, hd = pages.shape
    gathered = pages[page_ids]  # [S, P, n_kv, ps, hd]
    return jnp.swapaxes(gathered, 1, 2).reshape(num_seqs, n_kv, num_pages * page_size, hd)


def _visibility(
    kv_index: jax.Array,  # i32[B]: positions in the sequences' KV of this block's keys
    window_starts: jax.Array,  # i32[NB]
    q_offsets: jax.Array,  # i32[NB, Bq]: each query's index among its sequence's new tokens
    mask_words: list[jax.Array] | None,  # each i32[NB, Bq, 1]: tree-mask words, or None
    kv_valid: jax.Array,  # bool[NB, B]
    sliding_window: int | None,
) -> jax.Array:  # bool[NB, Bq, B]
    # Position of each key inside the window of new tokens; negative means prefix.
    window_offset = (kv_index[None, :] - window_starts[:, None])[:, None, :]  # i32[NB, 1, B]
    if mask_words is None:
        in_window_visible = window_offset <= q_offsets[:, :, None]
    else:
        in_window_visible = window_visible(mask_words, window_offset)
    visible = ((window_offset < 0) | in_window_visible) & kv_valid[:, None, :]
    if sliding_window is not None:  # offsets from the same window start compare as KV indices
        visible &= within_sliding_window(window_offset, q_offsets[:, :, None], sliding_window)
    return visible


def native_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer_kv: LayerKV,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> tuple[jax.Array, LayerKV]:
    return paged_attention(ragged_paged_attention_reference, q, k, v, layer_kv, metadata,
                           scale=scale, sliding_window=sliding_window)


def paged_attention(kernel, q: jax.Array, k: jax.Array, v: jax.Array, layer_kv: LayerKV,
                    metadata: AttentionMetadata, **options) -> tuple[jax.Array, LayerKV]:
    """Write this step's K/V, then attend with `kernel` (which reads q in the window layout
    and the layer's pages): q, k, v [T, heads, hd] per token, packed or not (to_windows)."""
    layer_kv = layer_kv.write(token_slots(metadata), k, v)
    windows = dataclasses.replace(metadata, token_windows=None)
    out = kernel(to_windows(q, metadata), layer_kv.k, layer_kv.v, windows,
                 page_offset=jnp.int32(layer_kv.first_page), **options)
    return from_windows(out, metadata), layer_kv
