"""The draft trainer: TTT attention against a reference written here, step 0 of the TTT forward
against the serving draft on the paged cache, the same losses on 1 device and on an 8-device
mesh (DP 2 x TP 4), resuming, an export the server loads as it was trained, and
DFlash and DSpark heads exported in the published layouts."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.layers.attention import get_attention_backend
from sgl_jax.models import llama_eagle3
from sgl_jax.models.loader import (
    load_dflash_draft,
    load_dspark_draft,
    load_eagle3_draft,
    load_model,
)
from sgl_jax.parallel import TensorParallel
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.dflash import write_tiny_dflash_draft
from sgl_jax.testing.dspark import write_tiny_dspark_draft
from sgl_jax.testing.parallel import cpu_devices_env
from sgl_jax.training import draft as draft_lib
from sgl_jax.training.ttt import DenseBatch, ttt_attention, ttt_logits

# A target and draft that split 8 ways: 8 query and 8 KV heads, vocabulary 512.
SPLITTABLE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
                  intermediate_size=128)
DRAFT_OVERRIDES = {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8,
                   "intermediate_size": 128}


# --------------------------------------------------------------------------- attention


def reference_ttt_attention(q, step_keys, step_values, batch, scale):
    """Loops, from the rule: query t of step s sees step-0 keys j <= t of its row and its own
    index's keys of steps 1..s, one softmax over all of them."""
    n, heads, hd = q.shape
    steps, _, kv_heads, _ = step_keys.shape
    t_len = n // batch
    group = heads // kv_heads
    out = np.zeros_like(q)
    for row in range(batch):
        for t in range(t_len):
            i = row * t_len + t
            keys_idx = [(0, row * t_len + j) for j in range(t + 1)]
            keys_idx += [(s, i) for s in range(1, steps)]
            for h in range(heads):
                kvh = h // group
                keys = np.stack([step_keys[s, j, kvh] for s, j in keys_idx])
                values = np.stack([step_values[s, j, kvh] for s, j in keys_idx])
                scores = keys @ q[i, h] * scale
                weights = np.exp(scores - scores.max())
                out[i, h] = weights / weights.sum() @ values
    return out


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ttt_attention_matches_the_rule(steps):
    rng = np.random.default_rng(steps)
    batch, t_len, heads, kv_heads, hd = 2, 5, 4, 2, 8
    n = batch * t_len
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    keys = rng.standard_normal((steps, n, kv_heads, hd)).astype(np.float32)
    values = rng.standard_normal((steps, n, kv_heads, hd)).astype(np.float32)
    earlier = None if steps == 1 else (jnp.asarray(keys[:-1]), jnp.asarray(values[:-1]))
    out, (all_keys, all_values) = ttt_attention(
        jnp.asarray(q), jnp.asarray(keys[-1]), jnp.asarray(values[-1]), earlier,
        DenseBatch(batch), scale=0.3)
    np.testing.assert_allclose(np.asarray(all_keys), keys)
    np.testing.assert_allclose(np.asarray(all_values), values)
    expected = reference_ttt_attention(q, keys, values, batch, 0.3)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- TTT forward


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama")
    return load_model(str(path), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def draft(target):
    hf = json.loads((target.model_dir / "config.json").read_text())
    hf_config = draft_lib.draft_hf_config(hf, 100)
    config = llama_eagle3.config_from_hf(hf_config)
    d2t = (np.sort(np.random.default_rng(0).choice(hf["vocab_size"], 100, replace=False))
           - np.arange(100))
    tensors = draft_lib.initial_tensors(config, d2t, draft_lib.target_output_rows(target), 0)
    rng = np.random.default_rng(1)  # non-trivial norms and head, like a trained draft
    tensors = {k: (v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
                   if v.dtype == np.float32 else v) for k, v in tensors.items()}
    params = draft_lib.place_draft(config, tensors, np.float32, TensorParallel.of_size(1))
    return hf_config, config, params


def serving_step0_logits(target, config, params, features, ids):
    """The serving path: the draft prefilled over one sequence on the paged cache (native
    backend), pairing feature t with token t + 1, as after a target extend."""
    from sgl_jax.mem_cache.kv_cache import allocate_kv_cache
    from sgl_jax.model_executor.forward_batch import (
        BatchShape,
        SeqChunk,
        aligned,
        build_forward_batch,
    )

    n = len(ids) - 1
    cache = allocate_kv_cache(config.layer, num_pages=8, page_size=4, dtype=jnp.float32)
    shape = BatchShape(num_tokens=aligned(n, 16), q_block=16, pages_per_seq=7, num_logits=1)
    batch = build_forward_batch([SeqChunk(ids[1:], 0, list(range(1, 8)))], page_size=4,
                                shape=shape)
    padded = np.zeros((shape.num_tokens, features.shape[-1]), np.float32)
    padded[:n] = features[:n]
    hidden, _ = llama_eagle3.forward(
        params, cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
        jnp.asarray(padded), batch.attention,
        config=config, attention=get_attention_backend("native"), embed=target.params["embed"],
        from_target=True)
    return np.asarray(llama_eagle3.compute_logits(params, hidden[:n], config,
                                                  params["lm_head"]))


def test_ttt_step0_is_the_serving_draft(target, draft):
    _, config, params = draft
    rng = np.random.default_rng(2)
    ids = rng.integers(0, target.config.vocab_size, (2, 12)).astype(np.int32)
    features = rng.standard_normal((2, 12, 3 * target.config.hidden_size)).astype(np.float32)
    logits = ttt_logits(params, target.params["embed"], params["lm_head"], jnp.asarray(features),
                        jnp.asarray(ids), config=config, length=3)
    assert logits.shape == (3, 2, 12, 100)
    for row in range(2):
        expected = serving_step0_logits(target, config, params, features[row], ids[row].tolist())
        np.testing.assert_allclose(np.asarray(logits[0, row, :11]), expected, rtol=1e-4,
                                   atol=1e-4)


def test_later_steps_see_their_own_chain(target, draft):
    """Step k at index t depends on tokens up to t + k + 1 and on nothing after: changing the
    token at t + k + 2 leaves it unchanged, changing the one at t + k + 1 changes it."""
    _, config, params = draft
    rng = np.random.default_rng(3)
    ids = rng.integers(0, target.config.vocab_size, (1, 12)).astype(np.int32)
    features = jnp.asarray(rng.standard_normal((1, 12, 3 * target.config.hidden_size)),
                           jnp.float32)
    base = np.asarray(ttt_logits(params, target.params["embed"], params["lm_head"], features,
                                 jnp.asarray(ids), config=config, length=3))
    t, k = 4, 2
    for changed, same in ((t + k + 2, True), (t + k + 1, False)):
        other = ids.copy()
        other[0, changed] = (other[0, changed] + 1) % target.config.vocab_size
        logits = np.asarray(ttt_logits(params, target.params["embed"], params["lm_head"],
                                       features, jnp.asarray(other), config=config, length=3))
        assert np.allclose(logits[k, 0, t], base[k, 0, t]) == same


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def training_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target_dir = write_tiny_checkpoint(root / "target", "llama", **SPLITTABLE)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "red", "blue", "one", "two", "three"]
    data = root / "data.jsonl"
    with data.open("w") as f:
        for _ in range(40):
            turns = [{"from": "human" if i % 2 == 0 else "gpt",
                      "value": " ".join(rng.choice(words, rng.integers(3, 12)))}
                     for i in range(rng.integers(2, 5))]
            f.write(json.dumps({"conversations": turns}) + "\n")
    overrides = root / "draft.json"
    overrides.write_text(json.dumps(DRAFT_OVERRIDES))
    return target_dir, data, overrides


