"""The Pallas TPU attention kernel against the jnp reference, under TPU interpret mode: the
kernel code a TPU compiles, executed on the CPU, with NaN in every unused cache slot. Lowering
it for the 'tpu' platform runs the real Pallas -> Mosaic translation, which checks what
interpret mode cannot."""

import dataclasses
import functools

import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from sgl_jax.layers.attention.checks import check_dynamic_inputs
from sgl_jax.layers.attention.pallas_tpu import ragged_paged_attention_tpu
from sgl_jax.testing.attention import (
    KERNEL_CASES,
    KERNEL_FP8_CASES,
    KERNEL_HEAD_DIM_CASES,
    KERNEL_SLIDING_WINDOWS,
    KERNEL_WIDE_HEADS,
    assert_kernel_matches_reference,
    assert_reads_kv_pages,
    check_wide_heads,
    kernel_problem,
    lowered_text,
)


def interpreted(kernel=ragged_paged_attention_tpu):
    def run(q, k_pages, v_pages, metadata, scale, page_offset):
        with pltpu.force_tpu_interpret_mode():
            return kernel(q, k_pages, v_pages, metadata, scale=scale, page_offset=page_offset)
    return run


@pytest.mark.parametrize("mode,gqa,page_size,dtype", KERNEL_CASES)
def test_matches_reference(mode, gqa, page_size, dtype):
    problem = kernel_problem(mode, page_size=page_size, gqa=gqa, dtype=dtype)
    assert_kernel_matches_reference(interpreted(), problem, dtype=dtype)


@pytest.mark.parametrize("mode,gqa,page_size,dtype,head_dim", KERNEL_HEAD_DIM_CASES)
def test_head_dims_match_reference(mode, gqa, page_size, dtype, head_dim):
    """Head dims below a multiple of 128 lanes run unpadded: Mosaic pads them itself."""
    problem = kernel_problem(mode, page_size=page_size, gqa=gqa, dtype=dtype, head_dim=head_dim)
    assert_kernel_matches_reference(interpreted(), problem, dtype=dtype)


@pytest.mark.parametrize("mode,heads", KERNEL_WIDE_HEADS)
def test_wide_heads_and_odd_groups(mode, heads):
    check_wide_heads(interpreted(), mode, heads)


def test_several_kv_blocks_per_sequence():
    problem = kernel_problem("mixed", page_size=4, gqa=2, dtype="float32")
    kernel = functools.partial(ragged_paged_attention_tpu, kv_block_tokens=16)
    assert_kernel_matches_reference(interpreted(kernel), problem, dtype="float32")


@pytest.mark.parametrize("mode,window", KERNEL_SLIDING_WINDOWS)
def test_sliding_window_matches_reference(mode, window):
    """Rows mask keys `window` or more behind them; KV blocks wholly behind are skipped."""
    problem = kernel_problem(mode, page_size=4, gqa=2, dtype="float32")
    kernel = functools.partial(ragged_paged_attention_tpu, kv_block_tokens=16,
                               sliding_window=window)
    assert_kernel_matches_reference(interpreted(kernel), problem, dtype="float32",
                                    sliding_window=window)


@pytest.mark.parametrize("head_dim,dtype,mode,page_size", [
    (64, "float32", "decode", 1),
    (128, "bfloat16", "mixed", 16),
    (256, "bfloat16", "tree_topk4", 64),
    (80, "bfloat16", "mixed", 16),
    (96, "float32", "tree_topk1", 1),
    (96, "bfloat16", "decode", 64),
])
def test_lowers_to_mosaic(head_dim, dtype, mode, page_size):
    problem = kernel_problem(mode, page_size=page_size, gqa=4, dtype=dtype, head_dim=head_dim)
    kernel = functools.partial(ragged_paged_attention_tpu, scale=0.1)
    assert "tpu_custom_call" in lowered_text(kernel, problem, "tpu")


def test_lowers_to_mosaic_with_a_sliding_window():
    problem = kernel_problem("tree_topk1", page_size=16, gqa=4, dtype="bfloat16")
    kernel = functools.partial(ragged_paged_attention_tpu, scale=0.1, sliding_window=9)
    assert "tpu_custom_call" in lowered_text(kernel, problem, "tpu")


@pytest.mark.parametrize("mode,kv_dtype", KERNEL_FP8_CASES)
def test_reads_fp8_pages(mode, kv_dtype):
    """--kv-cache-dtype fp8: pages DMA'd as stored, cast to q's float32 when read."""
    problem = kernel_problem(mode, page_size=16, gqa=4, dtype="float32", kv_dtype=kv_dtype)
    assert_reads_kv_pages(interpreted(), problem)


def test_sliding_window_reads_fp8_pages():
    problem = kernel_problem("mixed", page_size=4, gqa=2, dtype="float32", kv_dtype="fp8_e4m3")
    kernel = functools.partial(ragged_paged_attention_tpu, kv_block_tokens=16, sliding_window=20)
    assert_reads_kv_pages(interpreted(kernel), problem, sliding_window=20)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_lowers_to_mosaic_with_fp8_pages(kv_dtype):
    problem = kernel_problem("tree_topk4", page_size=32, gqa=4, dtype="bfloat16",
                             kv_dtype=kv_dtype)
    kernel = functools.partial(ragged_paged_attention_tpu, scale=0.1)
    assert "tpu_custom_call" in lowered_text(kernel, problem, "tpu")


def test_dynamic_check_names_the_problem():
    problem = kernel_problem("decode", page_size=16, gqa=1, dtype="float32")
    too_long = problem.metadata.kv_lens.copy()
    too_long[0] = 10_000
    metadata = dataclasses.replace(problem.metadata, kv_lens=too_long)
    with pytest.raises(ValueError, match="kv_lens must lie"):
        check_dynamic_inputs(metadata, num_pages=problem.k_pages.shape[0], page_size=16)


def test_rejects_head_dim_not_a_multiple_of_8():
    problem = kernel_problem("decode", page_size=16, gqa=1, dtype="float32", head_dim=20)
    with pytest.raises(ValueError, match="head_dim 20 is not supported by this kernel: a "
                                         "multiple of 8"):
        ragged_paged_attention_tpu(jnp.asarray(problem.q), jnp.asarray(problem.k_pages),
                                   jnp.asarray(problem.v_pages), problem.metadata, scale=0.1)


def test_refuses_pages_that_do_not_hold_floats():
    problem = kernel_problem("decode", page_size=16, gqa=1, dtype="float32")
    pages = jnp.asarray(problem.k_pages).astype(jnp.int8)
    with pytest.raises(ValueError, match="the KV pages must hold floats, got int8"):
        ragged_paged_attention_tpu(jnp.asarray(problem.q), pages, pages, problem.metadata,
                                   scale=0.1)


def test_static_check_names_the_problem():
    problem = kernel_problem("decode", page_size=16, gqa=1, dtype="float32", n_kv=4)
    q = jnp.zeros((problem.q.shape[0], 6, 64))  # 6 query heads over 4 KV heads
    with pytest.raises(ValueError, match="do not share 4 KV heads"):
        ragged_paged_attention_tpu(q, jnp.asarray(problem.k_pages),
                                   jnp.asarray(problem.v_pages), problem.metadata, scale=0.1)
