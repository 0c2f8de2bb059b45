"""The Pallas GPU (Triton) attention kernel against the jnp reference with `interpret=True`:
the kernel code a GPU compiles, executed on the CPU, with NaN in every unused cache slot.
Lowering it for the 'cuda' platform runs the real Pallas -> Triton IR translation without a
GPU, so unsupported ops, non-power-of-two tensors and bad index shapes fail here too. On a GPU
the `compiled` tests run the same checks on the kernel Triton compiled
(`benchmark/gpu_suite.sh OUT kernels`)."""

import functools

import jax
import pytest

from sgl_jax.layers.attention.pallas_gpu import ragged_paged_attention_gpu
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

TRITON_CALL = "__gpu$xla.gpu.triton"


def interpreted(**tunables):
    return compiled(interpret=True, **tunables)


def compiled(**tunables):
    def run(q, k_pages, v_pages, metadata, scale, page_offset):
        return ragged_paged_attention_gpu(q, k_pages, v_pages, metadata, scale=scale,
                                          page_offset=page_offset, **tunables)
    return run


@pytest.mark.parametrize("mode,gqa,page_size,dtype", KERNEL_CASES)
def test_matches_reference(mode, gqa, page_size, dtype):
    problem = kernel_problem(mode, page_size=page_size, gqa=gqa, dtype=dtype)
    assert_kernel_matches_reference(interpreted(), problem, dtype=dtype)


@pytest.mark.parametrize("mode,gqa,page_size,dtype,head_dim", KERNEL_HEAD_DIM_CASES)
def test_head_dims_match_reference(mode, gqa, page_size, dtype, head_dim):
    """Head dims that are not powers of two run padded to one: q and the output in the
    wrapper, keys and values by masked loads from the unpadded cache."""
    problem = kernel_problem(mode, page_size=page_size, gqa=gqa, dtype=dtype, head_dim=head_dim)
    assert_kernel_matches_reference(interpreted(), problem, dtype=dtype)


@pytest.mark.parametrize("mode,heads", KERNEL_WIDE_HEADS)
def test_wide_heads_and_odd_groups(mode, heads):
    check_wide_heads(interpreted(), mode, heads)


def test_several_kv_blocks_per_sequence():
    problem = kernel_problem("mixed", page_size=4, gqa=2, dtype="float32")
    assert_kernel_matches_reference(interpreted(kv_block_tokens=16), problem, dtype="float32")


@pytest.mark.parametrize("mode,window", KERNEL_SLIDING_WINDOWS)
def test_sliding_window_matches_reference(mode, window):
    """Rows mask keys `window` or more behind them; KV blocks wholly behind are not walked."""
    problem = kernel_problem(mode, page_size=4, gqa=2, dtype="float32")
    kernel = interpreted(kv_block_tokens=16, sliding_window=window)
    assert_kernel_matches_reference(kernel, problem, dtype="float32", sliding_window=window)


@pytest.mark.parametrize("mode,kv_dtype", KERNEL_FP8_CASES)
def test_reads_fp8_pages(mode, kv_dtype):
    """--kv-cache-dtype fp8: pages loaded as stored, cast to q's float32 in registers."""
    problem = kernel_problem(mode, page_size=16, gqa=4, dtype="float32", kv_dtype=kv_dtype)
    assert_reads_kv_pages(interpreted(), problem)


def test_sliding_window_reads_fp8_pages():
    problem = kernel_problem("tree_topk1", page_size=4, gqa=2, dtype="float32",
                             kv_dtype="fp8_e5m2")
    kernel = interpreted(kv_block_tokens=16, sliding_window=9)
    assert_reads_kv_pages(kernel, problem, sliding_window=9)


on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu",
                            reason="compiles the Triton kernel: needs a GPU")


