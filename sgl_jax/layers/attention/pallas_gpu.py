"""Ragged paged attention as a Pallas Triton kernel for NVIDIA GPUs.

Semantics are those of `ragged_paged_attention_reference` (native.py). One program handles one
query block and one KV head: its rows are the block's tokens times the query heads sharing that
KV head, padded to a power of two, since every Triton tensor needs a power-of-two size. The
program walks the sequence's KV in blocks of `kv_block_tokens` tokens, gathering keys and values
slot by slot through the page table (so any page size works, 1 included) and folding them in
with an online softmax in f32. Triton has no scalar prefetch, so per-block lengths and the page
table are ordinary inputs the kernel loads itself.
The pages may hold other layers' pages too (a model's layers share one pair of arrays):
`page_offset`, a dynamic scalar so every layer runs the same compiled kernel, is added to
every page id the kernel loads.

Head dims. Any multiple of 8 works; Triton tensors are a power of two wide, so the kernel
computes over `padded_head_dim` columns (the next power of two >= 16). The queries are padded
with zeros in the wrapper (a copy of q, which `_to_rows` makes anyway) and the output's extra
columns are dropped, but the cache is never copied: keys and values are loaded straight from the
pages with a column mask, so the padding columns are zeros in registers and never read from
memory. Zero columns add nothing to q.k, and `scale` stays the caller's (of the real head dim).

KV dtype. The pages may be stored in another dtype than q (`--kv-cache-dtype`, e.g. fp8): they
are loaded as stored, so the memory traffic is the pages' own, and cast to q's dtype in
registers before the dots.

Sliding window. With `sliding_window` W, keys W or more behind a row's query are masked, and
the loop starts at the KV block holding the first key the block's earliest query sees, so
blocks wholly behind the window are never loaded.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sgl_jax.layers.attention.checks import check_static_inputs
from sgl_jax.layers.attention.metadata import (
    AttentionMetadata,
    window_visible,
    within_sliding_window,
)

_MASKED = -1e30  # finite, so fully masked rows give zeros instead of NaN
_MIN_DOT = 16  # smallest dimension tl.dot accepts
_LOG2_E = math.log2(math.e)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The width the kernel computes over: the next power of two >= 16."""
    return max(_MIN_DOT, _next_pow2(head_dim))


def _head_dim_ok(head_dim: int) -> bool:
    # Our rule, not Triton's (a mask takes any width): at a multiple of 8 bf16, every cache row
    # starts and its column mask ends on a 16-byte boundary, so rows load as whole vectors.
    return head_dim > 0 and head_dim % 8 == 0


@functools.partial(
    jax.jit, static_argnames=("scale", "sliding_window", "kv_block_tokens", "num_warps",
                              "num_stages", "interpret")
)
def ragged_paged_attention_gpu(
    q: jax.Array,  # [T, n_heads, hd]
    k_pages: jax.Array,  # [num_pages, n_kv, page_size, hd], this step's K already written
    v_pages: jax.Array,  # [num_pages, n_kv, page_size, hd]; K/V in any float dtype (fp8 too)
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    kv_block_tokens: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    page_offset: jax.Array | int = 0,  # i32[]: the page table's page 0 in the pages
) -> jax.Array:  # [T, n_heads, hd], q.dtype
    """Attention of every query block over its sequence's paged KV (see module docstring)."""
    check_static_inputs(q, k_pages, v_pages, metadata, head_dim_ok=_head_dim_ok,
                        head_dim_rule="a multiple of 8", sliding_window=sliding_window)
    if not _is_pow2(kv_block_tokens) or kv_block_tokens < _MIN_DOT:
        raise ValueError(f"kv_block_tokens must be a power of two >= {_MIN_DOT}, "
                         f"got {kv_block_tokens}")
    num_tokens, n_heads, hd = q.shape
    num_pages, n_kv, page_size, _ = k_pages.shape
    num_blocks, q_block = metadata.num_blocks, metadata.q_block
    group = n_heads // n_kv
    rows = max(_MIN_DOT, _next_pow2(q_block * group))
    width = padded_head_dim(hd)

    queries = _to_rows(q, num_blocks, q_block, n_kv, rows, width)  # [NB, n_kv, R, width]
    tree_bits = None
    if metadata.tree_bits is not None:
        tree_bits = _tree_bits_to_rows(metadata.tree_bits, num_blocks, group, rows)
    kernel = functools.partial(
        _attention_kernel, scale=scale, group=group, q_block=q_block, page_size=page_size,
        kv_block_tokens=kv_block_tokens, tree=tree_bits is not None,
        sliding_window=sliding_window,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, n_kv),
        in_specs=_in_specs(rows, width, hd, num_pages, page_size, metadata.page_table.shape[1],
                           None if tree_bits is None else tree_bits.shape[2]),
        out_specs=pl.BlockSpec((None, None, rows, width), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(queries.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        queries,
        k_pages,
        v_pages,
        metadata.page_table,
        metadata.kv_lens,
        metadata.window_starts,
        metadata.q_starts,
        jnp.reshape(jnp.asarray(page_offset, jnp.int32), (1,)),
        tree_bits,
    )
    return _from_rows(out, q_block, group, hd).reshape(num_tokens, n_heads, hd)


def _to_rows(
    q: jax.Array,  # [T, n_heads, hd]
    num_blocks: int, q_block: int, n_kv: int, rows: int, width: int,
) -> jax.Array:  # [NB, n_kv, R, width]: row i * group + g is token i of the block, head g
    hd = q.shape[2]
    x = q.reshape(num_blocks, q_block, n_kv, -1, hd).transpose(0, 2, 1, 3, 4)
    x = x.reshape(num_blocks, n_kv, -1, hd)
    # Zero rows are dropped from the output; zero columns add nothing to q.k.
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - x.shape[2]), (0, width - hd)))


