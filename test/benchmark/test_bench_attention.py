"""benchmark/bench_attention.py on the CPU: it runs the interpreted kernel and the reference,
reports their agreement, and counts bytes and FLOPs right."""

from __future__ import annotations

import json

import pytest

from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.testing.benchmarks import load_benchmark


def load_bench():
    return load_benchmark("bench_attention")


bench = load_bench()


def test_reports_kernel_against_reference(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = bench.main(["--batch-sizes", "2", "--context-lens", "40", "--page-sizes", "16",
                       "--prefill-len", "20", "--repeats", "1", "--peak-gbs", "100",
                       "--json", str(out)])
    assert [r["mode"] for r in rows] == ["decode", "prefill"]
    for row in rows:
        assert row["max_abs_diff"] < 1e-4
        assert row["kernel_ms"] > 0 and row["reference_ms"] > 0
    assert rows[0]["share_of_peak"] == pytest.approx(rows[0]["kernel_gbs"] / 100)
    assert rows[1]["kernel_tflops"] > 0
    assert json.loads(out.read_text())["rows"] == rows
    assert "interpreted" in capsys.readouterr().out


def test_counts_visible_pairs_and_bytes():
    # A 3-token chunk after 5 cached tokens sees 6, 7 and 8 keys; a decode token sees 10.
    chunks = [SeqChunk([0, 0, 0], 5, [1]), SeqChunk([0], 9, [2])]
    assert bench.visible_pairs(chunks) == 6 + 7 + 8 + 10
    args = bench.parse_args(["--num-kv-heads", "2", "--head-dim", "4", "--dtype", "float32"])

    class FakeQ:
        nbytes = 100

    # K and V of 8 + 10 tokens, 2 heads of 4 floats each, plus q and the output.
    assert bench.bytes_read(args, chunks, FakeQ()) == 2 * 18 * 2 * 4 * 4 + 200


def test_rejects_an_unknown_mode():
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "decode,verify"])
