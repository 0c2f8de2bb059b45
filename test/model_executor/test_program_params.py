"""ProgramParams: the parameters a program takes in few arguments, given back whole inside it."""

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.model_executor.program_params import ProgramParams


def _params(rng: np.random.Generator) -> dict:
    def array(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    layers = [{"input_norm": array(8), "post_norm": array(8), "w_qkv": array(8, 24),
               "q_norm": array(4)} for _ in range(3)]
    return {"embed": array(16, 8), "layers": layers, "final_norm": array(8),
            "bias": array(5)}


def test_a_program_sees_the_parameters_it_was_given():
    params = _params(np.random.default_rng(0))
    packed = ProgramParams(params)
    rebuilt = jax.jit(packed.unstack)(packed.arrays)
    assert jax.tree.structure(rebuilt) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_vectors_of_one_shape_become_one_argument():
    packed = ProgramParams(_params(np.random.default_rng(1)))
    kept, stacks = packed.arrays
    # seven [8] norms stacked, three [4] q norms stacked; the matrices and the lone [5]
    # vector are passed as they are
    assert sorted(s.shape for s in stacks) == [(3, 4), (7, 8)]
    assert sorted(k.shape for k in kept) == [(5,), (8, 24), (8, 24), (8, 24), (16, 8)]
