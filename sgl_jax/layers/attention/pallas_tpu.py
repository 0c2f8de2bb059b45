"""Ragged paged FlashAttention for TPU (Pallas, Mosaic TPU).

Module anatomy: the reference is `ragged_paged_attention_reference` in native.py (what the
`native` backend runs); the validators are in checks.py; below are the kernel and its jitted
wrapper. Semantics are the reference's exactly: query blocks of one sequence each, a prefix that
is always visible, a causal or packed tree-mask window, zero output for padding blocks.

Layout. The grid is (query block, KV block). Queries of a block are regrouped per KV head as
rows (query token, head in group), so each KV head's scores are one [rows, B] matmul. Pages
stay in HBM (`pl.ANY`); the kernel DMAs the pages of one KV block, per KV head, into VMEM,
using page ids from the scalar-prefetched page table (plus `page_offset`, the layer's first
page when a model's layers share one pair of page arrays). KV blocks past the sequence's length are
skipped, and the online-softmax state lives in VMEM scratch across the KV axis of the grid.
With a `sliding_window` W, keys W or more behind a row's query are masked, and KV blocks
wholly behind the window of the block's earliest query are skipped too (no DMA, no matmul).

KV dtype. The pages may be stored in another dtype than q (`--kv-cache-dtype`, e.g. fp8): the
DMAs copy them as stored into VMEM buffers of the pages' dtype (half a bfloat16 cache's bytes
with fp8), and each KV head's block is cast to q's dtype when read from VMEM. Checked here:
interpret mode and the Pallas -> Mosaic lowering; whether Mosaic compiles 8-bit pages of a
given page size (its native 8-bit tiling is 32 rows) is only known on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sgl_jax.layers.attention.checks import check_static_inputs
from sgl_jax.layers.attention.metadata import (
    AttentionMetadata,
    window_visible,
    within_sliding_window,
)

_MASKED = -1e30  # finite, as in the reference: fully masked rows give 0, not NaN


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "kv_block_tokens"))
def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, n_heads, hd]
    k_pages: jax.Array,  # [num_pages, n_kv, page_size, hd], this step's K already written
    v_pages: jax.Array,  # [num_pages, n_kv, page_size, hd]; K/V in any float dtype (fp8 too)
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    kv_block_tokens: int = 128,
    page_offset: jax.Array | int = 0,  # i32[]: the page table's page 0 in the pages
) -> jax.Array:  # [T, n_heads, hd]
    """Attention of every query block over its sequence's pages. On a CPU, run it under
    `pltpu.force_tpu_interpret_mode()`."""
    # Any multiple of 8 (80, 96, 24...) runs unpadded: Mosaic already lays a head_dim below a
    # multiple of 128 lanes out padded in VMEM and vregs, and zero-masks that padding in the
    # matmul's contraction. Padding here would copy the whole cache every step.
    check_static_inputs(q, k_pages, v_pages, metadata,
                        head_dim_ok=lambda hd: hd % 8 == 0, head_dim_rule="a multiple of 8",
                        sliding_window=sliding_window)
    num_tokens, n_heads, hd = q.shape
    _, n_kv, page_size, _ = k_pages.shape
    group, q_block, num_blocks = n_heads // n_kv, metadata.q_block, metadata.num_blocks
    rows = q_block * group
    pages_per_block = max(1, kv_block_tokens // page_size)
    page_table = metadata.page_table
    page_table = jnp.pad(page_table, ((0, 0), (0, -page_table.shape[1] % pages_per_block)))
    num_kv_blocks = page_table.shape[1] // pages_per_block

    # Row r of KV head h in block b is token b * q_block + r // group, head h * group + r % group.
    queries = q.reshape(num_blocks, q_block, n_kv, group, hd).transpose(0, 2, 1, 3, 4)
    queries = queries.reshape(num_blocks, n_kv, rows, hd)
    operands = [queries]
    in_specs = [pl.BlockSpec((None, n_kv, rows, hd), lambda b, kb, *_: (b, 0, 0, 0))]
    tree = metadata.tree_bits is not None
    if tree:
        words = metadata.tree_bits.shape[1]
        bits = jnp.repeat(metadata.tree_bits.reshape(num_blocks, q_block, words), group, axis=1)
        operands.append(bits)  # i32[NB, rows, words]
        in_specs.append(pl.BlockSpec((None, rows, words), lambda b, kb, *_: (b, 0, 0)))
    operands += [k_pages, v_pages]
    in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * 2

    kernel = functools.partial(
        _attention_kernel, scale=scale, group=group, pages_per_block=pages_per_block,
        table_width=page_table.shape[1], tree=tree, sliding_window=sliding_window,
    )
    block_kv = (n_kv, pages_per_block, page_size, hd)
    state = (n_kv, rows, 1)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_blocks, num_kv_blocks),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, n_kv, rows, hd), lambda b, kb, *_: (b, 0, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM(block_kv, k_pages.dtype),
                pltpu.VMEM(block_kv, v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, n_kv, pages_per_block)),
                pltpu.VMEM(state, jnp.float32),  # running max of the scores
                pltpu.VMEM(state, jnp.float32),  # running sum of exp(score - max)
                pltpu.VMEM((n_kv, rows, hd), jnp.float32),  # running weighted sum of values
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((num_blocks, n_kv, rows, hd), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY)),
        name="ragged_paged_attention_tpu",
    )(page_table.reshape(-1), metadata.kv_lens, metadata.window_starts, metadata.q_starts,
      jnp.reshape(jnp.asarray(page_offset, jnp.int32), (1,)), *operands)
    out = out.reshape(num_blocks, n_kv, q_block, group, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_tokens, n_heads, hd)


def _attention_kernel(
    # scalar prefetch (SMEM)
    page_table_ref,  # i32[NB * P']: each block's page ids, P' a whole number of KV blocks
    kv_lens_ref,  # i32[NB]
    window_starts_ref,  # i32[NB]
    q_starts_ref,  # i32[NB]
    page_offset_ref,  # i32[1]: added to every page id of the table
    # inputs
    q_ref,  # [n_kv, rows, hd]: this query block, rows = (token, head in group)
    *refs,  # [bits_ref i32[rows, words]], k_hbm, v_hbm, o_ref, scratch...
    scale: float,
    group: int,
    pages_per_block: int,
    table_width: int,
    tree: bool,
    sliding_window: int | None,
):
    bits_ref = refs[0] if tree else None
    k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, max_ref, sum_ref, acc_ref = refs[int(tree):]
    block, kv_block = pl.program_id(0), pl.program_id(1)
    n_kv, rows, _ = q_ref.shape
    _, _, page_size, hd = k_buf.shape
    block_len = pages_per_block * page_size
    kv_len = kv_lens_ref[block]
    block_start = kv_block * block_len
    # KV index of the block's first query (row 0): no row's window starts before its window,
    # so a KV block wholly before that start holds no visible key and is skipped.
    first_query = window_starts_ref[block] + q_starts_ref[block]
    holds_visible_keys = block_start < kv_len
    if sliding_window is not None:
        holds_visible_keys &= block_start + block_len > first_query - sliding_window + 1

    @pl.when(kv_block == 0)
    def _init():
        max_ref[...] = jnp.full(max_ref.shape, _MASKED, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(holds_visible_keys)
    def _fold_kv_block():
        _copy_kv_block(page_table_ref, page_offset_ref[0], k_hbm, v_hbm, k_buf, v_buf, sems,
                       first_page=block * table_width + kv_block * pages_per_block,
                       num_pages=jnp.minimum(pages_per_block, jax.lax.div(
                           kv_len - block_start + page_size - 1, page_size)))
        kv_index = block_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_len), 1)
        kv_valid = kv_index < kv_len  # bool[1, B]
        window_offset = kv_index - window_starts_ref[block]  # i32[1, B]; < 0 in the prefix
        if tree:
            words = [bits_ref[:, j : j + 1] for j in range(bits_ref.shape[1])]
            in_window = window_visible(words, window_offset)
        else:
            row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
            in_window = window_offset <= q_starts_ref[block] + jax.lax.div(row, group)
        visible = ((window_offset < 0) | in_window) & kv_valid  # bool[rows, B]
        if sliding_window is not None:
            query = first_query + jax.lax.div(
                jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)  # i32[rows, 1]
            visible &= within_sliding_window(kv_index, query, sliding_window)
        for head in range(n_kv):
            # Pages in another dtype (fp8) are cast to q's as they leave VMEM, before the
            # reshape, which then moves q-dtype tiles as it does without a KV dtype.
            keys = k_buf[head].astype(q_ref.dtype).reshape(block_len, hd)
            # Zero, not scale, invalid values: 0 * NaN would poison the weighted sum.
            values = jnp.where(kv_valid.reshape(block_len, 1),
                               v_buf[head].astype(q_ref.dtype).reshape(block_len, hd), 0)
            _online_softmax_step(q_ref[head], keys, values, visible, scale,
                                 max_ref.at[head], sum_ref.at[head], acc_ref.at[head])

    @pl.when(kv_block == pl.num_programs(1) - 1)
    def _finish():
        out = acc_ref[...] / jnp.maximum(sum_ref[...], 1e-30)
        o_ref[...] = out.astype(o_ref.dtype)


def _copy_kv_block(page_table_ref, page_offset, k_hbm, v_hbm, k_buf, v_buf, sems, *, first_page,
                   num_pages):
    """DMA the first `num_pages` pages of one KV block (the ones holding tokens), KV head by KV
    head, from HBM into VMEM, and wait for them. The rest of the buffer is stale; the caller
    masks it."""
    n_kv = k_buf.shape[0]

    def copies(i):
        page = page_table_ref[first_page + i] + page_offset
        return [pltpu.make_async_copy(src.at[page, head], dst.at[head, i],
                                      sems.at[kind, head, i])
                for head in range(n_kv)
                for kind, (src, dst) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]

    def start(i, carry):
        for copy in copies(i):
            copy.start()
        return carry

    def wait(i, carry):
        for copy in copies(i):
            copy.wait()
        return carry

    jax.lax.fori_loop(0, num_pages, start, 0)
    jax.lax.fori_loop(0, num_pages, wait, 0)


def _online_softmax_step(queries, keys, values, visible, scale, max_ref, sum_ref, acc_ref):
    """Fold one KV block into one KV head's running (max, sum, acc).

    queries [rows, hd]; keys, values [B, hd]; visible bool[rows, B]; state refs [rows, 1]
    and [rows, hd], all f32.
    """
    scores = jax.lax.dot_general(queries, keys, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible, scores, _MASKED)  # f32[rows, B]
    running_max = max_ref[...]
    new_max = jnp.maximum(running_max, scores.max(axis=1, keepdims=True))
    correction = jnp.exp(running_max - new_max)
    # Masking the weights keeps an all-masked block at zero weight (its exp would be 1).
    weights = jnp.where(visible, jnp.exp(scores - new_max), 0.0)
    max_ref[...] = new_max
    sum_ref[...] = sum_ref[...] * correction + weights.sum(axis=1, keepdims=True)
    update = jnp.dot(weights.astype(values.dtype), values, preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] * correction + update
