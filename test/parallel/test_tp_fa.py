"""Tensor parallelism with the `fa` attention backend (the Pallas kernel, interpreted on a
CPU, run per device on its own heads): greedy outputs of TP 1, 2, 4 and 8 (qwen3: 1 and 8) on
an 8-device CPU mesh are identical to transformers', with and without EAGLE3."""

import pytest

from sgl_jax.testing.parallel import run_subprocess, transformers_greedy, write_tp_checkpoints

# llama's run takes every size; qwen3's head layout (head_dim 32) the ends.
TP_SIZES = {"llama": "1,2,4,8", "qwen3": "1,8"}


# Qwen2 (one KV head, q/k/v biases) splits the same way under the native backend
# (test_tp_native.py); the kernel's own cases are llama's and qwen3's head layouts.
@pytest.mark.parametrize("preset", ["llama", "qwen3"])
def test_fa_greedy_identical_across_tp_sizes(preset, tmp_path):
    target, draft = write_tp_checkpoints(tmp_path, preset)
    results = run_subprocess(["--model-path", str(target), "--draft-model-path", str(draft),
                              "--tp-sizes", TP_SIZES[preset], "--attention-backend", "fa"],
                             devices=8)
    plain, eagle3 = results["plain"], results["speculative"]
    expected = transformers_greedy(target)
    for tp in map(int, TP_SIZES[preset].split(",")):
        assert plain[tp]["output_ids"] == expected, tp
        assert eagle3[tp]["output_ids"] == expected, tp
        assert eagle3[tp]["accept_length"] > 0, tp
