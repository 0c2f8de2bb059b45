"""benchmark/bench_speculative.py end to end on a tiny random target: rows for every shape and
batch size, acceptance figures consistent with each other, JSON and PNG written."""

from __future__ import annotations

import json

from sgl_jax.testing.benchmarks import load_benchmark


def load_bench():
    return load_benchmark("bench_speculative")


def test_bench_speculative_reports_every_shape_and_batch_size(tmp_path, capsys):
    bench = load_bench()
    out_json, out_png = tmp_path / "spec.json", tmp_path / "spec.png"
    code = bench.main(["--hidden-size", "64", "--num-layers", "2", "--batch-sizes", "1,2",
                       "--input-len", "16", "--output-len", "12", "--draft", "noisy-copy",
                       "--output-json", str(out_json), "--output-png", str(out_png)])
    assert code == 0
    rows = json.loads(out_json.read_text())
    assert [(r["shape"], r["batch_size"]) for r in rows] == [
        ("chain", 1), ("chain", 2), ("tree", 1), ("tree", 2)]
    for row in rows:
        steps = 5 if row["shape"] == "chain" else 3
        draft_tokens = 6 if row["shape"] == "chain" else 8
        assert len(row["position_rates"]) == steps
        assert 1.0 <= row["accept_length"] <= steps + 1
        assert abs(row["accept_rate"] - row["accept_length"] / draft_tokens) < 1e-9
        assert abs(row["speedup"] - row["speculative_tok_s"] / row["baseline_tok_s"]) < 1e-9
        # rates of later positions can only be lower: a position needs all before it
        assert row["position_rates"] == sorted(row["position_rates"], reverse=True)
        assert abs(sum(row["position_rates"]) + 1 - row["accept_length"]) < 1e-9
        assert row["num_prompts"] == row["batch_size"] and row["outputs_differing"] == 0
    assert any(row["accept_length"] > 1.5 for row in rows)  # the near copy is accepted
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "baseline tok/s" in printed and printed.count("\nrandom    chain") == 2
    replotted = tmp_path / "again.png"
    assert bench.main(["--replot", str(out_json), str(out_json), "--output-png",
                       str(replotted)]) == 0
    assert replotted.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_speculative_reports_the_adaptive_policy_rounds(tmp_path):
    out_json = tmp_path / "adaptive.json"
    assert load_bench().main(["--hidden-size", "64", "--num-layers", "4", "--batch-sizes", "2",
                              "--input-len", "16", "--output-len", "12", "--shapes", "adaptive",
                              "--repeats", "2", "--output-json", str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())
    assert row["shape"] == "adaptive" and row["outputs_differing"] == 0
    assert set(row["rounds_by_shape"]) == {"plain", "1/1/2", "3/1/4", "3/4/8"}
    assert sum(row["rounds_by_shape"].values()) >= 11  # 12 tokens, at most one per plain round
    # the batch's two requests, in the untimed warm-up before the paired run and in each of
    # the two timed passes, every output compared with plain decoding's
    assert sum(row["finished_requests"].values()) == 6
    assert len(row["repeat_speedups"]) == 2 and all(x > 0 for x in row["repeat_speedups"])


def test_random_word_requests_draw_whole_words_from_the_vocabulary(tmp_path):
    from sgl_jax.testing.tokenizer import write_tiny_tokenizer

    tokenizer = write_tiny_tokenizer(tmp_path)
    requests = load_bench().random_word_requests(tokenizer, 3, seed=0)
    assert len(requests) == 3 and len(set(requests)) == 3
    words = requests[0].split(": ", 1)[1].split(", ")
    assert len(words) == 40 and all(w.isalpha() and len(w) >= 4 for w in words)
