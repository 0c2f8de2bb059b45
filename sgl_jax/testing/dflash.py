"""Tiny random DFlash draft heads in the z-lab / SpecForge layout (models/dflash.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from sgl_jax.testing.eagle3 import draft_layer_shapes, random_norm_weight


def write_tiny_dflash_draft(
    path: str | os.PathLike,
    target_config: dict[str, Any],
    *,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: tuple[int, ...] = (0, 2),
    mask_token_id: int | None = None,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    seed: int = 0,
) -> Path:
    """A random DFlash head for the target (a Qwen3 config of its widths): fc [H, L*H],
    hidden_norm, norm, and `num_layers` Qwen3 layers with q/k norms. The mask token is the
    last id of the target's vocabulary unless given. `layer_types` ("full_attention" or
    "sliding_attention" per layer; default all full) and `sliding_window` go to config.json
    as given, so a head that lacks a window can be written too."""
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
        layer_types=list(layer_types or ["full_attention"] * num_layers),
        dflash_config={"mask_token_id": (config["vocab_size"] - 1 if mask_token_id is None
                                         else mask_token_id),
                       "target_layer_ids": list(target_layer_ids)})
    if sliding_window is not None:  # transformers' Qwen3Config drops the window without the flag
        config.update(sliding_window=sliding_window, use_sliding_window=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    shapes = {"fc.weight": (h, len(target_layer_ids) * h)}
    for i in range(num_layers):
        shapes.update(draft_layer_shapes(config, f"layers.{i}.", attention_input=h))
    tensors = {name: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
               for name, shape in shapes.items()}
    hd = config["head_dim"]
    norms = {"hidden_norm.weight": h, "norm.weight": h}
    for i in range(num_layers):
        norms.update({f"layers.{i}.input_layernorm.weight": h,
                      f"layers.{i}.post_attention_layernorm.weight": h,
                      f"layers.{i}.self_attn.q_norm.weight": hd,
                      f"layers.{i}.self_attn.k_norm.weight": hd})
    tensors.update({name: random_norm_weight(rng, size) for name, size in norms.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def fit_dflash_draft(
    path: str | os.PathLike,
    target_dir: str | os.PathLike,
    prompts: list[list[int]],
    *,
    new_tokens: int = 48,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: tuple[int, ...] = (0, 2),
    steps: int = 300,
    lr: float = 3e-3,
    gamma: float = 4.0,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    seed: int = 0,
    anchor_first: bool = False,
) -> list[list[int]]:
    """A DFlash head fitted to the target's own greedy continuations of `prompts` (all of one
    length; EOS suppressed, as transformers decodes with min_new_tokens), written to `path`;
    returns those continuations. Needs torch.

    The objective is DFlash's: every position t of the continuation anchors a block [token t,
    MASK ...] that sees the context strictly before t and the whole block; block position k
    learns token t + k, weighted exp(-(k-1) / gamma). `anchor_first`: DSpark's offset
    instead, block position k learning token t + k + 1 (weighted exp(-k / gamma)), for a
    backbone that dspark_from_dflash makes a DSpark head of."""
    import torch
    from transformers import AutoModelForCausalLM

    from sgl_jax.testing.torch_reference import torch_block_forward

    target_dir = Path(target_dir)
    target_config = json.loads((target_dir / "config.json").read_text())
    out = write_tiny_dflash_draft(path, target_config, num_layers=num_layers,
                                  block_size=block_size, target_layer_ids=target_layer_ids,
                                  layer_types=layer_types, sliding_window=sliding_window,
                                  seed=seed)
    config = json.loads((out / "config.json").read_text())
    torch.manual_seed(seed)
    with torch.no_grad():
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        prompt = torch.tensor(prompts)
        text = target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False)
        states = target(text, output_hidden_states=True).hidden_states
        features = torch.cat([states[layer + 1] for layer in target_layer_ids], -1)
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
    weights = {name: torch.nn.Parameter(torch.from_numpy(t.copy()))
               for name, t in _load(out).items()}
    optimizer = torch.optim.Adam(weights.values(), lr=lr)
    length, start = text.shape[1], prompt.shape[1]
    anchors = torch.arange(start, length - 1)  # each continuation token with a next one
    offsets = torch.arange(block_size)
    shift = int(anchor_first)
    labels = anchors[:, None] + offsets[None, :] + shift  # [A, B]: what position k learns
    valid = (labels < length) & (offsets[None, :] + shift > 0)
    weight = torch.exp(-(offsets + shift - 1).clamp(min=0) / gamma)[None, :] * valid
    mask_id = config["dflash_config"]["mask_token_id"]
    blocks = torch.full(labels.shape, mask_id)
    for _ in range(steps):
        loss = 0.0
        for row in range(text.shape[0]):
            row_blocks = blocks.clone()
            row_blocks[:, 0] = text[row, anchors]
            hidden = torch_block_forward(weights, config, features[row], embed[row_blocks],
                                          anchors)
            logits = hidden @ head.T  # [A, B, V]
            targets = text[row, labels.clamp(max=length - 1)]
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                    reduction="none").view(labels.shape)
            loss = loss + (nll * weight).sum() / weight.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    save_file({name: p.detach().numpy() for name, p in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return text[:, start:].tolist()


def _load(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))