@on_gpu
@pytest.mark.parametrize("mode,gqa,page_size,dtype", KERNEL_CASES)
def test_compiled_matches_reference(mode, gqa, page_size, dtype):
    problem = kernel_problem(mode, page_size=page_size, gqa=gqa, dtype=dtype)
    assert_kernel_matches_reference(compiled(), problem, dtype=dtype)


@on_gpu
@pytest.mark.parametrize("mode,heads", KERNEL_WIDE_HEADS)
def test_compiled_wide_heads_and_odd_groups(mode, heads):
    check_wide_heads(compiled(), mode, heads)


@on_gpu
@pytest.mark.parametrize("mode,gqa,page_size,dtype,head_dim", KERNEL_HEAD_DIM_CASES)
def test_compiled_head_dims_match_reference(mode, gqa, page_size, dtype, head_dim):
    problem = kernel_problem(mode, page_size=page_size, gqa=gqa, dtype=dtype, head_dim=head_dim)
    assert_kernel_matches_reference(compiled(), problem, dtype=dtype)


@on_gpu
@pytest.mark.parametrize("mode,kv_dtype", KERNEL_FP8_CASES)
def test_compiled_reads_fp8_pages(mode, kv_dtype):
    problem = kernel_problem(mode, page_size=16, gqa=4, dtype="float32", kv_dtype=kv_dtype)
    assert_reads_kv_pages(compiled(), problem)


def lower_for_cuda(problem, **tunables) -> str:
    kernel = functools.partial(ragged_paged_attention_gpu, scale=0.125, **tunables)
    return lowered_text(kernel, problem, "cuda")


@pytest.mark.parametrize("mode,head_dim,dtype,page_size,gqa", [
    ("mixed", 64, "float32", 16, 1),
    ("decode", 128, "bfloat16", 1, 7),  # 7 query heads per KV head: rows padded to 16
    ("prefill", 256, "bfloat16", 16, 1),
    ("tree_topk4", 128, "float32", 1, 1),  # tree windows of 7 tokens
    ("tree_topk1", 64, "bfloat16", 16, 7),  # 42 rows padded to 64
    ("tree_topk4", 256, "float32", 16, 7),
    ("mixed", 80, "bfloat16", 16, 4),  # padded to 128: masked loads over 80 cache columns
    ("tree_topk4", 96, "float32", 1, 7),
    ("decode", 96, "bfloat16", 64, 1),
])
def test_lowers_to_triton(mode, head_dim, dtype, page_size, gqa):
    problem = kernel_problem(mode, page_size=page_size, gqa=gqa, dtype=dtype, head_dim=head_dim)
    assert TRITON_CALL in lower_for_cuda(problem)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_lowers_to_triton_with_fp8_pages(kv_dtype):
    """Masked fp8 loads (their `other` a float: Triton casts no integer to fp8) and the casts."""
    problem = kernel_problem("tree_topk4", page_size=16, gqa=4, dtype="bfloat16",
                             kv_dtype=kv_dtype)
    assert TRITON_CALL in lower_for_cuda(problem)


def test_lowers_with_other_tunables():
    problem = kernel_problem("mixed", page_size=16, gqa=4, dtype="bfloat16")
    assert TRITON_CALL in lower_for_cuda(problem, kv_block_tokens=16, num_warps=8,
                                         num_stages=3, sliding_window=20)


@pytest.mark.parametrize("head_dim,kv_block_tokens,message", [
    (20, 64, "head_dim 20 is not supported by this kernel: a multiple of 8"),
    (36, 64, "head_dim 36 is not supported by this kernel: a multiple of 8"),
    (64, 48, "kv_block_tokens must be a power of two >= 16, got 48"),
    (64, 8, "kv_block_tokens must be a power of two >= 16, got 8"),
])
def test_rejects_shapes_triton_cannot_tile(head_dim, kv_block_tokens, message):
    problem = kernel_problem("decode", page_size=16, gqa=1, dtype="float32", head_dim=head_dim)
    with pytest.raises(ValueError, match=message):
        lower_for_cuda(problem, kv_block_tokens=kv_block_tokens)
