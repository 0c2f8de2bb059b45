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
) -> list[list[int]]:
    """A DFlash head fitted to the target's own greedy continuations of `prompts` (all of one
    length; EOS suppressed, as transformers decodes with min_new_tokens), written to `path`;
    returns those continuations. Needs torch.

    The objective is DFlash's: every position t of the continuation anchors a block [token t,
    MASK ...] that sees the context strictly before t and the whole block; block position k
    learns token t + k, weighted exp(-(k-1) / gamma)."""
    import torch
    from transformers import AutoModelForCausalLM

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
    labels = anchors[:, None] + offsets[None, :]  # [A, B]: what block position k learns
    valid = (labels < length) & (offsets[None, :] > 0)
    weight = torch.exp(-(offsets.clamp(min=1) - 1) / gamma)[None, :] * valid
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


def torch_block_forward(w: dict, config: dict, features: Any, block_embeds: Any,
                         anchors: Any) -> Any:
    """Blocks [A, B, H] anchored at positions `anchors` [A] over one sequence's context
    features [L, F] -> the final-normed block states [A, B, H] (torch, for fitting)."""
    import torch

    from sgl_jax.testing.torch_reference import rms_norm, rope

    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    heads, kv_heads, hd = (config["num_attention_heads"], config["num_key_value_heads"],
                           config["head_dim"])
    num_blocks, width, h = block_embeds.shape
    ctx_len = features.shape[0]
    c = rms_norm(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos = torch.arange(ctx_len)
    blk_pos = (anchors[:, None] + torch.arange(width)[None, :]).reshape(-1)
    # Query (a, k) sees context before anchor a and every key of block a.
    sees_ctx = ctx_pos[None, :] < anchors.repeat_interleave(width)[:, None]  # [A*B, L]
    block_of = torch.arange(num_blocks).repeat_interleave(width)
    sees_blk = block_of[:, None] == block_of[None, :]  # [A*B, A*B]
    visible = torch.cat([sees_ctx, sees_blk], 1)
    # A sliding layer also hides keys W or more positions behind the query.
    behind = blk_pos[:, None] - torch.cat([ctx_pos, blk_pos])[None, :]  # [A*B, L + A*B]
    x = block_embeds.reshape(-1, h)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        layer_visible = visible
        if config["layer_types"][i] == "sliding_attention":
            layer_visible = visible & (behind < config["sliding_window"])

        def project(t, name, count, p=p):
            return (t @ w[p + f"self_attn.{name}_proj.weight"].T).view(t.shape[0], count, hd)

        a = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = rope(rms_norm(project(a, "q", heads), w[p + "self_attn.q_norm.weight"], eps),
                 blk_pos, theta)
        k = torch.cat([rope(rms_norm(project(src, "k", kv_heads),
                                     w[p + "self_attn.k_norm.weight"], eps), pos, theta)
                       for src, pos in ((c, ctx_pos), (a, blk_pos))])
        v = torch.cat([project(c, "v", kv_heads), project(a, "v", kv_heads)])
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        scores = scores.masked_fill(~layer_visible[None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(x.shape[0], -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["norm.weight"], eps).view(num_blocks, width, h)
