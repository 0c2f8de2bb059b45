"""The trained tiny Qwen3-MoE of the quantization benchmark, built in miniature (a few
records, a few steps): it trains on records before the benchmark's held-out text only, the
loss falls, the folder loads in our loader with transformers' logits, and a finished build
is returned from its folder without training again."""

import json
import math

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models.loader import load_model
from sgl_jax.testing import trained_moe


def test_a_miniature_build_trains_loads_and_is_cached(tmp_path, monkeypatch):
    read = []
    documents = trained_moe.training_documents
    monkeypatch.setattr(trained_moe, "training_documents",
                        lambda first, stop: read.append((first, stop)) or documents(first, stop))
    monkeypatch.setattr(trained_moe, "TRAIN_RECORDS", 80)
    monkeypatch.setattr(trained_moe, "HELD_OUT_RECORDS", 20)
    monkeypatch.setattr(trained_moe, "MAX_STEPS", 12)
    monkeypatch.setattr(trained_moe, "BATCH_SIZE", 4)
    monkeypatch.setattr(trained_moe, "WARMUP_STEPS", 2)
    monkeypatch.setattr(trained_moe, "LOG_EVERY", 4)
    out = trained_moe.trained_tiny_qwen3_moe(tmp_path / "moe", minutes=10)

    assert read == [(0, 60), (60, 80)]  # never the benchmark's records (12000 on)
    summary = json.loads((out / trained_moe.MARKER).read_text())
    assert summary["steps"] == 12
    # From uniform over the 512 tokens (6.24 nats) to the text's token frequencies at least.
    assert summary["final_train_loss"] < math.log(512) - 0.5
    assert summary["held_out_loss"] < math.log(512) - 0.5
    assert not list(tmp_path.glob("*.partial-*"))

    ids = np.random.default_rng(0).integers(3, 500, 40).tolist()
    model = load_model(str(out), dtype="float32", progress=False)
    runner = ModelRunner(model, num_pages=8, page_size=16)
    ours = runner.forward([SeqChunk(ids, 0, [1, 2, 3])], all_logits=True)[0]
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=1e-4)

    monkeypatch.setattr(trained_moe, "train_and_save", lambda *a: (_ for _ in ()).throw(
        AssertionError("a finished build is trained again")))
    assert trained_moe.trained_tiny_qwen3_moe(tmp_path / "moe") == out
