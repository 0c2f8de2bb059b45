"""What the wheel ships: the product package and the demo's head, no test support."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_leaves_test_support_out(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and egg-info beside it
    shutil.copytree(ROOT / "sgl_jax", source / "sgl_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", str(source), "-w", str(tmp_path / "dist")], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sgl_jax/entrypoints/engine.py" in names
    assert any(n.startswith("sgl_jax/assets/") and n.endswith(".safetensors") for n in names)
    assert not [n for n in names if n.startswith("sgl_jax/testing/")]
