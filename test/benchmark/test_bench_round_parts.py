"""benchmark/bench_round_parts.py on a tiny random target and head: one row per shape and batch
size whose parts add up, and draft trees that fit their shape."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.benchmarks import load_benchmark
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft


def load_bench():
    return load_benchmark("bench_round_parts")


@pytest.mark.parametrize("steps,topk,tokens", [(5, 1, 6), (3, 4, 8), (2, 2, 7), (3, 2, 9)])
def test_trees_fit_their_shape(steps, topk, tokens):
    parents = load_bench()._tree_parents(steps, topk, tokens)
    depths = np.zeros(tokens, int)
    for i, parent in enumerate(parents[1:], start=1):
        assert 0 <= parent < i
        depths[i] = depths[parent] + 1
    assert depths.max() <= steps
    assert np.bincount(parents[1:]).max() <= topk


def test_a_shape_too_deep_for_its_steps_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        load_bench()._tree_parents(2, 1, 6)


def timed_rows(tmp_path, preset: str, *args: str, **target_overrides) -> list[dict]:
    """Run the benchmark on a tiny random target of `preset` and a random EAGLE3 head."""
    target = write_tiny_checkpoint(tmp_path / "target", preset, backend="numpy",
                                   **target_overrides)
    config = json.loads((target / "config.json").read_text())
    draft = write_tiny_eagle3_draft(tmp_path / "draft", config)
    out = tmp_path / "parts.json"
    assert load_bench().main([
        "--model-path", str(target), "--draft-model-path", str(draft), "--context", "20",
        "--dtype", "float32", "--output-json", str(out), *args]) == 0
    return json.loads(out.read_text())["rows"]


def test_every_shape_and_batch_size_is_timed_in_parts(tmp_path, capsys):
    rows = timed_rows(tmp_path, "llama", "--shapes", "2/2/4,plain", "--batch-sizes", "1,2",
                      "--repeats", "2", hidden_size=64, num_hidden_layers=4)
    assert [(r["shape"], r["batch_size"]) for r in rows] == [
        ("2/2/4", 1), ("2/2/4", 2), ("0/1/1", 1), ("0/1/1", 2)]
    for row in rows:
        assert min(row["decode_ms"], row["verify_ms"], row["draft_ms"],
                   row["round_device_ms"]) > 0
        assert row["host_ms"] == pytest.approx(row["round_ms"] - row["round_device_ms"])
        # a plain round leaves the draft to a catch-up, whose share (draft_ms) it owes
        owed = row["draft_ms"] if row["shape"] == "0/1/1" else 0.0
        assert row["break_even_accept_length"] == pytest.approx(
            (row["round_ms"] + owed) / row["decode_ms"])
    assert "break-even accept len" in capsys.readouterr().out


def test_a_hybrid_target_is_timed_with_its_state_slots(tmp_path):
    [row] = timed_rows(tmp_path, "qwen3_next", "--shapes", "2/2/4", "--batch-sizes", "2",
                       "--repeats", "1")
    assert row["shape"] == "2/2/4" and row["verify_ms"] > 0 and row["draft_ms"] > 0
