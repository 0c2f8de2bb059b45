"""The Pallas attention kernels against the jnp reference (the `native` backend).

TPU kernels run under `force_tpu_interpret_mode()`, GPU kernels with `interpret=True`: the same
kernel code a TPU or GPU compiles, executed on the CPU. Unused cache slots hold NaN, so a read
outside a sequence's visible keys poisons the output. Each kernel must also lower for its real
platform (Mosaic TPU / Triton), which checks what interpret mode cannot.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from sgl_jax.layers.attention.checks import check_dynamic_inputs
from sgl_jax.layers.attention.native import ragged_paged_attention_reference, write_kv
from sgl_jax.layers.attention.pallas_gpu import ragged_paged_attention_gpu
from sgl_jax.layers.attention.pallas_tpu import ragged_paged_attention_tpu
from sgl_jax.testing.attention import BATCH_MODES, TREE_PREFIX_LENS, random_problem

MODES = {
    **BATCH_MODES,
    "tree_topk1": dict(q_lens=[6, 6, 4], prefix_lens=TREE_PREFIX_LENS, tree="chain",
                       windows=True),
    "tree_topk4": dict(q_lens=[7, 7, 5], prefix_lens=TREE_PREFIX_LENS, tree="branching",
                       windows=True),
}
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}


def run_tpu(q, k_pages, v_pages, metadata, scale):
    with pltpu.force_tpu_interpret_mode():
        return ragged_paged_attention_tpu(q, k_pages, v_pages, metadata, scale=scale)


def run_gpu(q, k_pages, v_pages, metadata, scale):
    return ragged_paged_attention_gpu(q, k_pages, v_pages, metadata, scale=scale, interpret=True)


KERNELS = {"tpu": run_tpu, "gpu": run_gpu}


def check_against_reference(kernel, mode, *, page_size, gqa, dtype, head_dim=64, n_kv=2):
    rng = np.random.default_rng(hash((mode, page_size, gqa)) % 2**32)
    problem = random_problem(rng, **MODES[mode], page_size=page_size, n_heads=n_kv * gqa,
                             n_kv=n_kv, head_dim=head_dim, dtype=DTYPES[dtype])
    check_dynamic_inputs(problem.metadata, num_pages=problem.k_pages.shape[0],
                         page_size=page_size)
    layer_kv = write_kv((jnp.asarray(problem.k_pages), jnp.asarray(problem.v_pages)),
                        jnp.asarray(problem.new_k), jnp.asarray(problem.new_v),
                        problem.metadata.slot_mapping)
    q, scale = jnp.asarray(problem.q), head_dim**-0.5
    expected = ragged_paged_attention_reference(q, *layer_kv, problem.metadata, scale=scale)
    out = KERNELS[kernel](q, *layer_kv, problem.metadata, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    assert np.isfinite(out).all(), "a NaN from an unused page reached the output"
    rows = np.concatenate(problem.rows)
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(out[rows], expected[rows], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_matches_reference(kernel, mode, gqa, page_size, dtype):
    check_against_reference(kernel, mode, page_size=page_size, gqa=gqa, dtype=dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("head_dim,gqa,n_kv", [(128, 7, 1), (256, 2, 2)])
@pytest.mark.parametrize("mode", ["mixed", "tree_topk4"])
def test_large_head_dims_and_odd_groups(kernel, mode, head_dim, gqa, n_kv):
    """Qwen3-Next's head_dim 256, and Qwen2.5-7B's 7 query heads per KV head."""
    check_against_reference(kernel, mode, page_size=16, gqa=gqa, dtype="bfloat16",
                            head_dim=head_dim, n_kv=n_kv)


@pytest.mark.parametrize("head_dim,dtype,mode,page_size", [
    (64, "float32", "decode", 1),
    (128, "bfloat16", "mixed", 16),
    (256, "bfloat16", "tree_topk4", 64),
])
def test_tpu_kernel_lowers_to_mosaic(head_dim, dtype, mode, page_size):
    problem = random_problem(np.random.default_rng(0), **MODES[mode], page_size=page_size,
                             n_heads=8, n_kv=2, head_dim=head_dim, dtype=DTYPES[dtype])

    def attend(q, k_pages, v_pages, metadata):
        return ragged_paged_attention_tpu(q, k_pages, v_pages, metadata, scale=0.1)

    traced = jax.jit(attend).trace(jnp.asarray(problem.q), jnp.asarray(problem.k_pages),
                                   jnp.asarray(problem.v_pages), problem.metadata)
    assert "tpu_custom_call" in traced.lower(lowering_platforms=("tpu",)).as_text()


def test_dynamic_check_names_the_problem():
    problem = random_problem(np.random.default_rng(0), **MODES["decode"], page_size=16,
                             n_heads=2, n_kv=2, head_dim=64)
    too_long = problem.metadata.kv_lens.copy()
    too_long[0] = 10_000
    metadata = dataclasses.replace(problem.metadata, kv_lens=too_long)
    with pytest.raises(ValueError, match="kv_lens must lie"):
        check_dynamic_inputs(metadata, num_pages=problem.k_pages.shape[0], page_size=16)


def test_static_check_names_the_problem():
    problem = random_problem(np.random.default_rng(0), **MODES["decode"], page_size=16,
                             n_heads=6, n_kv=4, head_dim=64)
    with pytest.raises(ValueError, match="do not share 4 KV heads"):
        ragged_paged_attention_tpu(jnp.asarray(problem.q), jnp.asarray(problem.k_pages),
                                   jnp.asarray(problem.v_pages), problem.metadata, scale=0.1)

