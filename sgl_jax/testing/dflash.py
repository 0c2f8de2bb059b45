"""Tiny random DFlash draft heads in the z-lab / SpecForge layout (models/dflash.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from sgl_jax.testing.eagle3 import _layer_shapes, _norm_weight


def write_tiny_dflash_draft(
    path: str | os.PathLike,
    target_config: dict[str, Any],
    *,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: tuple[int, ...] = (0, 2),
    mask_token_id: int | None = None,
    seed: int = 0,
) -> Path:
    """A random DFlash head for the target (a Qwen3 config of its widths): fc [H, L*H],
    hidden_norm, norm, and `num_layers` Qwen3 layers with q/k norms. The mask token is the
    last id of the target's vocabulary unless given."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    h = target_config["hidden_size"]
    config = {key: target_config[key] for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "rms_norm_eps", "max_position_embeddings")
        if key in target_config}
    rope = target_config.get("rope_parameters") or {}
    config.update(
        rope_theta=target_config.get("rope_theta", rope.get("rope_theta", 10000.0)),
        architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=num_layers,
        head_dim=target_config.get("head_dim", h // config["num_attention_heads"]),
        hidden_act="silu", tie_word_embeddings=False, block_size=block_size,
        num_target_layers=target_config["num_hidden_layers"],
        layer_types=["full_attention"] * num_layers,
        dflash_config={"mask_token_id": (config["vocab_size"] - 1 if mask_token_id is None
                                         else mask_token_id),
                       "target_layer_ids": list(target_layer_ids)})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    shapes = {"fc.weight": (h, len(target_layer_ids) * h)}
    for i in range(num_layers):
        shapes.update(_layer_shapes(config, f"layers.{i}.", attention_input=h))
    tensors = {name: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
               for name, shape in shapes.items()}
    hd = config["head_dim"]
    norms = {"hidden_norm.weight": h, "norm.weight": h}
    for i in range(num_layers):
        norms.update({f"layers.{i}.input_layernorm.weight": h,
                      f"layers.{i}.post_attention_layernorm.weight": h,
                      f"layers.{i}.self_attn.q_norm.weight": hd,
                      f"layers.{i}.self_attn.k_norm.weight": hd})
    tensors.update({name: _norm_weight(rng, size) for name, size in norms.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
