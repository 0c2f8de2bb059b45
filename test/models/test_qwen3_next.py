"""Qwen3-Next against transformers (PyTorch, CPU, float32) on a tiny random checkpoint: 8
layers (gated attention at 3 and 7, Gated DeltaNet elsewhere), conv kernel 4, 4 key and 8
value heads of 16, 8 experts top 2 with a shared expert, layer 1 dense. Config and tensor
names, partial rotary, logits, greedy continuations through the Engine (page sizes 1 and 16,
batches of 1 and 8, chunked prefill), seeded sampling, no compilation after warm-up, the
recurrent-state pool back to full after finished, aborted and retracted requests, the radix
cache off, TP 1, 2 and 4 alike, and a chat through the HTTP server."""

import json
import logging
import shutil
import time

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from sgl_jax import Engine
from sgl_jax.layers.rotary import apply_rope, inverse_frequencies, rope_cos_sin
from sgl_jax.layers.weights import checkpoint_tensors
from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models import qwen3_next
from sgl_jax.models.loader import load_model
from sgl_jax.models.registry import supported_architectures
from sgl_jax.testing import tiny_config, write_tiny_checkpoint
from sgl_jax.testing.mtp import write_mtp_tensors
from sgl_jax.testing.parallel import prompts as tp_prompts
from sgl_jax.testing.parallel import run_subprocess
from sgl_jax.testing.server import launch_server

