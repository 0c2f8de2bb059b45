"""The `native` attention backend: ragged paged attention in plain jnp.

It is also the reference every attention kernel is tested against, so it favours being
obviously right over being fast: each sequence's pages are gathered into a dense [KV] axis and
queries are laid out as [S, max_q_len]; masked keys and values are zeroed so that garbage
(even NaN) in unused pages can never leak into an output.
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
) -> jax.Array:  # [T, n_heads, hd]
    num_tokens, n_heads, hd = q.shape
    _, page_size, n_kv, _ = k_pages.shape
    num_seqs, pages_per_seq = metadata.page_table.shape
    max_kv = pages_per_seq * page_size
    group = n_heads // n_kv

    starts = metadata.cu_q_lens[:-1]  # i32[S]
    q_lens = metadata.cu_q_lens[1:] - starts  # i32[S]
    prefix_lens = metadata.kv_lens - q_lens  # i32[S]
    q_offsets = jnp.arange(metadata.max_q_len)  # i32[Q]
    token_index = jnp.clip(starts[:, None] + q_offsets[None, :], 0, num_tokens - 1)  # i32[S, Q]

    queries = q[token_index].reshape(num_seqs, metadata.max_q_len, n_kv, group, hd)
    kv_valid = jnp.arange(max_kv)[None, :] < metadata.kv_lens[:, None]  # bool[S, KV]
    keys = _gather_pages(k_pages, metadata.page_table, kv_valid)  # [S, KV, n_kv, hd]
    values = _gather_pages(v_pages, metadata.page_table, kv_valid)

    scores = jnp.einsum(
        "sqkgd,sckd->skgqc", queries, keys, preferred_element_type=jnp.float32
    ) * scale  # f32[S, n_kv, group, Q, KV]
    visible = _visibility(metadata, prefix_lens, token_index, kv_valid)  # bool[S, Q, KV]
    scores = jnp.where(visible[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("skgqc,sckd->sqkgd", probs, values, preferred_element_type=jnp.float32)
    out = out.reshape(num_seqs, metadata.max_q_len, n_heads, hd).astype(q.dtype)
    return _unpad_tokens(out, metadata.cu_q_lens, num_tokens)


def _gather_pages(pages: jax.Array, page_table: jax.Array, kv_valid: jax.Array) -> jax.Array:
    """pages [N, ps, n_kv, hd], page_table i32[S, P] -> [S, P * ps, n_kv, hd], invalid = 0."""
    num_seqs, pages_per_seq = page_table.shape
    _, page_size, n_kv, hd = pages.shape
    dense = pages[page_table].reshape(num_seqs, pages_per_seq * page_size, n_kv, hd)
    return jnp.where(kv_valid[:, :, None, None], dense, jnp.zeros((), pages.dtype))


def _visibility(
    metadata: AttentionMetadata,
    prefix_lens: jax.Array,  # i32[S]
    token_index: jax.Array,  # i32[S, Q]
    kv_valid: jax.Array,  # bool[S, KV]
) -> jax.Array:  # bool[S, Q, KV]
    # Position of each key inside the window of new tokens; negative means prefix.
    window_offset = jnp.arange(kv_valid.shape[1])[None, :] - prefix_lens[:, None]  # i32[S, KV]
    window_offset = window_offset[:, None, :]  # i32[S, 1, KV]
    q_offsets = jnp.arange(metadata.max_q_len)[None, :, None]  # i32[1, Q, 1]
    if metadata.custom_mask is None:
        in_window_visible = window_offset <= q_offsets
    else:
        width = metadata.custom_mask.shape[1]
        rows = metadata.custom_mask[token_index]  # bool[S, Q, W]
        column = jnp.clip(window_offset, 0, width - 1)
        column = jnp.broadcast_to(column, rows.shape[:2] + (kv_valid.shape[1],))
        in_window_visible = jnp.take_along_axis(rows, column, axis=2) & (window_offset < width)
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
