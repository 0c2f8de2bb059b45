"""benchmark/bench_layer_scan.py on a tiny random Llama: the scanned stack computes the
unrolled one's logits (the script checks every row), and every figure is measured."""

from __future__ import annotations

import json

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.benchmarks import load_benchmark


def test_the_scanned_stack_agrees_with_the_unrolled_one_and_is_measured(tmp_path):
    target = write_tiny_checkpoint(tmp_path / "target", "llama", backend="numpy")
    out = tmp_path / "scan.json"
    load_benchmark("bench_layer_scan").main([
        "--model-path", str(target), "--batch-sizes", "1,2", "--steps", "1", "--context", "40",
        "--prefill-len", "24", "--json", str(out)])
    results = json.loads(out.read_text())
    for variant in ("unrolled", "scanned"):
        rows = results["host"][variant]
        assert list(rows) == ["prefill", "decode bs1", "decode bs2"]
        for row in rows.values():
            assert row["executable_mb"] > 0 and row["step_ms"] > 0 and row["compile_s"] > 0
    lowered = results["accelerators"]
    assert len(lowered) == 2 * 2 * 2 and all(seconds > 0 for seconds in lowered.values())
