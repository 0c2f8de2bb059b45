"""Tensor parallelism with the `fa` attention backend (the Pallas kernel, interpreted on a
CPU, run per device on its own heads): greedy outputs of TP 1, 4 and 8 (qwen3: 1 and 8) on an
8-device CPU mesh are identical to transformers', with and without EAGLE3."""

import pytest

from sgl_jax.testing.parallel import run_subprocess, transformers_greedy, write_tp_checkpoints

# Per device, llama's 8 query and 2 KV heads give the kernel 4 query heads per KV head at TP 1
# (and TP 2, which only halves the KV heads: test_tp_native.py splits it), 2 at TP 4 (KV heads
# copied) and 1 at TP 8; qwen3's head layout (head_dim 32) takes the ends.
TP_SIZES = {"llama": "1,4,8", "qwen3": "1,8"}


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
