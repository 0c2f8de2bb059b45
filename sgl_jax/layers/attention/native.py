"""The `native` attention backend: ragged paged attention in plain jnp.

It is also the reference every attention kernel is tested against. Queries are laid out per
sequence as [S, max_q_len]; keys and values are gathered a block of pages at a time and folded
in with an online softmax, so memory stays bounded by the block, and a loop over as many blocks
as the longest sequence needs keeps sequence length out of the compiled shapes. Masked keys and
values are zeroed so that garbage (even NaN) in unused pages can never leak into an output.
"""

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention.metadata import AttentionMetadata, LayerKV

_MASKED = -1e30  # finite, so fully masked padding rows give zeros instead of NaN


def write_kv(layer_kv: LayerKV, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> LayerKV:
    """Scatter this step's k, v ([T, n_kv, hd]) into the paged cache at slot_mapping (i32[T])."""
    k_pages, v_pages = layer_kv
    num_pages, page_size, n_kv, hd = k_pages.shape

    def scatter(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(num_pages * page_size, n_kv, hd)
        return flat.at[slot_mapping].set(new.astype(pages.dtype)).reshape(pages.shape)

    return scatter(k_pages, k), scatter(v_pages, v)


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, n_heads, hd]
    k_pages: jax.Array,  # [num_pages, page_size, n_kv, hd], this step's K already written
    v_pages: jax.Array,  # [num_pages, page_size, n_kv, hd]
    metadata: AttentionMetadata,
    *,
    scale: float,
    block_tokens: int = 256,
) -> jax.Array:  # [T, n_heads, hd]
    """Walks each sequence's KV in blocks of pages with an online softmax.

    The loop runs as many blocks as the longest sequence needs (a traced count), so the
    compiled shape does not depend on how long the sequences are, only on the page table width.
    """
    num_tokens, n_heads, hd = q.shape
    n_kv = k_pages.shape[2]
    num_seqs = metadata.kv_lens.shape[0]
    page_size = k_pages.shape[1]
    page_table, pages_per_block = _pad_page_table(metadata.page_table, page_size, block_tokens)
    block_len = pages_per_block * page_size
    starts = metadata.cu_q_lens[:-1]  # i32[S]
    prefix_lens = metadata.kv_lens - (metadata.cu_q_lens[1:] - starts)  # i32[S]
    token_index = starts[:, None] + jnp.arange(metadata.max_q_len)[None, :]  # i32[S, Q]
    token_index = jnp.clip(token_index, 0, num_tokens - 1)
    queries = q[token_index].reshape(num_seqs, metadata.max_q_len, n_kv, n_heads // n_kv, hd)
    mask_rows = None if metadata.custom_mask is None else metadata.custom_mask[token_index]

    def block(b: jax.Array, carry: tuple) -> tuple:
        pages = jax.lax.dynamic_slice_in_dim(page_table, b * pages_per_block, pages_per_block, 1)
        kv_index = b * block_len + jnp.arange(block_len)  # i32[B]: KV positions of this block
        kv_valid = kv_index[None, :] < metadata.kv_lens[:, None]  # bool[S, B]
        # Scores of invisible keys are overwritten, so garbage keys need no masking; values
        # must be zeroed, since 0 * NaN would still poison the weighted sum.
        keys = _gather_pages(k_pages, pages)  # [S, B, n_kv, hd]
        values = jnp.where(kv_valid[:, :, None, None], _gather_pages(v_pages, pages), 0)
        visible = _visibility(kv_index, prefix_lens, mask_rows, metadata.max_q_len, kv_valid)
        return _online_softmax_step(carry, queries, keys, values, visible, scale)

    num_blocks = _cdiv(jnp.max(metadata.kv_lens), block_len)
    shape = (num_seqs, n_kv, n_heads // n_kv, metadata.max_q_len)
    init = (
        jnp.full(shape, _MASKED, jnp.float32),  # running max of the scores
        jnp.zeros(shape, jnp.float32),  # running sum of exp(score - max)
        jnp.zeros(shape + (hd,), jnp.float32),  # running weighted sum of values
    )
    _, denominator, acc = jax.lax.fori_loop(0, num_blocks, block, init)
    out = acc / jnp.maximum(denominator, 1e-30)[..., None]  # fully masked rows stay 0
    out = jnp.moveaxis(out, 3, 1).reshape(num_seqs, metadata.max_q_len, n_heads, hd)
    return _unpad_tokens(out.astype(q.dtype), metadata.cu_q_lens, num_tokens)


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
        "sqkgd,sckd->skgqc", queries, keys, preferred_element_type=jnp.float32
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
        "skgqc,sckd->skgqd", weights.astype(values.dtype), values,
        preferred_element_type=jnp.float32,
    )
    return new_max, denominator, acc * correction[..., None] + update


def _gather_pages(pages: jax.Array, page_ids: jax.Array) -> jax.Array:
    """pages [N, ps, n_kv, hd], page_ids i32[S, P] -> [S, P * ps, n_kv, hd]."""
    num_seqs, num_pages = page_ids.shape
    _, page_size, n_kv, hd = pages.shape
    return pages[page_ids].reshape(num_seqs, num_pages * page_size, n_kv, hd)


def _visibility(
    kv_index: jax.Array,  # i32[B]: positions in the sequences' KV of this block's keys
    prefix_lens: jax.Array,  # i32[S]
    mask_rows: jax.Array | None,  # bool[S, Q, W]: custom mask rows of each query, or None
    max_q_len: int,
    kv_valid: jax.Array,  # bool[S, B]
) -> jax.Array:  # bool[S, Q, B]
    # Position of each key inside the window of new tokens; negative means prefix.
    window_offset = (kv_index[None, :] - prefix_lens[:, None])[:, None, :]  # i32[S, 1, B]
    q_offsets = jnp.arange(max_q_len)[None, :, None]  # i32[1, Q, 1]
    if mask_rows is None:
        in_window_visible = window_offset <= q_offsets
    else:
        width = mask_rows.shape[2]
        column = jnp.clip(window_offset, 0, width - 1)
        column = jnp.broadcast_to(column, mask_rows.shape[:2] + (kv_index.shape[0],))
        in_window_visible = jnp.take_along_axis(mask_rows, column, axis=2)
        in_window_visible &= window_offset < width
    visible = (window_offset < 0) | in_window_visible
    return visible & kv_valid[:, None, :]


def _unpad_tokens(padded: jax.Array, cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """[S, Q, ...] per-sequence layout -> [T, ...] flat layout."""
    tokens = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tokens, side="right"), 0, padded.shape[0] - 1)
    offset = jnp.clip(tokens - cu_q_lens[seq], 0, padded.shape[1] - 1)
    return padded[seq, offset]


def native_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer_kv: LayerKV,
    metadata: AttentionMetadata,
    *,
    scale: float,
) -> tuple[jax.Array, LayerKV]:
    layer_kv = write_kv(layer_kv, k, v, metadata.slot_mapping)
    out = ragged_paged_attention_reference(q, *layer_kv, metadata, scale=scale)
    return out, layer_kv
