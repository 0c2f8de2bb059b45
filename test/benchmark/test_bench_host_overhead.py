"""bench_host_overhead on the tiny model: it runs, times every part, and writes its JSON."""

import json

from sgl_jax.testing.benchmarks import load_benchmark


def test_tiny_rows_print_and_save(tmp_path, capsys):
    bench = load_benchmark("bench_host_overhead")
    out = tmp_path / "overhead.json"
    rows = bench.main(["--rows", "tiny", "--tiny-batch-sizes", "2", "--steps", "8",
                       "--short", "4", "--json", str(out)])
    assert [(r["model"], r["batch"]) for r in rows] == [("tiny", 2)]
    row = rows[0]
    assert row["steps"] == 8  # the long run took exactly --steps more decode steps
    assert all(row[k] > 0 for k in ("engine_ms", "device_ms", "floor_ms"))
    assert json.loads(out.read_text())["rows"] == rows
    assert "| tiny | decode | 2 |" in capsys.readouterr().out
