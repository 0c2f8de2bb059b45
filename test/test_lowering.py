"""TPU and GPU readiness on a CPU: every program an Engine compiles at its accelerator warm-up
(each prefill and decode bucket, every round shape the adaptive policy may take, packed
rounds of per-request lengths included, the grammar-masked `draft_trees` /
`masked_verify`, the catch-up, the sampler with its bitmask) lowers for TPU and for CUDA in
bfloat16 with the `fa` backend's own Pallas kernel of the platform (Mosaic, Triton; not
interpret mode), for every drafter. How the programs are found
and lowered: sgl_jax/testing/lowering.py; the same at TP 4: parallel/test_lowering_tp.py."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import pytest

from sgl_jax.layers.attention.pallas_gpu import ragged_paged_attention_gpu
from sgl_jax.speculative.spec_config import TreeShape
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.attention import kernel_problem
from sgl_jax.testing.dspark import write_tiny_dspark_draft
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft, write_tiny_eagle_draft
from sgl_jax.testing.lowering import (
    KERNEL_CALLS,
    Program,
    failures,
    lower_all,
    lower_program,
    record_engine_programs,
    resharded,
)
from sgl_jax.testing.mtp import write_mtp_tensors

# One bucket of each kind: a decode batch of 2, an extend batch of 16 tokens.
SETTINGS = dict(precompile_token_paddings=[16], precompile_bs_paddings=[2],
                max_prefill_tokens=16, chunked_prefill_size=16, max_total_tokens=256)
# Per-request lengths on: the chain 2/1/3 among the policy's shapes adds its packed round.
TREE = dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4,
            speculative_per_request_lengths=True)
# name: (target, draft checkpoint or None, Engine arguments)
DRAFTERS = {
    "plain": ("llama", None, {}),
    "EAGLE3": ("llama", "eagle3", TREE),
    "EAGLE": ("llama", "eagle", TREE),
    "STANDALONE": ("llama", "llama", TREE),
    "NGRAM": ("llama", None, TREE),
    # DSPARK runs DFlash's backbone programs (context keys, the block, the catch-up) and
    # its own heads, so it stands for DFLASH too (whose tree is jnp top-k over positions).
    "DSPARK": ("llama", "dspark", TREE),
    "NEXTN": ("qwen3_next", None, TREE),  # the target's own MTP layer
}
# Engine variants and the drafters each runs with (bf16: every drafter). The plain engine's
# decode step holds every linear layer, so it lowers each weight format; a speculative one
# adds a quantized draft head (w8a8 stands for int8 and fp8 weights: one per-channel product
# for all three) and the round's writes of fp8 pages. Another variant is one more line here.
VARIANTS = {
    "bf16": ({}, tuple(DRAFTERS)),
    "int8": (dict(quantization="int8"), ("plain",)),
    "w8a8": (dict(quantization="w8a8_int8"), ("plain", "EAGLE3")),
    "fp8": (dict(quantization="fp8"), ("plain",)),
    "fp8-kv": (dict(kv_cache_dtype="fp8_e4m3"), ("plain", "EAGLE3")),
}
CASES = [(drafter, variant) for variant, (_, drafters) in VARIANTS.items()
         for drafter in drafters]
PLAIN_PROGRAMS = {"ModelRunner._sampling_step_impl", "ModelRunner._reset_slots_impl"}
TARGET_FORWARDS = {"ModelRunner._sampling_step_impl", "SpecRunner._prefill_impl",
                   "SpecRunner._round_impl", "SpecRunner._masked_verify_impl"}
SPEC_PROGRAMS = {"SpecRunner._prefill_impl", "SpecRunner._round_impl",
                 "SpecRunner._draft_trees_impl", "SpecRunner._masked_verify_impl"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowering")
    llama = write_tiny_checkpoint(root / "llama", "llama")
    config = json.loads((llama / "config.json").read_text())
    qwen3_next = write_tiny_checkpoint(root / "qwen3_next", "qwen3_next")
    write_mtp_tensors(qwen3_next)
    return {"llama": llama, "qwen3_next": qwen3_next,
            "eagle3": write_tiny_eagle3_draft(root / "eagle3", config),
            "eagle": write_tiny_eagle_draft(root / "eagle", config),
            "dspark": write_tiny_dspark_draft(root / "dspark", config, markov_head="rnn")}


@pytest.mark.parametrize("drafter,variant", CASES, ids=[f"{d}-{v}" for d, v in CASES])
def test_every_program_lowers_for_tpu_and_cuda(checkpoints, drafter, variant):
    target, draft, extra = DRAFTERS[drafter]
    engine = {**SETTINGS, **VARIANTS[variant][0], **extra}
    if drafter != "plain":
        engine["speculative_algorithm"] = drafter
    if draft is not None:
        engine["speculative_draft_model_path"] = str(checkpoints[draft])
    programs = record_engine_programs(str(checkpoints[target]), **engine)

    recorded = {p.function for p in programs}
    assert (SPEC_PROGRAMS if drafter != "plain" else PLAIN_PROGRAMS) <= recorded, recorded
    packed = [p for p in programs if getattr(p.fun, "keywords", {}).get(
        "shape", TreeShape(0, 1, 1)).verify_width]
    # every drafter's packed rounds lower, a hybrid target's (NEXTN) included
    assert bool(packed) == (drafter != "plain"), [p.name for p in programs]
    assert not resharded(programs)
    outcomes = lower_all(programs)
    assert not failures(outcomes), failures(outcomes)
    # lower_program checks that a program with a Pallas kernel calls the platform's; these
    # run the target's forward, so they must have one (the `fa` backend, not `native`).
    assert all(o.kernel_calls for o in outcomes if o.function in TARGET_FORWARDS)


def test_a_kernel_that_ignores_the_lowering_platform_is_caught():
    """A program that runs the interpreted kernel lowers (to loops), but not to the platform's
    kernel: lower_program refuses it."""
    problem = kernel_problem("decode", page_size=16, gqa=2, dtype="bfloat16")
    interpreted = functools.partial(ragged_paged_attention_gpu, interpret=True, scale=0.1)
    args = (jnp.asarray(problem.q), jnp.asarray(problem.k_pages), jnp.asarray(problem.v_pages),
            problem.metadata)
    program = Program("interpreted #0", "interpreted", interpreted, {},
                      jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args), {})
    for platform in KERNEL_CALLS:
        with pytest.raises(AssertionError, match=re.escape(KERNEL_CALLS[platform])):
            lower_program(program, platform)
