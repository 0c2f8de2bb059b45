"""The Pallas Triton attention kernel lowers to a Triton custom call, checked without a GPU.

Lowering for the "cuda" platform runs the real Pallas -> Triton IR translation on any host, so
unsupported ops, non-power-of-two tensors and bad index shapes fail here. Numerics are covered
by the interpret-mode tests in test_attention_kernels.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.layers.attention.pallas_gpu import ragged_paged_attention_gpu
from sgl_jax.testing.attention import BATCH_MODES, TREE_PREFIX_LENS, random_problem

TRITON_CALL = "__gpu$xla.gpu.triton"


def make_problem(mode, *, page_size, gqa, head_dim, dtype):
    if mode in ("chain", "branching"):
        shape = dict(q_lens=[7, 7, 5], prefix_lens=TREE_PREFIX_LENS, tree=mode, windows=True)
    else:
        shape = BATCH_MODES[mode]
    return random_problem(np.random.default_rng(0), **shape, page_size=page_size,
                          n_heads=2 * gqa, n_kv=2, head_dim=head_dim, dtype=dtype)


def lower_for_cuda(problem, **tunables) -> str:
    fn = functools.partial(ragged_paged_attention_gpu, scale=0.125, **tunables)
    args = (jnp.asarray(problem.q), jnp.asarray(problem.k_pages), jnp.asarray(problem.v_pages),
            problem.metadata)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "mode,head_dim,dtype,page_size,gqa",
    [
        ("mixed", 64, np.float32, 16, 1),
        ("decode", 128, jnp.bfloat16, 1, 7),  # 7 query heads per KV head: rows padded to 16
        ("prefill", 256, jnp.bfloat16, 16, 1),
        ("branching", 128, np.float32, 1, 1),  # tree windows of 7 tokens
        ("chain", 64, jnp.bfloat16, 16, 7),  # 49 rows padded to 64
        ("branching", 256, np.float32, 16, 7),
    ],
)
def test_lowers_to_triton(mode, head_dim, dtype, page_size, gqa):
    problem = make_problem(mode, page_size=page_size, gqa=gqa, head_dim=head_dim, dtype=dtype)
    assert TRITON_CALL in lower_for_cuda(problem)


def test_lowers_with_other_tunables():
    problem = make_problem("mixed", page_size=16, gqa=4, head_dim=64, dtype=jnp.bfloat16)
    text = lower_for_cuda(problem, kv_block_tokens=16, num_warps=8, num_stages=3)
    assert TRITON_CALL in text


@pytest.mark.parametrize("head_dim,kv_block_tokens", [(24, 64), (8, 64), (64, 48), (64, 8)])
def test_rejects_shapes_triton_cannot_tile(head_dim, kv_block_tokens):
    problem = make_problem("decode", page_size=16, gqa=1, head_dim=head_dim, dtype=np.float32)
    with pytest.raises(ValueError, match="power of two"):
        lower_for_cuda(problem, kv_block_tokens=kv_block_tokens)
