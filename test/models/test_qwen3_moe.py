"""Qwen3-MoE against transformers (PyTorch, CPU, float32) on tiny random checkpoints: 8 experts,
top 2 renormalised, layer 1 dense. Both expert spellings load; TP 1, 2 and 4 and EAGLE3
speculation (chain and tree) give the plain greedy output."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

from sgl_jax import Engine
from sgl_jax.layers.weights import checkpoint_tensors
from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models import qwen3_moe
from sgl_jax.models.config import tensor_parallel_problems
from sgl_jax.models.loader import load_model
from sgl_jax.models.registry import supported_architectures
from sgl_jax.testing import tiny_config, write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft
from sgl_jax.testing.parallel import run_subprocess, transformers_greedy

ATOL = 1e-4
PROMPT_LENS = [7, 45, 20]
ENGINE = dict(dtype="float32", skip_server_warmup=True, precompile_token_paddings=[64],
              precompile_bs_paddings=[4], max_prefill_tokens=64, chunked_prefill_size=48)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, reference, load_model(str(path), dtype="float32", progress=False)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in PROMPT_LENS]


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def prefill_logits(model, seqs: list[list[int]], page_size: int = 16) -> np.ndarray:
    runner = ModelRunner(model, num_pages=256, page_size=page_size)
    chunks, next_page = [], 1
    for ids in seqs:
        count = -(-len(ids) // page_size)
        chunks.append(SeqChunk(ids, 0, list(range(next_page, next_page + count))))
        next_page += count
    return runner.forward(chunks, all_logits=True)[0]


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("step,mlp_only", [(1, [1]), (2, []), (2, [3]), (1, [])])
def test_moe_layers_are_the_ones_transformers_builds(step, mlp_only):
    hf = tiny_config("qwen3_moe", decoder_sparse_step=step, mlp_only_layers=mlp_only,
                     num_hidden_layers=4)
    reference = AutoModelForCausalLM.from_config(hf)
    config = qwen3_moe.config_from_hf(hf.to_dict())
    built = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
             for layer in reference.model.layers]
    assert [config.is_moe_layer(i) for i in range(4)] == built
    assert config.has_dense_mlp == (not all(built))


def test_config_reads_both_spellings_of_the_expert_count():
    hf = tiny_config("qwen3_moe").to_dict()
    saved = hf | {"num_local_experts": hf.pop("num_experts", None) or 8}  # transformers 5
    hub = {k: v for k, v in saved.items() if k != "num_local_experts"} | {"num_experts": 8}
    for spelling in (saved, hub):
        config = qwen3_moe.config_from_hf(spelling)
        assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
        assert (config.moe_intermediate_size, config.norm_topk_prob) == (32, True)
        assert config.mlp_only_layers == (1,) and config.qk_norm
    assert "Qwen3MoeForCausalLM" in supported_architectures()
    hash(config)  # jitted functions close over it


def test_tp_names_an_expert_width_that_does_not_divide():
    config = qwen3_moe.config_from_hf(tiny_config("qwen3_moe", moe_intermediate_size=30).to_dict())
    assert tensor_parallel_problems(config, 4) == [
        "expert intermediate size 30 does not divide by 4"]
    assert tensor_parallel_problems(config, 2) == []
    # no layer is dense: the unused intermediate_size need not divide
    config = qwen3_moe.config_from_hf(
        tiny_config("qwen3_moe", mlp_only_layers=[], intermediate_size=30).to_dict())
    assert tensor_parallel_problems(config, 4) == []


# --------------------------------------------------------------------------- weights


def test_loaded_params_hold_experts_only_in_moe_layers(checkpoint):
    _, _, model = checkpoint
    config, layers = model.config, model.params["layers"]
    for i, layer in enumerate(layers):
        if config.is_moe_layer(i):
            assert layer["w_router"].shape == (8, 64)
            assert layer["w_expert_gate_up"].shape == (8, 32, 2, 64)
            assert layer["w_expert_down"].shape == (8, 64, 32)
            assert "w_gate_up" not in layer
        else:
            assert layer["w_gate_up"].shape == (128, 2, 64) and "w_router" not in layer


def test_checkpoint_tensors_give_back_the_file(checkpoint):
    path, _, model = checkpoint
    exported = checkpoint_tensors(model.params, model.impl.hf_weight_specs(model.config))
    stored = load_file(str(path / "model.safetensors"))
    assert sorted(exported) == sorted(stored)
    for name, tensor in stored.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)


def test_fused_expert_spelling_loads_the_same_model(checkpoint, tmp_path):
    """transformers 5 saves experts fused with save_original_format=False."""
    _, reference, model = checkpoint
    reference.save_pretrained(tmp_path, save_original_format=False)
    (tmp_path / "tokenizer.json").write_bytes((checkpoint[0] / "tokenizer.json").read_bytes())
    names = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # [E, 2I, H]
    assert not any(".experts.0." in n for n in names)
    fused = load_model(str(tmp_path), dtype="float32", progress=False)
    for ours, theirs in zip(model.params["layers"], fused.params["layers"], strict=True):
        assert sorted(ours) == sorted(theirs)
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    specs = fused.impl.hf_weight_specs(fused.config, list(names))
    for name, tensor in checkpoint_tensors(fused.params, specs).items():
        np.testing.assert_array_equal(tensor, names[name], err_msg=name)


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("page_size", [1, 16])
def test_ragged_prefill_logits_match_transformers(checkpoint, page_size):
    _, reference, model = checkpoint
    seqs = prompts()
    logits = prefill_logits(model, seqs, page_size)
    expected = np.concatenate([reference_logits(reference, ids) for ids in seqs])
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


def test_greedy_continuation_matches_transformers(checkpoint):
    path, reference, _ = checkpoint
    seqs = prompts(seed=3)
    with Engine(model_path=str(path), page_size=16, **ENGINE) as engine:
        outputs = engine.generate(input_ids=seqs, sampling_params=greedy(24))
    for ids, out in zip(seqs, outputs, strict=True):
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out["output_ids"] == generated[0, len(ids):].tolist()


# --------------------------------------------------------------------------- speculation

CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
MAX_NEW = [17, 9, 24]


@pytest.fixture(scope="module")
def eagle3_draft(checkpoint, tmp_path_factory):
    config = json.loads((checkpoint[0] / "config.json").read_text())
    return write_tiny_eagle3_draft(tmp_path_factory.mktemp("qwen3_moe-eagle3"), config)


@pytest.fixture(scope="module")
def plain_outputs(checkpoint):
    with Engine(model_path=str(checkpoint[0]), page_size=16, **ENGINE) as engine:
        outputs = engine.generate(input_ids=prompts(seed=5),
                                  sampling_params=[greedy(n) for n in MAX_NEW])
    return [o["output_ids"] for o in outputs]


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_eagle3_speculation_equals_plain_greedy(checkpoint, eagle3_draft, plain_outputs, shape):
    with Engine(model_path=str(checkpoint[0]), speculative_algorithm="EAGLE3",
                speculative_draft_model_path=str(eagle3_draft), page_size=4, **shape,
                **ENGINE) as engine:
        outputs = engine.generate(input_ids=prompts(seed=5),
                                  sampling_params=[greedy(n) for n in MAX_NEW])
        assert [o["output_ids"] for o in outputs] == plain_outputs
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outputs) > 0


# --------------------------------------------------------------------------- tensor parallel

TP_SIZES = (1, 2, 4)


def expected_bytes_per_device(config: dict, tp: int) -> int:
    """float32 parameter bytes one device holds: attention and token tables as for Qwen3;
    dense MLPs split by intermediate feature; each expert split by intermediate feature (every
    device holds 1/tp of every expert); routers and norms whole."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads, hd = (config["num_attention_heads"], config["num_key_value_heads"],
                           config["head_dim"])
    experts, moe_inter = config["num_local_experts"], config["moe_intermediate_size"]
    qkv_rows = heads * hd // tp + 2 * hd * max(kv_heads, tp) // tp
    attention = qkv_rows * h + h * heads * hd // tp + 2 * h + 2 * hd
    dense = len(config["mlp_only_layers"])
    mlps = (dense * 3 * config["intermediate_size"] // tp * h
            + (layers - dense) * (experts * 3 * moe_inter // tp * h + experts * h))
    vocab_rows = -(-config["vocab_size"] // tp)
    return 4 * (layers * attention + mlps + 2 * vocab_rows * h + h)


def test_greedy_identical_across_tp_sizes(tmp_path):
    """8 q heads, 2 KV heads, experts 32 wide: splits 4 ways; vocabulary 518 is padded."""
    target = write_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", hidden_size=128,
                                   num_attention_heads=8, vocab_size=518)
    config = json.loads((target / "config.json").read_text())
    draft = write_tiny_eagle3_draft(tmp_path / "eagle3", config, num_heads=8, num_kv_heads=2)
    results = run_subprocess(["--model-path", str(target), "--draft-model-path", str(draft),
                              "--tp-sizes", ",".join(map(str, TP_SIZES))], devices=8)
    plain, eagle3 = results["plain"], results["speculative"]
    assert plain[1]["output_ids"] == transformers_greedy(target)
    for tp in TP_SIZES:
        assert plain[tp]["output_ids"] == plain[1]["output_ids"], tp
        assert eagle3[tp]["output_ids"] == plain[1]["output_ids"], tp
        assert plain[tp]["param_bytes_per_device"] == expected_bytes_per_device(config, tp), tp