def _from_rows(
    out: jax.Array,  # [NB, n_kv, R, width]
    q_block: int, group: int, hd: int,
) -> jax.Array:  # [NB, q_block, n_kv, group, hd]
    num_blocks, n_kv = out.shape[:2]
    x = out[:, :, : q_block * group, :hd].reshape(num_blocks, n_kv, q_block, group, hd)
    return x.transpose(0, 2, 1, 3, 4)


def _tree_bits_to_rows(
    tree_bits: jax.Array,  # i32[T, words]
    num_blocks: int, group: int, rows: int,
) -> jax.Array:  # i32[NB, R, W]: each row's token's words, W a power of two
    words = tree_bits.shape[1]
    x = jnp.repeat(tree_bits.reshape(num_blocks, -1, words), group, axis=1)
    # Padding rows and words are zero: they see no window key, and their rows are dropped.
    return jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, _next_pow2(words) - words)))


def _in_specs(rows: int, width: int, hd: int, num_pages: int, page_size: int,
              table_width: int, words: int | None):
    """Blocks of (queries, k, v, page table, kv_lens, window_starts, q_starts, page offset,
    tree bits)."""
    per_block = pl.BlockSpec((None,), lambda b, h: (b,))  # one scalar per query block
    # The cache keeps its real head_dim: the kernel's masked loads pad it to `width`.
    cache = pl.BlockSpec((num_pages, None, page_size, hd), lambda b, h: (0, h, 0, 0))  # 1 head
    bits = None if words is None else pl.BlockSpec((None, rows, words), lambda b, h: (b, 0, 0))
    return [
        pl.BlockSpec((None, None, rows, width), lambda b, h: (b, h, 0, 0)),
        cache,
        cache,
        pl.BlockSpec((None, table_width), lambda b, h: (b, 0)),
        per_block,
        per_block,
        per_block,
        pl.BlockSpec((1,), lambda b, h: (0,)),
        bits,
    ]


def _attention_kernel(
    q_ref,  # [R, D]: this block's rows for one KV head, D = padded_head_dim(hd)
    k_ref,  # [num_pages, page_size, hd]: the whole cache for that KV head
    v_ref,  # [num_pages, page_size, hd]
    page_table_ref,  # i32[P]: the block's sequence's pages
    kv_len_ref,  # i32[]
    window_start_ref,  # i32[]
    q_start_ref,  # i32[]
    page_offset_ref,  # i32[1]: the page table's page 0 in the cache
    bits_ref,  # i32[R, W] or None: tree-mask words of each row
    o_ref,  # [R, D]
    *,
    scale: float,
    group: int,
    q_block: int,
    page_size: int,
    kv_block_tokens: int,
    tree: bool,
    sliding_window: int | None,
):
    rows, width = q_ref.shape
    kv_len, window_start = kv_len_ref[...], window_start_ref[...]
    q_offset = q_start_ref[...] + jnp.arange(rows, dtype=jnp.int32) // group  # i32[R]
    first_kv_block = 0
    if sliding_window is not None:
        # No row's window starts before the block's first query's: KV blocks wholly before
        # that start hold no visible key, so the loop begins past them.
        first_key = jnp.maximum(window_start + q_start_ref[...] - sliding_window + 1, 0)
        first_kv_block = first_key // kv_block_tokens
    q = q_ref[...]
    # in_window: i32[1, Bk] window offsets of the keys -> bool[R, Bk] for keys in the window.
    if tree:
        words = [bits_ref[:, j : j + 1] for j in range(bits_ref.shape[1])]  # i32[R, 1] each
        in_window = functools.partial(window_visible, words)
        end = kv_len
    else:
        def in_window(offset):
            return offset <= q_offset[:, None]
        # No key past the block's last query is causally visible: skip those KV blocks.
        end = jnp.minimum(kv_len, window_start + q_start_ref[...] + q_block)

    def body(i, carry):
        kv_index = i * kv_block_tokens + jnp.arange(kv_block_tokens, dtype=jnp.int32)  # i32[Bk]
        keys, values = _load_kv_block(k_ref, v_ref, page_table_ref, page_offset_ref[0], kv_index,
                                      kv_len, page_size, width, q.dtype)
        offset = (kv_index - window_start)[None, :]  # i32[1, Bk]: negative for prefix keys
        visible = ((offset < 0) | in_window(offset)) & (kv_index < kv_len)[None, :]
        if sliding_window is not None:  # offsets from one window start compare as KV indices
            visible &= within_sliding_window(offset, q_offset[:, None], sliding_window)
        return _online_softmax_step(carry, q, keys, values, visible, scale)

    init = (
        jnp.full((rows,), _MASKED, jnp.float32),  # running max of the scores
        jnp.zeros((rows,), jnp.float32),  # running sum of exp2(score - max)
        jnp.zeros((rows, width), jnp.float32),  # running weighted sum of values
    )
    num_kv_blocks = (end + kv_block_tokens - 1) // kv_block_tokens
    _, denominator, acc = jax.lax.fori_loop(first_kv_block, num_kv_blocks, body, init)
    o_ref[...] = (acc / jnp.maximum(denominator, 1e-30)[:, None]).astype(o_ref.dtype)


