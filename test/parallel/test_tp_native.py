"""Tensor parallelism with the `native` attention backend: greedy outputs of TP 1, 2, 4 and 8
(qwen2 and qwen3: 1 and 8) on an 8-device CPU mesh are identical, with and without EAGLE3,
and TP 1 is transformers' greedy output; STANDALONE, NGRAM, DFLASH and DSPARK drafts over a
sharded target keep it. Parameter memory per device falls as 1/tp (printed).

Each case runs in a subprocess: the device count is fixed when JAX starts.
"""

import json

import numpy as np
import pytest

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.dflash import fit_dflash_draft
from sgl_jax.testing.dspark import write_tiny_dspark_draft
from sgl_jax.testing.fp8 import write_fp8_checkpoint
from sgl_jax.testing.parallel import (
    MAX_NEW_TOKENS,
    TP_PRESETS,
    run_subprocess,
    transformers_greedy,
    write_tp_checkpoints,
)

TP_SIZES = (1, 2, 4, 8)
# llama's run takes every size; qwen2's and qwen3's own parts (one KV head and q/k/v biases,
# q/k norms) split by head as llama's do, so they take the ends: whole, and a head a device.
TP_SIZES_OF = {"llama": TP_SIZES, "qwen2": (1, 8), "qwen3": (1, 8)}


def expected_bytes_per_device(config: dict, tp: int) -> int:
    """float32 parameter bytes one device holds under Megatron-style splitting: q/k/v, gate/up
    by output rows, o/down by input columns, token tables by (padded) rows, KV heads copied
    when there are fewer than devices, norms whole."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    layers = config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    qkv_rows = heads * hd // tp + 2 * hd * max(kv_heads, tp) // tp
    per_layer = qkv_rows * h + h * heads * hd // tp + 3 * inter // tp * h + 2 * h
    if config["model_type"] == "qwen2":
        per_layer += qkv_rows  # q/k/v biases
    if config["model_type"] == "qwen3":
        per_layer += 2 * hd  # q_norm, k_norm
    tables = 1 if config["tie_word_embeddings"] else 2
    vocab_rows = -(-config["vocab_size"] // tp)
    return 4 * (layers * per_layer + tables * vocab_rows * h + h)


def print_memory(preset: str, results: dict) -> None:
    for tp, result in sorted(results.items()):
        print(f"{preset} tp={tp}: {result['param_bytes_per_device'] / 2**20:.3f} MiB of "
              f"{result['param_bytes'] / 2**20:.3f} MiB parameters per device, "
              f"{result['kv_heads']} KV heads over {result['devices']} device(s)")


@pytest.mark.parametrize("preset", ["llama", "qwen2", "qwen3"])
def test_greedy_identical_across_tp_sizes(preset, tmp_path):
    target, draft = write_tp_checkpoints(tmp_path, preset)
    sizes = TP_SIZES_OF[preset]
    results = run_subprocess(["--model-path", str(target), "--draft-model-path", str(draft),
                              "--tp-sizes", ",".join(map(str, sizes))], devices=8)
    plain, eagle3 = results["plain"], results["speculative"]
    print_memory(preset, plain)
    assert plain[1]["output_ids"] == transformers_greedy(target)
    for tp in sizes:
        assert plain[tp]["finish_reasons"] == ["length"] * 3, tp
        assert plain[tp]["output_ids"] == plain[1]["output_ids"], tp
        assert eagle3[tp]["output_ids"] == plain[1]["output_ids"], tp
        assert eagle3[tp]["accept_length"] > 0, tp  # verify rounds ran
    config = json.loads((target / "config.json").read_text())
    for tp in sizes:
        assert plain[tp]["param_bytes_per_device"] == expected_bytes_per_device(config, tp), tp


def test_accepted_tree_paths_move_sharded_kv(tmp_path):
    """The target as its own STANDALONE draft accepts a whole tree path every round, so each
    round moves accepted K/V within the sharded caches (random EAGLE3 heads rarely accept).
    TP 4 splits the 2 KV heads into copies."""
    target, _ = write_tp_checkpoints(tmp_path, "llama")
    results = run_subprocess(["--model-path", str(target), "--draft-model-path", str(target),
                              "--draft-algorithm", "STANDALONE", "--speculative-only",
                              "--tp-sizes", "4"], devices=4)["speculative"]
    assert results[4]["output_ids"] == transformers_greedy(target)
    # up to 3 tokens a round (num_steps + 1), fewer where max_new_tokens cuts the last round;
    # a draft that never agrees would give 1
    assert results[4]["accept_length"] > 2.5


def test_ngram_drafts_accept_over_a_sharded_target(tmp_path):
    """NGRAM at TP 2: the second pass over the prompts drafts from the first pass's answers,
    so accepted tree paths move K/V within the sharded caches; greedy output stays
    transformers'."""
    target, _ = write_tp_checkpoints(tmp_path, "qwen3")
    results = run_subprocess(["--model-path", str(target), "--draft-algorithm", "NGRAM",
                              "--speculative-only", "--tp-sizes", "2"], devices=2)["speculative"]
    assert results[2]["output_ids"] == transformers_greedy(target)
    assert results[2]["accept_length"] > 1.3


