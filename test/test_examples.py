"""The runnable examples in python/ and the README's promises."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_offline_engine_example_runs_on_the_demo_model(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    result = subprocess.run(
        [sys.executable, str(ROOT / "python" / "offline_engine.py"), "--max-new-tokens", "4"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("4 tokens, finish: {'type': 'length', 'length': 4}") == 2
    assert (tmp_path / "sgl-jax").is_dir()  # the demo model was written to the user cache


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci_lines if "pytest" in line)
    readme_commands = re.findall(r"^(python3 -m venv .*)$", (ROOT / "README.md").read_text(), re.M)
    assert len(readme_commands) == 2
    assert command in readme_commands