def run_cli(setup, out, *args, devices=1):
    target_dir, data, overrides = setup
    blocks = "DFLASH" in args or "DSPARK" in args
    eagle3 = [] if blocks else ["--draft-vocab-size", "64", "--ttt-length", "3"]
    command = [sys.executable, "-m", "sgl_jax.train_eagle3", "--target-model-path",
               str(target_dir), "--data", str(data), "--draft-config", str(overrides),
               *eagle3, "--eval-conversations", "4", "--tokens-per-batch", "512",
               "--lr", "1e-3", "--export-dtype", "float32", "--output-dir", str(out), *args]
    done = subprocess.run(command, env=cpu_devices_env(devices), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight_run(training_setup, tmp_path_factory):
    """Four steps on one device, exported: the run the tests below compare with."""
    out = tmp_path_factory.mktemp("straight")
    return out, run_cli(training_setup, out, "--max-steps", "4")


def test_meshes_give_the_same_losses(training_setup, straight_run, tmp_path):
    single = straight_run[1]
    # Both axes at once: batch rows split over "dp", the target and the draft over "tp".
    sharded = run_cli(training_setup, tmp_path / "dp2-tp4", "--max-steps", "4", "--dp-size",
                      "2", "--tp-size", "4", devices=8)
    assert [m["step"] for m in sharded] == [1, 2, 3, 4]
    for a, b in zip(single, sharded, strict=True):
        np.testing.assert_allclose(b["losses"], a["losses"], rtol=2e-5, atol=1e-6)
        assert b["counts"] == a["counts"]
    assert single[-1]["loss"] < single[0]["loss"]


def test_resume_continues_the_same_run(training_setup, straight_run, tmp_path):
    straight = straight_run[1]
    out = tmp_path / "resumed"
    run_cli(training_setup, out, "--max-steps", "2", "--save-interval", "2")
    (out / "metrics.jsonl").unlink()
    resumed = run_cli(training_setup, out, "--max-steps", "4", "--resume")
    assert [m["step"] for m in resumed] == [3, 4]
    for a, b in zip(straight[2:], resumed, strict=True):
        np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-5)


