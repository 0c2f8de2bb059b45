"""Tiny random DSpark draft heads in DeepSpec's layout (models/dspark.py)."""

from __future__ import annotations

import json
import os
import shutil
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
    h, v = target_config["hidden_size"], target_config["vocab_size"]
    rng = np.random.default_rng(seed + 1)
    copies = {name: _random(rng, (v, h)) for name in ("embed_tokens.weight", "lm_head.weight")}
    return add_dspark_heads(out, copies, markov_head=markov_head, markov_rank=markov_rank,
                            confidence=confidence,
                            confidence_with_markov=confidence_with_markov, rng=rng)


def dspark_from_dflash(path: str | os.PathLike, dflash_dir: str | os.PathLike,
                       target_dir: str | os.PathLike, *, markov_scale: float = 1.0,
                       seed: int = 0) -> Path:
    """A DSpark head at `path` made of a DFlash head (fitted with fit_dflash_draft's
    anchor_first, DSpark's slot offset): its backbone, the target's own embedding and
    lm_head as the copies, and a random vanilla Markov head scaled by `markov_scale` (small:
    the fitted drafts stay accepted) with a confidence head."""
    out = Path(path)
    shutil.copytree(dflash_dir, out)
    target = load_file(str(Path(target_dir) / "model.safetensors"))
    copies = {"embed_tokens.weight": target["model.embed_tokens.weight"],
              "lm_head.weight": target["lm_head.weight"]}
    return add_dspark_heads(out, copies, markov_head="vanilla", markov_rank=16,
                            confidence=True, confidence_with_markov=True,
                            rng=np.random.default_rng(seed + 1), markov_scale=markov_scale)


def add_dspark_heads(out: Path, copies: dict[str, np.ndarray], *, markov_head: str | None,
                     markov_rank: int, confidence: bool, confidence_with_markov: bool,
                     rng: np.random.Generator, markov_scale: float = 1.0) -> Path:
    """Turn the DFlash head at `out` into DSpark's layout: its config's fields at the top
    level, the embedding and lm_head `copies`, random Markov and confidence heads."""
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
    shapes = {}
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
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update(copies)
    tensors.update({name: _random(rng, shape) * (markov_scale if "markov" in name else 1.0)
                    for name, shape in shapes.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def fit_confidence_head(head: str | os.PathLike, target_dir: str | os.PathLike,
                        prompt_sets: list[list[list[int]]], *, new_tokens: int,
                        steps: int = 300, lr: float = 0.05) -> None:
    """Fit the DSpark head's confidence head (on the backbone's output h_k alone, written
    with confidence_head_with_markov false) by logistic regression to what verification
    would find: for every anchor of the target's greedy continuations of `prompt_sets`
    (each a batch of prompts of one length), whether slot k's lm_head argmax is the target's
    token there (the small Markov term left out). Needs torch."""
    import torch
    from transformers import AutoModelForCausalLM

    from sgl_jax.testing.torch_reference import torch_block_forward

    head = Path(head)
    config = json.loads((head / "config.json").read_text())
    weights = {name: torch.from_numpy(t.copy())
               for name, t in load_file(str(head / "model.safetensors")).items()}
    states, labels = [], []
    with torch.no_grad():
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        for prompts in prompt_sets:
            prompt = torch.tensor(prompts)
            text = target.generate(prompt, max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False)
            hidden = target(text, output_hidden_states=True).hidden_states
            features = torch.cat([hidden[i + 1] for i in config["target_layer_ids"]], -1)
            length = text.shape[1]
            anchors = torch.arange(prompt.shape[1], length - 1)
            drafted = anchors[:, None] + torch.arange(config["block_size"])[None, :] + 1
            valid = drafted < length
            for row in range(text.shape[0]):
                blocks = torch.full(drafted.shape, config["mask_token_id"])
                blocks[:, 0] = text[row, anchors]
                h = torch_block_forward(weights, config, features[row],
                                        weights["embed_tokens.weight"][blocks], anchors)
                guess = (h @ weights["lm_head.weight"].T).argmax(-1)
                states.append(h[valid])
                labels.append((guess == text[row, drafted.clamp(max=length - 1)])[valid])
    x, y = torch.cat(states), torch.cat(labels).float()
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([w, b], lr=lr)
    for _ in range(steps):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tensors = load_file(str(head / "model.safetensors"))
    tensors["confidence_head.proj.weight"] = w.detach().numpy()[None, :].astype(np.float32)
    tensors["confidence_head.proj.bias"] = b.detach().numpy().astype(np.float32)
    save_file(tensors, str(head / "model.safetensors"), metadata={"format": "pt"})
    config["confidence_head_with_markov"] = False
    (head / "config.json").write_text(json.dumps(config, indent=2))
