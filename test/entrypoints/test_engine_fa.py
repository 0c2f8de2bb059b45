"""`--attention-backend fa` through the Engine gives the same greedy tokens as `native`.

On a CPU `fa` runs the Triton kernel in Pallas interpret mode, with and without speculation; one
case swaps in the TPU kernel under TPU interpret mode, so both kernels drive a real model.
"""

import json

import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import sgl_jax.layers.attention.flash as flash
from sgl_jax import Engine
from sgl_jax.layers.attention.pallas_tpu import ragged_paged_attention_tpu
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft

BASE = dict(dtype="float32", precompile_token_paddings=[16, 64, 128], precompile_bs_paddings=[1, 4],
            max_prefill_tokens=128, chunked_prefill_size=48, skip_server_warmup=True,
            max_total_tokens=1024)
LENGTHS, MAX_NEW = [3, 70, 12, 30], [10, 6, 12, 8]  # 70 takes two prefill chunks
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=3, speculative_num_draft_tokens=8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fa")
    out = {}
    for preset in ("llama", "qwen3"):
        target = write_tiny_checkpoint(root / preset, preset)
        config = json.loads((target / "config.json").read_text())
        out[preset] = (target, write_tiny_eagle3_draft(root / f"{preset}-eagle3", config))
    return out


def generate(target, draft=None, spec=None, **args):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in LENGTHS]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in MAX_NEW]
    if draft is not None:
        args.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                    **spec)
    with Engine(model_path=str(target), **BASE, **args) as engine:
        assert engine.server_args.attention_backend == args.get("attention_backend", "native")
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in outputs]


@pytest.fixture(scope="module")
def native_tokens(checkpoints):
    """Plain greedy decoding with the jnp reference; speculation must not change it either."""
    return {(preset, page_size): generate(checkpoints[preset][0], page_size=page_size)
            for preset, page_size in (("llama", 16), ("qwen3", 1), ("qwen3", 16))}


@pytest.mark.parametrize("preset,page_size,spec", [
    ("llama", 16, None), ("qwen3", 1, None), ("llama", 16, TREE), ("qwen3", 16, CHAIN),
])
def test_fa_gives_the_native_greedy_tokens(checkpoints, native_tokens, preset, page_size, spec):
    target, draft = checkpoints[preset]
    tokens = generate(target, draft if spec else None, spec, page_size=page_size,
                      attention_backend="fa")
    assert tokens == native_tokens[preset, page_size]


@pytest.fixture
def tpu_kernel_interpreted(monkeypatch):
    """`fa` on the TPU kernel, interpreted on every thread (the engine runs on its own)."""
    monkeypatch.setattr(flash, "platform_kernel", lambda platform: ragged_paged_attention_tpu)
    pltpu.set_tpu_interpret_mode()
    yield
    pltpu.set_tpu_interpret_mode(None)


@pytest.mark.usefixtures("tpu_kernel_interpreted")
def test_tpu_kernel_gives_the_native_greedy_tokens(checkpoints, native_tokens):
    tokens = generate(checkpoints["llama"][0], page_size=16, attention_backend="fa")
    assert tokens == native_tokens["llama", 16]