# The residual stream of this random model grows to ~30 through 8 layers, and float32
# rounding with it: transformers' own float32 run is as far from its float64 run as we are.
ATOL = 3e-3
LENGTHS = [3, 50, 12, 17, 33, 9, 70, 1]  # a batch of 8: some prompts take several chunks
ENGINE = dict(dtype="float32", skip_server_warmup=True, precompile_token_paddings=[64, 256],
              precompile_bs_paddings=[8], max_prefill_tokens=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")
    write_mtp_tensors(path, seed=1)  # as the hub's checkpoints: loading the target skips them
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # the Engine runs below ignore EOS too
    return path, reference, load_model(str(path), dtype="float32", progress=False)


def prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def assert_greedy_as_transformers(reference, prompt: list[int], output: list[int]) -> None:
    """Each output token is transformers' argmax after the prompt and the tokens before it:
    one forward over the whole sequence checks the greedy continuation token for token."""
    logits = reference_logits(reference, prompt + output[:-1])
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == output


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


# --------------------------------------------------------------------------- config, weights


def test_layer_kinds_are_the_ones_transformers_builds():
    hf_config = tiny_config("qwen3_next")
    module = AutoModelForCausalLM.from_config(hf_config)
    config = qwen3_next.config_from_hf(hf_config.to_dict())
    kinds = [layer.block_type == "linear_attention" for layer in module.model.layers]
    assert [config.is_linear_layer(i) for i in range(8)] == kinds
    moe = [type(layer.mlp).__name__ == "Qwen3NextSparseMoeBlock" for layer in module.model.layers]
    assert [config.is_moe_layer(i) for i in range(8)] == moe
    assert (config.rotary_dim, config.num_attention_layers) == (8, 2)
    assert config.attn_output_gate and config.zero_centered_norm and config.qk_norm
    assert config.shared_expert_intermediate_size == 32
    assert "Qwen3NextForCausalLM" in supported_architectures()
    hash(config)  # jitted functions close over it


def test_hub_config_spelling_parses_the_same():
    """The hub's config.json: no layer_types (full_attention_interval), partial_rotary_factor
    and rope_theta at the top level."""
    saved = tiny_config("qwen3_next").to_dict()
    hub = {k: v for k, v in saved.items() if k not in ("layer_types", "rope_parameters")}
    hub |= {"full_attention_interval": 4, "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    assert qwen3_next.config_from_hf(hub) == qwen3_next.config_from_hf(saved)
    eighty = qwen3_next.layer_types(Qwen3NextConfig().to_dict() | {"layer_types": None})
    assert [i for i, t in enumerate(eighty) if t == "full_attention"] == list(range(3, 48, 4))


def test_checkpoint_tensors_round_trip_and_mtp_is_ignored(checkpoint, tmp_path):
    path, _, model = checkpoint
    stored = load_file(str(path / "model.safetensors"))
    exported = checkpoint_tensors(model.params, model.impl.hf_weight_specs(model.config))
    assert sorted(exported) == sorted(stored)
    for name, tensor in stored.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
    layers = model.params["layers"]
    assert sorted(layers[0]["linear_attn"]) == ["a_log", "conv_w", "dt_bias", "norm", "w_in",
                                                "w_out"]
    assert "w_qkv" not in layers[0] and layers[3]["w_qkv"].shape == (2, 2 * 2 * 32 + 64, 64)
    assert layers[0]["w_shared_gate"].shape == (1, 64) and "w_gate_up" in layers[1]
    # the hub's checkpoints carry a multi-token-prediction head, which is not loaded
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    save_file({"mtp.fc.weight": np.ones((64, 128), np.float32)},
              str(tmp_path / "mtp.safetensors"), metadata={"format": "pt"})
    with_mtp = load_model(str(tmp_path), dtype="float32", progress=False)
    np.testing.assert_array_equal(with_mtp.params["embed"], model.params["embed"])


def test_partial_rotary_is_transformers_rotate_half_on_the_first_quarter():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(5, 4, 32)).astype(np.float32)
    positions = np.array([0, 1, 7, 100, 511])
    config = qwen3_next.config_from_hf(tiny_config("qwen3_next").to_dict())
    cos, sin = rope_cos_sin(jnp.asarray(positions), inverse_frequencies(config.rope, 8))
    ours = np.asarray(apply_rope(jnp.asarray(q), cos, sin))
    rotary = hf.Qwen3NextRotaryEmbedding(tiny_config("qwen3_next"))
    tq = torch.from_numpy(q).transpose(0, 1)[None]  # [1, heads, T, hd]
    hf_cos, hf_sin = rotary(tq, torch.from_numpy(positions)[None])
    expected, _ = hf.apply_rotary_pos_emb(tq, tq, hf_cos, hf_sin)
    np.testing.assert_allclose(ours, expected[0].transpose(0, 1).numpy(), atol=1e-5)
    np.testing.assert_array_equal(ours[..., 8:], q[..., 8:])  # the rest passes through


# --------------------------------------------------------------------------- logits


@pytest.mark.parametrize("page_size", [1, 16])
def test_ragged_prefill_logits_match_transformers(checkpoint, page_size):
    _, reference, model = checkpoint
    runner = ModelRunner(model, num_pages=160, page_size=page_size, num_state_slots=4)
    seqs, chunks, next_page = prompts(0, [7, 45, 20]), [], 1
    for slot, ids in enumerate(seqs, start=1):
        count = -(-len(ids) // page_size)
        chunks.append(SeqChunk(ids, 0, list(range(next_page, next_page + count)),
                               state_slot=slot))
        next_page += count
    logits, _ = runner.forward(chunks, all_logits=True)
    expected = np.concatenate([reference_logits(reference, ids) for ids in seqs])
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


def test_chunks_and_decode_steps_continue_each_state(checkpoint):
    """Steps mixing a second prefill chunk, a whole prompt and decode tokens, each sequence in
    its own slot, then decode steps: every step's logits are transformers' over the whole
    sequence so far, and the slots nobody uses (the null slot included) stay zero."""
    _, reference, model = checkpoint
    runner = ModelRunner(model, num_pages=64, page_size=4, num_state_slots=6)
    a, b, c = prompts(1, [30, 21, 9])
    pages = {1: list(range(1, 11)), 3: list(range(11, 21)), 5: list(range(21, 31))}
    runner.forward([SeqChunk(a[:13], 0, pages[1], state_slot=1),
                    SeqChunk(c[:-1], 0, pages[5], state_slot=5)])
    logits, _ = runner.forward([SeqChunk(a[13:], 13, pages[1], state_slot=1),
                                SeqChunk(b, 0, pages[3], state_slot=3),
                                SeqChunk(c[-1:], len(c) - 1, pages[5], state_slot=5)])
    seqs, steps = {1: a, 3: b, 5: c}, [logits]
    for _ in range(3):  # decode steps: one token per sequence, our own greedy choice
        seqs = {slot: ids + [int(row.argmax())]
                for (slot, ids), row in zip(seqs.items(), steps[-1], strict=True)}
        chunks = [SeqChunk(ids[-1:], len(ids) - 1, pages[slot], state_slot=slot)
                  for slot, ids in seqs.items()]
        steps.append(runner.forward(chunks)[0])
    for row, ids in enumerate(seqs.values()):  # one forward over each whole sequence
        expected = reference_logits(reference, ids)[-len(steps):]
        ours = np.stack([step[row] for step in steps])
        np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0, err_msg=str(row))
    for i in range(model.config.num_layers):
        if model.config.is_linear_layer(i):
            for field in runner.state.kv_cache.layer(i):
                assert not np.asarray(field)[[0, 2, 4]].any(), i
    with pytest.raises(ValueError, match="state slot"):
        runner.forward([SeqChunk(a[:3], 0, pages[1])])  # a hybrid chunk needs a slot


# --------------------------------------------------------------------------- the Engine


@pytest.mark.parametrize("page_size,chunk", [(16, 2048), (1, 32)], ids=["page16", "page1-chunk32"])
def test_greedy_matches_transformers(checkpoint, page_size, chunk):
    """A batch of 8 prompts of different lengths (prefill chunks and decode rows mix in
    steps), then one prompt alone; with chunk 32, prompts of 33, 50 and 70 tokens take
    several chunks."""
    path, reference, _ = checkpoint
    seqs = prompts(3)
    with Engine(model_path=str(path), page_size=page_size, chunked_prefill_size=chunk,
                **ENGINE) as engine:
        outputs = engine.generate(input_ids=seqs, sampling_params=greedy(16))
        alone = engine.generate(input_ids=seqs[6], sampling_params=greedy(24))
        info = engine.get_server_info()
    for ids, out in zip(seqs, outputs, strict=True):
        assert_greedy_as_transformers(reference, ids, out["output_ids"])
    assert alone["output_ids"][:16] == outputs[6]["output_ids"]
    if page_size == 16:  # and once through transformers' own decode loop
        with torch.no_grad():
            generated = reference.generate(torch.tensor([seqs[6]]), max_new_tokens=24,
                                           do_sample=False,
                                           attention_mask=torch.ones(1, 70, dtype=torch.long))
        assert alone["output_ids"] == generated[0, 70:].tolist()
    assert info["state_slots_in_use"] == 0 and info["state_slots_total"] == 8
    assert info["kv_pages_cached"] == 0


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(checkpoint):
    path, _, _ = checkpoint
    seqs = prompts(4, [11, 40, 5])
    params = [{"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12, "seed": s,
               "ignore_eos": True} for s in (1, 2, 3)]
    with Engine(model_path=str(path), page_size=16, **ENGINE) as engine:
        batch = engine.generate(input_ids=seqs, sampling_params=params)
        alone = engine.generate(input_ids=seqs[1], sampling_params=params[1])
        reseeded = engine.generate(input_ids=seqs[1], sampling_params=params[1] | {"seed": 9})
    assert alone["output_ids"] == batch[1]["output_ids"]
    assert len(alone["output_ids"]) == 12 and reseeded["output_ids"] != alone["output_ids"]


def test_state_pool_returns_to_full_after_finish_abort_and_retraction(checkpoint, caplog):
    """A pool of 64 pages of 4 tokens cannot hold six requests at full length: some are
    retracted (their states freed, recomputed from scratch) and still answer as alone; a
    stream closed early is aborted. Warm-up compiles every bucket, nothing compiles after,
    and the radix cache is off with a log line."""
    path, reference, _ = checkpoint
    settings = dict(ENGINE, page_size=4, skip_server_warmup=False, max_total_tokens=256,
                    precompile_token_paddings=[64], precompile_bs_paddings=[8],
                    max_prefill_tokens=64)
    seqs = prompts(5, [30, 25, 40, 20, 35, 28])
    with caplog.at_level(logging.INFO, logger="sgl_jax.runtime"), \
            Engine(model_path=str(path), **settings) as engine:
        compiled = engine.get_server_info()["num_compilations"]
        outputs = engine.generate(input_ids=seqs, sampling_params=greedy(24))
        info = engine.get_server_info()
        assert info["num_retractions"] > 0 and info["state_slots_in_use"] == 0
        stream = engine.generate(input_ids=seqs[0], sampling_params=greedy(200), stream=True)
        assert len(next(stream)["output_ids"]) == 1
        stream.close()  # the consumer walks away: the request is aborted
        deadline = time.time() + 10
        while engine.get_server_info()["num_running_reqs"] and time.time() < deadline:
            time.sleep(0.05)
        info = engine.get_server_info()
        assert info["state_slots_in_use"] == 0 and info["state_slots_total"] == 8
        assert engine.usage().all_pages_free
        assert info["num_compilations"] == compiled
    for ids, out in zip(seqs, outputs, strict=True):
        assert_greedy_as_transformers(reference, ids, out["output_ids"])
    assert any("Radix prefix cache off" in r.message and "recurrent state" in r.message
               for r in caplog.records)


# --------------------------------------------------------------------------- tensor parallel


def test_greedy_identical_across_tp_sizes(checkpoint):
    """Attention heads (2 KV heads: one copy each at TP 4), GDN key heads (4: one per device
    at TP 4) with the state pool, and every expert's features split; plain and speculative.
    TP 4 splits every kind of head the narrowest way; TP 2 adds no other split."""
    path, reference, _ = checkpoint
    results = run_subprocess(["--model-path", str(path), "--tp-sizes", "1,4",
                              "--draft-model-path", str(path), "--draft-algorithm",
                              "STANDALONE"], devices=4)
    plain = results["plain"]
    # The target as its own draft: every round commits deep tree nodes' states on each split.
    for tp in (1, 4):
        assert results["speculative"][tp]["output_ids"] == plain[1]["output_ids"], tp
    for ids, output in zip(tp_prompts(512), plain[1]["output_ids"], strict=True):
        assert_greedy_as_transformers(reference, ids, output)
    assert plain[4]["output_ids"] == plain[1]["output_ids"]
    config = json.loads((path / "config.json").read_text())
    assert config["linear_num_key_heads"] % 4 == 0
    assert plain[4]["param_bytes_per_device"] < plain[1]["param_bytes_per_device"]


# --------------------------------------------------------------------------- the HTTP server


def test_server_chat_greedy_and_sampled(checkpoint):
    """The OpenAI client against the server started with the seed's NEXTN command (the
    checkpoint's own MTP module drafting 3/1/4 chains): a greedy chat equals transformers'
    greedy reply, a sampled stream completes, and no state slot stays taken."""
    path, reference, _ = checkpoint
    flags = ["--model-path", str(path), "--dtype", "float32", "--skip-server-warmup",
             "--precompile-token-paddings", "64", "--precompile-bs-paddings", "4",
             "--max-prefill-tokens", "64", "--served-model-name", "tiny-next",
             "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected = tokenizer.decode(expected[0, len(prompt):], skip_special_tokens=True)
    with launch_server(flags) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="tiny-next", messages=messages,
                                               temperature=0, max_tokens=8,
                                               extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(model="tiny-next", messages=messages,
                                                temperature=0.7, seed=1, max_tokens=6,
                                                extra_body={"ignore_eos": True}, stream=True)
        finishes = [c.choices[0].finish_reason for c in stream if c.choices]
        info = httpx.get(f"{server.base_url}/get_server_info").json()
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens == 8 and finishes[-1] == "length"
    assert info["state_slots_in_use"] == 0 and info["kv_pages_in_use"] == 0
    assert info["speculative_algorithm"] == "NEXTN" and info["spec_verify_rounds"] > 0
