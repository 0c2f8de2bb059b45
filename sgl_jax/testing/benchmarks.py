"""Import a script of the source tree's benchmark/ directory as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARK_DIR = Path(__file__).resolve().parents[2] / "benchmark"


def load_benchmark(name: str) -> ModuleType:
    """benchmark/<name>.py as a fresh module, registered in sys.modules (dataclasses look their
    module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARK_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