def test_the_export_loads_as_trained(straight_run):
    tmp_path = straight_run[0]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    loaded = load_eagle3_draft(str(tmp_path), dtype="float32", progress=False)
    from safetensors.numpy import load_file
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["t2d"].dtype == np.bool_ and tensors["t2d"].sum() == 64
    target_ids = np.arange(64) + tensors["d2t"]
    assert np.array_equal(np.flatnonzero(tensors["t2d"]), np.sort(target_ids))
    np.testing.assert_array_equal(np.asarray(loaded.params["lm_head"]),
                                  tensors["lm_head.weight"])
    assert not np.allclose(tensors["midlayer.self_attn.q_proj.weight"], 0)
    assert jax.tree.all(jax.tree.map(lambda x: np.isfinite(np.asarray(x)).all(),
                                     loaded.params))


def test_a_dflash_head_trained_here_loads_as_a_z_lab_head_and_serves(training_setup, tmp_path):
    """--speculative-algorithm DFLASH on the target's own greedy answers (--regenerate at
    temperature 0): the loss falls and blocks on the held-out conversations start with
    correct drafts; the export has a published head's config fields and tensor names (a head
    written the z-lab way, same depth), loads, and serves the target's own answers
    (transformers'). (This random target's answers are noise re-tokenized from text, so
    what acceptance a trained head reaches is measured on the demo model, in
    docs/benchmarks/cpu.md.)"""
    out = tmp_path / "head"
    metrics = run_cli(training_setup, out, "--speculative-algorithm", "DFLASH",
                      "--regenerate", "--regenerate-temperature", "0",
                      "--regenerate-max-tokens", "24", "--num-anchors", "16", "--lr", "3e-3",
                      "--epochs", "30", "--max-steps", "40", "--save-interval", "40")
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.2  # from ln V: a uniform first guess
    config = json.loads((out / "config.json").read_text())
    target_dir = training_setup[0]
    target_config = json.loads((target_dir / "config.json").read_text())
    zlab = write_tiny_dflash_draft(tmp_path / "zlab", target_config,
                                   num_layers=config["num_hidden_layers"],
                                   block_size=config["block_size"],
                                   target_layer_ids=config["dflash_config"]["target_layer_ids"])
    published = json.loads((zlab / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert set(published) - {"torch_dtype"} <= set(config)
    assert set(config["dflash_config"]) == set(published["dflash_config"])
    from safetensors.numpy import load_file
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(load_file(zlab / "model.safetensors"))
    loaded = load_dflash_draft(str(out), dtype="float32", progress=False)
    np.testing.assert_array_equal(np.asarray(loaded.params["fc"]), tensors["fc.weight"])
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["accept_length"] > max(1.1, evals[0]["accept_length"] + 0.05), evals
    _served_answers_are_the_targets(target_dir, out, training_setup[1], "DFLASH")


def test_a_dspark_head_trained_here_loads_in_deepspecs_layout_and_serves(training_setup,
                                                                         tmp_path):
    """--speculative-algorithm DSPARK, as the DFlash case above: the loss falls, held-out
    blocks start with more correct drafts, the export has DeepSpec's config fields and tensor
    names (an rnn Markov head asked for), loads, and serves the target's own answers."""
    out = tmp_path / "head"
    (tmp_path / "dspark.json").write_text(json.dumps({
        **DRAFT_OVERRIDES, "num_hidden_layers": 2, "markov_rank": 16,
        "markov_head_type": "rnn"}))
    metrics = run_cli(training_setup, out, "--speculative-algorithm", "DSPARK",
                      "--draft-config", str(tmp_path / "dspark.json"),
                      "--regenerate", "--regenerate-temperature", "0",
                      "--regenerate-max-tokens", "24", "--num-anchors", "16", "--lr", "3e-3",
                      "--epochs", "30", "--max-steps", "40", "--save-interval", "40")
    # This random target's next-token distributions are nearly flat, so the total variation
    # (most of the objective) starts small; the first slot's cross-entropy falls from ln V.
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert metrics[-1]["losses"][0] < metrics[0]["losses"][0] - 0.3
    config = json.loads((out / "config.json").read_text())
    target_dir = training_setup[0]
    deepspec = write_tiny_dspark_draft(
        tmp_path / "deepspec", json.loads((target_dir / "config.json").read_text()),
        markov_head="rnn", markov_rank=16, num_layers=2, block_size=config["block_size"],
        target_layer_ids=config["target_layer_ids"])
    published = json.loads((deepspec / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 7
    assert set(published) - {"torch_dtype"} <= set(config)
    from safetensors.numpy import load_file
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(load_file(deepspec / "model.safetensors"))
    loaded = load_dspark_draft(str(out), dtype="float32", progress=False)
    assert loaded.config.markov_head == "rnn" and loaded.config.confidence_with_markov
    target = load_model(str(target_dir), dtype="float32", progress=False)
    np.testing.assert_array_equal(tensors["embed_tokens.weight"],  # frozen copies
                                  np.asarray(target.params["embed"]))
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["accept_length"] > max(1.1, evals[0]["accept_length"] + 0.05), evals
    # The confidence head's held-out calibration (test_calibration.py checks the figures).
    for report in evals[-1]["confidence_calibration"].values():  # sampled, greedy
        assert len(report["temperatures"]) == 7
        assert 0 < report["ece"] < 1 and 0 <= report["ece_with_temperatures"] < 1
    _served_answers_are_the_targets(target_dir, out, training_setup[1], "DSPARK")


def _served_answers_are_the_targets(target_dir, head, data, algorithm, new_tokens=24):
    """The first user turns of the held-out conversations (the first 4, as --eval-
    conversations 4 holds out), served with the head."""
    import torch
    from transformers import AutoModelForCausalLM

    from sgl_jax import Engine
    from sgl_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(target_dir))
    records = [json.loads(line) for line in data.read_text().splitlines()[:4]]
    prompts = [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": r["conversations"][0]["value"]}],
        add_generation_prompt=True, tokenize=True, return_dict=False)) for r in records]
    greedy = {"temperature": 0, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    with Engine(model_path=str(target_dir), speculative_algorithm=algorithm,
                speculative_draft_model_path=str(head), speculative_num_steps=7,
                speculative_adaptive=False, dtype="float32", log_level="warning") as engine:
        out = engine.generate(input_ids=prompts, sampling_params=[greedy] * len(prompts))
        assert engine.get_server_info()["avg_spec_accept_length"] >= 1.0  # rounds ran
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    for prompt, answer in zip(prompts, out, strict=True):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        assert answer["output_ids"] == expected[0, len(prompt):].tolist()
