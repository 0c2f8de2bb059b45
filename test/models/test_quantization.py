"""8-bit weights: per-channel int8 / fp8 quantization at load and block-wise FP8 checkpoints
(as Qwen's *-FP8 are written), against references written here and transformers on the
float (or dequantized) checkpoint; speculative decoding over quantized targets and drafts;
the start-up refusals."""

import json
import logging
import re
import tracemalloc
import urllib.request

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sgl_jax import Engine, launch_server
from sgl_jax.layers.linear import matmul_rows
from sgl_jax.layers.moe import grouped_matmul
from sgl_jax.layers.quantization import (
    QuantizedWeight,
    quantize,
    quantize_param,
    quantized_params,
)
from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models.loader import (
    CheckpointError,
    fp8_scale_specs,
    load_model,
    load_nextn_draft,
    open_checkpoint,
    read_hf_config,
)
from sgl_jax.models.registry import get_model_impl
from sgl_jax.server_args import ServerArgs
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft
from sgl_jax.testing.fp8 import dequantize_blocks, quantize_blocks, write_fp8_checkpoint
from sgl_jax.testing.mtp import write_mtp_tensors
from sgl_jax.testing.server import launch_server as start_server
from sgl_jax.testing.server import openai_client

ENGINE = dict(dtype="float32", skip_server_warmup=True, precompile_token_paddings=[64],
              precompile_bs_paddings=[4], max_prefill_tokens=64, chunked_prefill_size=48)
BLOCK = (64, 64)  # the tiny models' widths are 64-256: up to 4 blocks per matrix
# Wider experts than the preset's: the FP8 test weighs the loader's host arrays against the
# file, and the preset's are so small that Python's own allocations while loading count.
WIDE_EXPERTS = dict(moe_intermediate_size=256, num_experts=16)
FP8_TYPE = np.dtype(ml_dtypes.float8_e4m3fn)


def rng_weight(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in (7, 30, 19)]


def mean_kl(reference: np.ndarray, other: np.ndarray) -> float:
    """Mean over rows of KL(reference || other) between the logits' distributions."""
    p = jax.nn.log_softmax(jnp.asarray(reference, jnp.float32))
    q = jax.nn.log_softmax(jnp.asarray(other, jnp.float32))
    return float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), axis=-1)))


