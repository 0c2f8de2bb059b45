"""The transformers peer of the benchmarks runs in a process of its own, with the environment
as it finds it; no benchmark sets a thread count or an OpenMP setting. Tiny random models."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

from sgl_jax.testing import write_tiny_checkpoint

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512,
            num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture
def benchmarks(monkeypatch):
    """Import a benchmark script by name, as its own folder on sys.path lets it."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module


def thread_env_here() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("OMP_", "MKL_", "KMP_", "GOMP_"))}


def test_no_benchmark_changes_threading():
    for path in sorted(BENCH_DIR.glob("*.py")):
        text = path.read_text()
        assert "OMP_WAIT_POLICY" not in text, path.name
        assert "set_num_threads" not in text, path.name


def test_hf_source_opens_a_gguf_from_its_folder(benchmarks):
    peer = benchmarks("transformers_peer")
    assert peer.hf_source("/m/SmolLM2.Q4_1.gguf") == ("/m", {"gguf_file": "SmolLM2.Q4_1.gguf"})
    assert peer.hf_source("/m/checkpoint") == ("/m/checkpoint", {})


def test_model_path_random_and_default(benchmarks, monkeypatch):
    bench = benchmarks("bench_one_batch")
    assert bench.model_or_demo("random") is None
    assert bench.model_or_demo("/some/dir") == "/some/dir"
    monkeypatch.setattr(bench, "demo_model_path", lambda: Path("/demo/model.gguf"))
    assert bench.model_or_demo(None) == "/demo/model.gguf"


def test_peer_throughput_in_its_own_process(benchmarks, tmp_path):
    peer = benchmarks("transformers_peer")
    write_tiny_checkpoint(tmp_path, "llama", backend="numpy", with_tokenizer=False, **TINY)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    result = peer.run_peer({"task": "throughput", "model_path": str(tmp_path),
                            "dtype": "float32", "output_len": 3, "concurrency": 2,
                            "prompts": prompts})
    assert result["requests"] == 3 and result["batches"] == 2
    assert [len(t) for t in result["tokens"]] == [3, 3, 3]
    assert result["environment"]["pid"] != os.getpid()
    assert result["environment"]["thread_env"] == thread_env_here()


def test_bench_one_batch_against_the_peer(benchmarks, tmp_path, capsys):
    bench = benchmarks("bench_one_batch")
    out = tmp_path / "bench.json"
    report = bench.main([
        "--model-path", "random", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--hidden-size", "64", "--intermediate-size", "128", "--num-layers", "2",
        "--vocab-size", "512", "--num-heads", "2", "--num-kv-heads", "2",
        "--batch-sizes", "1,2", "--input-len", "16", "--output-len", "4", "--repeats", "1",
        "--warmup", "1", "--bandwidth-gib", "0.01", "--transformers-batch-sizes", "1,2",
        "--json", str(out)])
    hf = report["transformers"]
    assert hf["environment"]["pid"] != os.getpid()
    assert hf["environment"]["thread_env"] == thread_env_here()
    assert sorted(hf["by_batch"]) == [1, 2]
    assert report["summary"]["greedy_tokens_agree_batch1"] == 1.0
    assert report["summary"]["greedy_tokens_agree_batch2"] == 1.0
    assert "omp" not in json.dumps(report["machine"]).lower()
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(report["summary"]))
    assert "transformers: own process" in capsys.readouterr().out


def test_bench_one_batch_on_a_hybrid_target_agrees_with_the_peer(benchmarks, tmp_path):
    """Qwen3-Next: each sequence decodes from its own recurrent-state slot; greedy tokens
    equal transformers'; the dense-only weight-product floor is left out (nan)."""
    bench = benchmarks("bench_one_batch")
    path = write_tiny_checkpoint(tmp_path / "hybrid", "qwen3_next", backend="torch")
    report = bench.main([
        "--model-path", str(path), "--batch-sizes", "1,2", "--input-len", "16",
        "--output-len", "4", "--repeats", "1", "--warmup", "1", "--bandwidth-gib", "0.01",
        "--transformers-batch-sizes", "1,2"])
    assert report["summary"]["greedy_tokens_agree_batch1"] == 1.0
    assert report["summary"]["greedy_tokens_agree_batch2"] == 1.0
    assert all(r["products_ms"] != r["products_ms"] for r in report["results"])  # nan
    assert all(r["recompilations_while_timed"] == 0 for r in report["results"])