def _load_kv_block(
    k_ref, v_ref,  # [num_pages, page_size, hd]
    page_table_ref,  # i32[P]
    page_offset: jax.Array,  # i32[]: added to every page id
    kv_index: jax.Array,  # i32[Bk]: KV positions of this block's keys
    kv_len: jax.Array,  # i32[]
    page_size: int,
    width: int,  # D = padded_head_dim(hd)
    dtype,  # the queries': what the keys and values are computed in
) -> tuple[jax.Array, jax.Array]:  # keys, values: dtype[Bk, D], zero past kv_len and past hd
    valid = kv_index < kv_len  # bool[Bk]
    # Clamped so positions past the table read a real entry; they are masked below anyway.
    page_col = jnp.minimum(kv_index // page_size, page_table_ref.shape[0] - 1)
    page, offset = page_table_ref[page_col] + page_offset, kv_index % page_size  # i32[Bk] each
    hd = k_ref.shape[2]
    column = jnp.arange(width, dtype=jnp.int32)  # i32[D]
    # Integer indices on every axis: the interpreter cannot mix an index array with a slice.
    index = (page[:, None], offset[:, None], column[None, :])
    # A masked load never reads the slot, so stale NaN past kv_len cannot reach the p @ V sum.
    # Columns past hd (the next slot's memory) are not read either: they load as zeros.
    mask = valid[:, None] if width == hd else valid[:, None] & (column < hd)[None, :]
    mask = jnp.broadcast_to(mask, (kv_index.shape[0], width))  # bool[Bk, D]
    # `other` a float: Triton casts no integer to fp8.
    keys = plgpu.load(k_ref.at[index], mask=mask, other=0.0)
    values = plgpu.load(v_ref.at[index], mask=mask, other=0.0)
    # Pages stored in another dtype (--kv-cache-dtype fp8: Triton's fp8e4nv / fp8e5, whose
    # casts need sm_89+) are cast in registers right after the load.
    return keys.astype(dtype), values.astype(dtype)


def _online_softmax_step(
    carry: tuple,  # (f32[R] running max, f32[R] running sum, f32[R, D] weighted values)
    q: jax.Array,  # [R, D]
    keys: jax.Array,  # [Bk, D]
    values: jax.Array,  # [Bk, D], zero where not loaded
    visible: jax.Array,  # bool[R, Bk]
    scale: float,
) -> tuple:  # the updated carry
    """Fold one KV block into the running softmax of every row.

    Scores are kept in base-2 units (scaled by log2 e) so the exponentials are a cheap exp2.
    """
    running_max, denominator, acc = carry
    scores = plgpu.dot(q, keys, trans_b=True) * (scale * _LOG2_E)  # f32[R, Bk]
    scores = jnp.where(visible, scores, _MASKED)
    new_max = jnp.maximum(running_max, scores.max(axis=1))
    correction = jnp.exp2(running_max - new_max)
    # `where` keeps masked keys at exactly zero weight even when a row's whole block is masked.
    weights = jnp.where(visible, jnp.exp2(scores - new_max[:, None]), 0.0)
    denominator = denominator * correction + weights.sum(axis=1)
    update = plgpu.dot(weights.astype(values.dtype), values)  # f32[R, D]
    return new_max, denominator, acc * correction[:, None] + update