def our_logits(model, seqs: list[list[int]]) -> np.ndarray:
    """Every position's logits of one prefill of `seqs` (hybrid models: a state slot each)."""
    hybrid = model.config.is_hybrid
    runner = ModelRunner(model, num_pages=64, page_size=16,
                         num_state_slots=len(seqs) + 1 if hybrid else 0)
    chunks, next_page = [], 1
    for slot, ids in enumerate(seqs, start=1):
        count = -(-len(ids) // 16)
        chunks.append(SeqChunk(ids, 0, list(range(next_page, next_page + count)),
                               **({"state_slot": slot} if hybrid else {})))
        next_page += count
    return np.asarray(runner.forward(chunks, all_logits=True)[0])


def transformers_logits(path, seqs: list[list[int]]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return np.concatenate([model(torch.tensor([ids])).logits[0].numpy() for ids in seqs])


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    wide = write_tiny_checkpoint(root / "float", "qwen3_moe", **WIDE_EXPERTS)
    return write_fp8_checkpoint(wide, root / "fp8", root / "dequantized", block=BLOCK)


# ---------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_per_channel_quantization_rounds_each_row_on_its_own_scale(fmt):
    w = rng_weight(6, 40) * np.linspace(0.01, 10, 6)[:, None]  # rows of very different sizes
    q = quantize(w, fmt)
    assert q.scales.shape == (6, 1) and q.values.shape == w.shape
    largest = 127.0 if fmt == "int8" else 448.0
    np.testing.assert_allclose(q.scales[:, 0], np.abs(w).max(axis=1) / largest, rtol=1e-6)
    if fmt == "int8":
        assert q.values.dtype == np.int8
        expected = np.clip(np.rint(w / q.scales), -127, 127)
    else:
        assert q.values.dtype == FP8_TYPE
        expected = (w / q.scales).astype(FP8_TYPE).astype(np.float32)
    np.testing.assert_array_equal(q.values.astype(np.float32), expected)


@pytest.mark.parametrize("blocks", [1, 4])
def test_products_equal_the_dequantized_matrix_product(blocks):
    """matmul_rows over fused out axes and grouped_matmul per expert, with one scale per row
    (quantized here) and with block scales (an FP8 checkpoint's), against numpy on the
    dequantized float weights."""
    x = rng_weight(5, 64, seed=1)
    w = rng_weight(3, 2, 64, seed=2)  # [*out, in], fused out axes
    if blocks == 1:
        q = quantize(w, "fp8")
    else:
        values, scales = quantize_blocks(w.reshape(6, 64), (1, 64 // blocks))
        q = QuantizedWeight(values.reshape(3, 2, 64), scales.reshape(3, 2, blocks), np.float32)
    dense = (q.values.astype(np.float32).reshape(3, 2, blocks, -1)
             * q.scales[..., None]).reshape(w.shape)
    np.testing.assert_allclose(np.asarray(matmul_rows(jnp.asarray(x), jax.tree.map(
        jnp.asarray, q))), np.einsum("ti,abi->tab", x, dense), rtol=1e-5, atol=1e-4)
    experts = q.reshape(3, 2, 64)  # 3 experts of 2 outputs
    sizes = np.array([2, 0, 3], np.int32)
    expected = np.concatenate([x[:2] @ dense[0].T, x[2:] @ dense[2].T])
    np.testing.assert_allclose(np.asarray(grouped_matmul(jnp.asarray(x), jax.tree.map(
        jnp.asarray, experts), jnp.asarray(sizes))), expected, rtol=1e-5, atol=1e-4)


def test_w8a8_products_round_each_input_row_to_int8():
    """w8a8_int8: each token's input row is rounded to int8 on its own symmetric scale and
    the integer product is exact; against numpy on the rounded integers (the reference
    rounding written here), for matmul_rows and per expert for grouped_matmul."""
    x = rng_weight(5, 64, seed=1) * np.array([0.01, 1, 30, 0, 2])[:, None]  # a row of zeros
    w = rng_weight(6, 64, seed=2)
    q = quantize_param("w_o", w, "w8a8_int8")
    assert q.int8_inputs and q.values.dtype == np.int8
    x_scales = np.abs(x).max(axis=1, keepdims=True) / 127
    x_scales[x_scales == 0] = 1
    x_int = np.clip(np.rint(x / x_scales), -127, 127)
    w_float = q.values.astype(np.float64) * q.scales
    expected = (x_int @ q.values.astype(np.float64).T) * x_scales * q.scales[:, 0]
    assert np.abs(expected - x @ w_float.T).max() > 1e-3  # the inputs' rounding shows
    device_q = jax.tree.map(jnp.asarray, q)
    np.testing.assert_allclose(np.asarray(matmul_rows(jnp.asarray(x), device_q)), expected,
                               rtol=1e-5, atol=1e-5)
    experts = device_q.reshape(3, 2, 64)
    sizes = jnp.asarray([2, 0, 3], jnp.int32)
    np.testing.assert_allclose(np.asarray(grouped_matmul(jnp.asarray(x), experts, sizes)),
                               np.concatenate([expected[:2, 0:2], expected[2:, 4:6]]),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("fmt,most_kl", [("int8", 0.02), ("w8a8_int8", 0.03), ("fp8", 0.06)])
def test_quantized_moe_keeps_projections_in_8_bits_and_the_logits_close(moe, fmt, most_kl):
    """Every projection (attention, experts, shared expert) is 8-bit with one scale per
    output row, the token tables too with int8; norms and the router stay float32;
    next-token distributions stay close to transformers' on the float checkpoint."""
    model = load_model(str(moe), dtype="float32", progress=False, quantization=fmt)
    layer = model.params["layers"][0]
    quantized = {name for name, p in layer.items() if isinstance(p, QuantizedWeight)}
    assert quantized == set(layer) & quantized_params(fmt)
    assert {"w_qkv", "w_o", "w_expert_gate_up", "w_expert_down"} <= quantized
    stored = layer["w_expert_down"]
    assert stored.values.dtype == (FP8_TYPE if fmt == "fp8" else np.int8)
    assert stored.scales.shape == (*stored.shape[:-1], 1)
    assert stored.int8_inputs == (fmt == "w8a8_int8")
    assert isinstance(model.params["embed"], QuantizedWeight) == (fmt != "fp8")
    assert not (fmt != "fp8" and model.params["lm_head"].int8_inputs)
    assert model.params["embed"].dtype == jnp.float32 == layer["w_router"].dtype
    ours = our_logits(model, prompts())
    reference = transformers_logits(moe, prompts())
    # Gaussian random weights have no outliers, where e4m3's 3 mantissa bits lose more than
    # int8's 127 steps per row (measured: int8 0.003, w8a8_int8 0.005, fp8 0.026); a
    # misapplied scale gives KL above 1.
    assert mean_kl(reference, ours) < most_kl


def test_fp8_checkpoint_loads_as_stored_and_gives_its_dequantized_logits(fp8_moe):
    """Qwen's FP8 layout (block scales, config's quantization_config) loads without
    --quantization: the values are the file's e4m3 bytes, the scales its blocks, and the
    logits transformers' on the dequantized float32 copy; the loader's host arrays peak
    under 1.3x of the checkpoint's bytes."""
    fp8_dir, dequantized = fp8_moe
    tracemalloc.start()
    model = load_model(str(fp8_dir), dtype="float32", progress=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stored = sum(p.stat().st_size for p in fp8_dir.glob("*.safetensors"))
    assert peak < 1.3 * stored, (peak, stored)
    w_o = model.params["layers"][1]["w_o"]
    assert w_o.values.dtype == FP8_TYPE and w_o.num_blocks == w_o.shape[-1] // BLOCK[1]
    reference = transformers_logits(dequantized, prompts())
    np.testing.assert_allclose(our_logits(model, prompts()), reference, atol=1e-4, rtol=1e-4)


def test_a_hybrid_fp8_checkpoint_with_its_mtp_module(tmp_path):
    """Qwen3-Next's FP8 layout: the Gated DeltaNet projections (fused q|k|v|z and b|a rows
    per key head) and the MTP module's are block-scaled too; the logits are transformers' on
    the dequantized copy, and NEXTN's module loads in FP8."""
    source = write_tiny_checkpoint(tmp_path / "float", "qwen3_next")
    write_mtp_tensors(source)
    fp8_dir, dequantized = write_fp8_checkpoint(source, tmp_path / "fp8", tmp_path / "dq",
                                                block=(32, 32))
    model = load_model(str(fp8_dir), dtype="float32", progress=False)
    linear = model.params["layers"][0]["linear_attn"]
    assert isinstance(linear["w_in"], QuantizedWeight) and linear["w_in"].num_blocks == 2
    reference = transformers_logits(dequantized, prompts())
    # test_qwen3_next's float32 tolerance (transformers' chunked delta rule sums differently)
    np.testing.assert_allclose(our_logits(model, prompts()), reference, atol=3e-3, rtol=1e-3)
    mtp = load_nextn_draft(str(fp8_dir), model.config, dtype=jnp.float32, progress=False)
    assert mtp.params["layers"][0]["w_qkv"].values.dtype == FP8_TYPE


def test_block_helpers_round_trip_the_scales():
    w = rng_weight(70, 96, seed=3)  # 70 rows: the last block of rows is partial
    values, scales = quantize_blocks(w, (32, 32))
    assert scales.shape == (3, 3)
    back = dequantize_blocks(values, scales, (32, 32))
    assert np.abs(back - w).max() <= np.abs(w).max() * 2**-4


# ---------------------------------------------------------------- engine, speculation


@pytest.fixture(scope="module")
def draft(moe, tmp_path_factory):
    config = json.loads((moe / "config.json").read_text())
    return write_tiny_eagle3_draft(tmp_path_factory.mktemp("eagle3"), config)


@pytest.mark.parametrize("fmt", ["int8", "w8a8_int8"])
def test_speculation_over_quantized_weights_equals_plain_decoding(moe, draft, fmt):
    """An EAGLE3 tree over an 8-bit target, its draft quantized as the target is (the
    default): the greedy output equals plain decoding's with the same target weights (with
    w8a8_int8, each token's inputs are rounded on its own scale, whatever the batch)."""
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(model_path=str(moe), quantization=fmt, **ENGINE) as engine:
        plain = engine.generate(input_ids=prompts(), sampling_params=[greedy] * 3)
    with Engine(model_path=str(moe), quantization=fmt, speculative_algorithm="EAGLE3",
                speculative_draft_model_path=str(draft), speculative_num_steps=2,
                speculative_eagle_topk=2, speculative_num_draft_tokens=4, **ENGINE) as engine:
        head = engine.runtime.spec_runner.drafter.draft
        assert isinstance(head.params["layer"]["fc"], QuantizedWeight)
        speculative = engine.generate(input_ids=prompts(), sampling_params=[greedy] * 3)
    assert [o["output_ids"] for o in speculative] == [o["output_ids"] for o in plain]


@pytest.mark.parametrize("target,flag,expected", [
    (None, None, None), ("int8", None, "int8"), ("fp8", "unquant", None),
    (None, "int8", "int8"), ("int8", "fp8", "fp8"), ("w8a8_int8", None, "w8a8_int8")])
def test_the_draft_format_follows_the_target_unless_the_flag_says(target, flag, expected):
    args = ServerArgs(model_path="m", quantization=target, speculative_algorithm="EAGLE3",
                      speculative_draft_model_path="d",
                      speculative_draft_model_quantization=flag)
    assert args.speculative.draft_quantization == expected


def test_a_draft_format_without_a_draft_model_is_refused():
    with pytest.raises(ValueError, match="speculative_draft_model_quantization .* no draft"):
        ServerArgs(model_path="m", speculative_algorithm="NGRAM",
                   speculative_draft_model_quantization="int8")


# ---------------------------------------------------------------- refusals


def test_an_fp8_checkpoint_refuses_int8_in_one_cannot_start_line(fp8_moe, caplog):
    caplog.set_level(logging.ERROR)
    argv = ["--model-path", str(fp8_moe[0]), "--quantization", "int8", "--dtype", "float32"]
    assert launch_server.main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert re.match(r"cannot start: the model in .* is an FP8 checkpoint .*--quantization int8 "
                    r"does not apply to it: leave --quantization out or pass fp8$", errors[0])


def test_a_tp_split_that_cuts_fp8_blocks_names_the_sizes_that_work(fp8_moe):
    """o_proj's 128 input features split 4 ways are 32 wide, cutting the 64-wide blocks:
    refused from the specs and file names, before any tensor is read."""
    fp8_dir = fp8_moe[0]
    checkpoint = open_checkpoint(str(fp8_dir))
    impl = get_model_impl(read_hf_config(fp8_dir))
    config = impl.config_from_hf(read_hf_config(fp8_dir))
    names = checkpoint.tensors.names()
    specs = impl.hf_weight_specs(config, names)
    assert len(fp8_scale_specs(specs, names, BLOCK, 2, "it")) == sum(
        n.endswith("_scale_inv") for n in names)
    with pytest.raises(CheckpointError, match=r"--tp-size 4 splits the 128 input "
                       r"features of .*o_proj.weight into 32-wide shards, .* here: 1"):
        fp8_scale_specs(specs, names, BLOCK, 4, "it")
    # k_proj left in float beside an FP8 q_proj and v_proj: one fused parameter, refused.
    k_scale = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    with pytest.raises(CheckpointError, match=r"^model.layers.1.self_attn.k_proj.weight is "
                       "not FP8, but this version fuses"):
        fp8_scale_specs(specs, [n for n in names if n != k_scale], BLOCK, 1, "it")


def test_the_flags_through_launch_server_and_the_openai_client(fp8_moe):
    """The FP8 checkpoint with FP8 KV pages served by launch_server: the official openai
    client's greedy completion is the offline Engine's with the same settings, and server
    info reports what the weights and pages are."""
    flags = dict(dtype="float32", kv_cache_dtype="fp8_e4m3", skip_server_warmup=True,
                 precompile_token_paddings=[64], precompile_bs_paddings=[1])
    prompt = "The weights are stored in eight bits"
    with Engine(model_path=str(fp8_moe[0]), **flags) as engine:
        offline = engine.generate(prompt=prompt, sampling_params={"temperature": 0,
                                                                  "max_new_tokens": 12})
    argv = ["--model-path", str(fp8_moe[0]), "--served-model-name", "fp8"]
    for name, value in flags.items():
        value = " ".join(map(str, value)) if isinstance(value, list) else value
        argv += [f"--{name.replace('_', '-')}", *([] if value is True else str(value).split())]
    with start_server(argv) as server:
        completion = openai_client(server).completions.create(
            model="fp8", prompt=prompt, max_tokens=12, temperature=0)
        with urllib.request.urlopen(f"{server.base_url}/get_server_info") as response:
            info = json.loads(response.read())
    assert completion.choices[0].text == offline["text"]
    assert info["kv_pages_dtype"] == "float8_e4m3fn" and info["weights_format"] == "fp8"
