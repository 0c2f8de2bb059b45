"""benchmark/bench_structured_outputs.py end to end on a tiny random target and EAGLE3 head: a
row per engine and batch size, ratios consistent with the rates, JSON written."""

from __future__ import annotations

import json

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.benchmarks import load_benchmark
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft


def load_bench():
    return load_benchmark("bench_structured_outputs")


def test_bench_structured_outputs_reports_both_engines(tmp_path):
    target = write_tiny_checkpoint(tmp_path / "llama", "llama")
    draft = write_tiny_eagle3_draft(tmp_path / "draft",
                                    json.loads((target / "config.json").read_text()))
    out = tmp_path / "rows.json"
    assert load_bench().main(["--model-path", str(target), "--draft-model-path", str(draft),
                              "--batch-sizes", "1,2", "--num-prompts", "2", "--output-len", "6",
                              "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["engine"], r["batch_size"]) for r in rows] == [
        ("plain", 1), ("plain", 2), ("eagle3", 1), ("eagle3", 2)]
    for row in rows:
        assert row["free_tok_s"] > 0 and row["schema_tok_s"] > 0
        assert abs(row["ratio"] - row["schema_tok_s"] / row["free_tok_s"]) < 1e-9
        assert 0 <= row["valid"] <= row["num_prompts"] == 2
        speculative = row["engine"] == "eagle3"
        for length in (row["free_accept_length"], row["schema_accept_length"]):
            assert (length is not None) == speculative
            assert length is None or 1.0 <= length <= 4.0  # 3 draft steps