def test_a_fitted_dflash_head_drafts_whole_blocks_over_a_sharded_target(tmp_path):
    """A DFlash head fitted to the Qwen3 target's greedy text, its layers and its context KV
    split over 2 devices as the target's are: a 7-token chain from one block a round, drafts
    accepted (so each round writes the context of several accepted tokens into the sharded
    draft cache), greedy output transformers'."""

    target, _ = write_tp_checkpoints(tmp_path, "qwen3")
    prompts = np.random.default_rng(5).integers(3, TP_PRESETS["qwen3"]["vocab_size"],
                                                (4, 12)).tolist()
    continuations = fit_dflash_draft(tmp_path / "dflash", target, prompts,
                                     new_tokens=MAX_NEW_TOKENS, steps=40)
    results = run_subprocess(["--model-path", str(target), "--draft-model-path",
                              str(tmp_path / "dflash"), "--draft-algorithm", "DFLASH",
                              "--speculative-only", "--tp-sizes", "2",
                              "--prompts", json.dumps(prompts)], devices=2)["speculative"]
    assert results[2]["output_ids"] == continuations
    assert results[2]["accept_length"] > 2


def test_a_dspark_tree_over_a_sharded_target_keeps_the_greedy_text(tmp_path):
    """A random DSpark head (rnn Markov head, confidence head) as a top-2 tree at TP 2: its
    backbone splits as DFlash's does, its own lm_head and Markov tables serve every device;
    greedy output transformers'."""
    target, _ = write_tp_checkpoints(tmp_path, "qwen3")
    head = write_tiny_dspark_draft(tmp_path / "dspark", json.loads(
        (target / "config.json").read_text()), markov_head="rnn")
    results = run_subprocess(["--model-path", str(target), "--draft-model-path", str(head),
                              "--draft-algorithm", "DSPARK", "--speculative-only",
                              "--tp-sizes", "2"], devices=2)["speculative"]
    assert results[2]["output_ids"] == transformers_greedy(target)
    assert results[2]["accept_length"] >= 1.0  # verify rounds ran


def test_8_bit_weights_split_as_float_ones_do(tmp_path):
    """The tiny Qwen3-MoE as a block-wise FP8 checkpoint (scales split with their blocks)
    and quantized to int8 at load (one scale per row, whole on every device; w8a8_int8 also
    rounds each device's part of a row-parallel product's input on its own): greedy output
    at TP 2 equals TP 1's, the FP8 one is transformers' greedy output on the dequantized
    copy, and each device holds about half the parameters."""
    float_dir = write_tiny_checkpoint(tmp_path / "float", "qwen3_moe")
    fp8, dequantized = write_fp8_checkpoint(float_dir, tmp_path / "fp8", tmp_path / "dequantized",
                                            block=(16, 16))
    fp8_runs = run_subprocess(["--model-path", str(fp8), "--tp-sizes", "1,2"], devices=2)["plain"]
    assert fp8_runs[1]["output_ids"] == transformers_greedy(dequantized)
    int8_runs = [run_subprocess(["--model-path", str(float_dir), "--tp-sizes", "1,2",
                                 "--engine-settings", json.dumps({"quantization": fmt})],
                                devices=2)["plain"] for fmt in ("int8", "w8a8_int8")]
    for runs in (fp8_runs, *int8_runs):
        assert runs[2]["output_ids"] == runs[1]["output_ids"]
        assert runs[2]["param_bytes_per_device"] < 0.6 * runs[1]["param_bytes_per_device"]
