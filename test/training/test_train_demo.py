"""A head trained for a few minutes on a real target (SmolLM2-135M-Instruct, ShareGPT) predicts
the target's next token on held-out conversations far better than the head it started as."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sgl_jax.demo import demo_model_path

pytestmark = pytest.mark.slow


def test_training_beats_the_untrained_head(tmp_path):
    try:
        demo_model_path()
        from sgl_jax.datasets import iter_sharegpt
        next(iter(iter_sharegpt()))
    except (FileNotFoundError, StopIteration) as e:
        pytest.skip(f"demo model or ShareGPT not installed: {e}")
    (tmp_path / "draft.json").write_text(json.dumps({"intermediate_size": 512}))
    command = [sys.executable, "-m", "sgl_jax.train_eagle3", "--output-dir", str(tmp_path),
               "--num-conversations", "96", "--eval-conversations", "8", "--max-length", "128",
               "--draft-vocab-size", "2048", "--draft-config", str(tmp_path / "draft.json"),
               "--ttt-length", "2", "--tokens-per-batch", "512", "--lr", "2e-3",
               "--epochs", "10", "--max-steps", "40", "--save-interval", "40"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    evals = {e["step"]: e["accuracies"] for e in
             map(json.loads, (tmp_path / "eval.jsonl").read_text().splitlines())}
    untrained, trained = evals[0], evals[40]
    assert trained[0] > untrained[0] + 0.15, evals
    assert trained[1] > untrained[1], evals
