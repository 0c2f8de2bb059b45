"""The built-in demo model: a tiny random Qwen3 with the tiny chat tokenizer.

Its weights are random, so its text is gibberish; everything around it (loading, tokenizer,
chat template, generation) is the real code path. It is written without torch, once per user.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from sgl_jax import __version__
from sgl_jax.testing.checkpoints import write_tiny_checkpoint

DEMO_PRESET = "qwen3"


def demo_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache / "sgl-jax" / f"demo-model-{__version__}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Write beside the target and rename, so a crash never leaves half a model behind.
        staging = Path(tempfile.mkdtemp(dir=target.parent))
        write_tiny_checkpoint(staging, DEMO_PRESET, backend="numpy", seed=0)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target
