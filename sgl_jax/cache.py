"""The per-user cache directory: converted checkpoint metadata and compiled programs live here."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/sgl-jax, or ~/.cache/sgl-jax."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sgl-jax"
