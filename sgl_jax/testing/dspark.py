"""Tiny random DSpark draft heads in DeepSpec's layout (models/dspark.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from sgl_jax.testing.dflash import write_tiny_dflash_draft


def write_tiny_dspark_draft(
    path: str | os.PathLike,
    target_config: dict[str, Any],
    *,
    markov_head: str | None = "vanilla",
    markov_rank: int = 16,
    confidence: bool = True,
    confidence_with_markov: bool = True,
    block_size: int = 8,
    seed: int = 0,
    **dflash_args: Any,
) -> Path:
    """A random DSpark head for the target: a tiny DFlash backbone (write_tiny_dflash_draft,
    its fields moved to the top level as DeepSpec writes them), random embed_tokens and
    lm_head copies, the Markov head `markov_head` of rank `markov_rank` (None: none) and a
    confidence head."""
    out = write_tiny_dflash_draft(path, target_config, block_size=block_size, seed=seed,
                                  **dflash_args)
    config = json.loads((out / "config.json").read_text())
    config.update(config.pop("dflash_config"), architectures=["Qwen3DSparkModel"],
                  markov_rank=markov_rank if markov_head else 0,
                  enable_confidence_head=confidence)
    if markov_head:
        config["markov_head_type"] = markov_head
    if confidence:
        config["confidence_head_with_markov"] = confidence_with_markov and bool(markov_head)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    h, v, r = config["hidden_size"], config["vocab_size"], markov_rank
    shapes = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h)}
    if markov_head:
        shapes.update({"markov_head.markov_w1.weight": (v, r),
                       "markov_head.markov_w2.weight": (v, r)})
    if markov_head == "gated":
        shapes.update({"markov_head.gate_proj.weight": (r, h + r),
                       "markov_head.gate_proj.bias": (r,)})
    if markov_head == "rnn":
        shapes.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + h),
                       "markov_head.joint_proj.bias": (3 * r,)})
    if confidence:
        width = h + (r if markov_head and confidence_with_markov else 0)
        shapes.update({"confidence_head.proj.weight": (1, width),
                       "confidence_head.proj.bias": (1,)})
    rng = np.random.default_rng(seed + 1)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update({name: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
                    for name, shape in shapes.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
