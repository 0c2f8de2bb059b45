"""benchmark/gpu_suite.sh's `first` stage list, run on this CPU at tiny sizes: its first parts
finish and write their figures, so a GPU's minutes are not spent on a broken command."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_first_parts_run_on_a_cpu_and_write_their_figures(tmp_path):
    env = {**os.environ, "GPU_SUITE_TINY": "1", "FIRST_PARTS": "overhead attention",
           "CKPT_DIR": str(tmp_path / "checkpoints"),
           # the suite calls `python3`: this interpreter, with its packages
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "benchmark" / "gpu_suite.sh"), str(out), "first"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "first.log").read_text()
    assert "--- overhead: exit 0" in log and "--- attention: exit 0" in log
    assert "llama8b" not in log  # parts not named in FIRST_PARTS do not run

    overhead = json.loads((out / "first_overhead.json").read_text())["rows"]
    assert [(row["model"], row["batch"]) for row in overhead] == [("tiny", 1), ("tiny", 4)]
    # Its 8 timed steps were counted; the figures are differences of two timed runs, which a
    # busy 2-core host can push below zero at these sizes, so only their presence is checked.
    assert all(row["decode_kernels"] > 0 and row["steps"] == 8 for row in overhead)
    assert all(math.isfinite(row[key]) for row in overhead
               for key in ("engine_ms", "device_ms", "floor_ms"))

    [attention] = json.loads((out / "first_attention.json").read_text())["rows"]
    # Our kernel and JAX's, both against the reference on the same decode problem.
    assert attention["max_abs_diff"] < 1e-4 and attention["peer_max_abs_diff"] < 1e-4
    assert attention["peer_ms"] > 0 and attention["batch"] == 2


def test_unknown_stage_fails(tmp_path):
    done = subprocess.run(["bash", str(REPO / "benchmark" / "gpu_suite.sh"), str(tmp_path),
                           "firsst"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown stage firsst" in done.stdout
