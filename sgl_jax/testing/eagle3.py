"""Tiny random EAGLE3 draft heads in the SpecForge / SGLang checkpoint layout, for a target
written by `write_tiny_checkpoint`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from sgl_jax.testing.checkpoints import NORM_WEIGHT_STD


def write_tiny_eagle3_draft(
    path: str | os.PathLike,
    target_config: dict[str, Any],
    *,
    draft_vocab_size: int | None = None,
    layer_prefix: str = "midlayer.",
    d2t_name: str = "d2t",
    with_embed: bool = False,
    with_lm_head: bool = True,
    aux_layer_ids: list[int] | None = None,
    rope_theta: float | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 96,
    seed: int = 0,
) -> Path:
    """A random draft whose hidden size is the target's (as in SpecForge). `target_config` is
    the target's config.json. Without `rope_theta` the config leaves it out (theta 10000)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    vocab, hidden = target_config["vocab_size"], target_config["hidden_size"]
    head_dim = hidden // num_heads
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": hidden, "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab,
        "target_hidden_size": hidden, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "max_position_embeddings": target_config.get("max_position_embeddings", 512),
        "tie_word_embeddings": False,
    }
    if draft_vocab_size is not None:
        config["draft_vocab_size"] = draft_vocab_size
    if rope_theta is not None:
        config["rope_theta"] = rope_theta
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = _random_tensors(config, draft_vocab_size or vocab, layer_prefix, with_embed,
                              with_lm_head, seed)
    if draft_vocab_size is not None:
        tensors.update(_vocab_maps(vocab, draft_vocab_size, d2t_name, seed))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _random_tensors(config: dict, draft_vocab: int, prefix: str, with_embed: bool,
                    with_lm_head: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h = config["hidden_size"]
    shapes = {"fc.weight": (h, 3 * config["target_hidden_size"]),
              **draft_layer_shapes(config, prefix, attention_input=2 * h)}
    if with_embed:
        shapes["embed_tokens.weight"] = (config["vocab_size"], h)
    if with_lm_head:
        shapes["lm_head.weight"] = (draft_vocab, h)
    # Scaled so activations stay near unit size through the layer.
    tensors = {name: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
               for name, shape in shapes.items()}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"{prefix}{norm}.weight"] = random_norm_weight(rng, h)
    tensors["norm.weight"] = random_norm_weight(rng, h)
    return tensors


def draft_layer_shapes(config: dict, prefix: str, *, attention_input: int
                  ) -> dict[str, tuple[int, int]]:
    """Projection weight shapes of one Llama decoder layer whose q/k/v read
    `attention_input` features."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    return {
        f"{prefix}self_attn.q_proj.weight": (q, attention_input),
        f"{prefix}self_attn.k_proj.weight": (kv, attention_input),
        f"{prefix}self_attn.v_proj.weight": (kv, attention_input),
        f"{prefix}self_attn.o_proj.weight": (h, q),
        f"{prefix}mlp.gate_proj.weight": (inter, h),
        f"{prefix}mlp.up_proj.weight": (inter, h),
        f"{prefix}mlp.down_proj.weight": (h, inter),
    }


def random_norm_weight(rng: np.random.Generator, size: int) -> np.ndarray:
    return (1 + NORM_WEIGHT_STD * rng.standard_normal(size)).astype(np.float32)


def _vocab_maps(vocab: int, draft_vocab: int, d2t_name: str, seed: int
                ) -> dict[str, np.ndarray]:
    """A random sorted subset of target ids as the draft vocabulary: d2t holds offsets
    (target = draft + d2t[draft]); t2d marks the subset (training only)."""
    rng = np.random.default_rng(seed + 1)
    target_ids = np.sort(rng.choice(vocab, draft_vocab, replace=False))
    t2d = np.zeros(vocab, bool)
    t2d[target_ids] = True
    return {d2t_name: (target_ids - np.arange(draft_vocab)).astype(np.int64), "t2d": t2d}


def write_tiny_eagle_draft(
    path: str | os.PathLike,
    target_config: dict[str, Any],
    *,
    num_layers: int = 1,
    with_fc_bias: bool = True,
    with_embed: bool = False,
    model_prefix: str = "",
    seed: int = 0,
) -> Path:
    """A random EAGLE (v1 / v2) draft head for the target: a Llama config of the target's
    widths and the tensors fc [H, 2H] (+ bias), layers.{i}.* (no input norm in layer 0),
    optional embed_tokens; `model_prefix` "model." spells them as some exports do."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {key: target_config[key] for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_theta")
        if key in target_config}
    config.update(architectures=["LlamaForCausalLM"], num_hidden_layers=num_layers,
                  head_dim=target_config.get("head_dim", config["hidden_size"]
                                             // config["num_attention_heads"]),
                  hidden_act="silu", tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    h = config["hidden_size"]
    shapes = {"fc.weight": (h, 2 * h)}
    for i in range(num_layers):
        shapes.update(draft_layer_shapes(config, f"layers.{i}.", attention_input=h))
    if with_embed:
        shapes["embed_tokens.weight"] = (config["vocab_size"], h)
    tensors = {name: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
               for name, shape in shapes.items()}
    if with_fc_bias:
        tensors["fc.bias"] = (0.1 * rng.standard_normal(h)).astype(np.float32)
    for i in range(num_layers):
        tensors[f"layers.{i}.post_attention_layernorm.weight"] = random_norm_weight(rng, h)
        if i > 0:
            tensors[f"layers.{i}.input_layernorm.weight"] = random_norm_weight(rng, h)
    tensors = {model_prefix + name: t for name, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def cached_draft_keys(engine: Any, token_ids: list[int]) -> np.ndarray:
    """f32[T, heads, dim]: the draft's first-layer keys that an Engine's prefix cache holds
    for the full pages of token_ids it matches (T tokens)."""
    match = engine.runtime.scheduler.cache.radix.match_prefix(token_ids)
    first = engine.runtime.spec_runner.draft_state.kv.layer(0)
    pages = first.first_page + np.asarray(match.page_ids, np.int64)
    keys = np.asarray(first.k)[pages]  # [pages, heads, page, dim]
    return keys.transpose(0, 2, 1, 3).reshape(match.num_tokens, *keys.shape[1::2])
