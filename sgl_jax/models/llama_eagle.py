"""The EAGLE (v1 / v2) draft head: fc over [token embedding ; target's last hidden state],
then Llama decoder layers whose first has no input norm, then the target's lm_head.

Checkpoints (the EAGLE reference code, SGLang's LlamaForCausalLMEagle): a Llama config.json
(usually one layer) and the tensors
    fc.weight [H, 2H] (optional fc.bias), layers.{i}.self_attn.{q,k,v,o}_proj.weight,
    layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.post_attention_layernorm.weight,
    layers.{i}.input_layernorm.weight for i > 0 (layer 0's is unused when saved),
    optional embed_tokens.weight (else the target's embedding is shared),
with or without a leading `model.`. There is no final norm: the draft's output goes straight
into the target's lm_head, and is fed back into fc as the next step's hidden state.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, ModelCache
from sgl_jax.layers.norm import rms_norm
from sgl_jax.layers.quantization import embedding_rows
from sgl_jax.layers.rotary import inverse_frequencies, rope_cos_sin
from sgl_jax.layers.weights import WeightSpec
from sgl_jax.models import llama
from sgl_jax.models.config import ModelConfig, dense_config_from_hf

Params = dict[str, Any]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return dense_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"]})


def hf_weight_specs(config: ModelConfig, names: Collection[str]
                    ) -> tuple[dict[str, WeightSpec], frozenset[str]]:
    """(specs, ignored names) in whichever spelling `names` uses."""
    prefix = "model." if any(n.startswith("model.layers.") for n in names) else ""
    h = config.hidden_size
    specs = {prefix + "fc.weight": WeightSpec(("fc",), (h, 2 * h))}
    if prefix + "fc.bias" in names:
        specs[prefix + "fc.bias"] = WeightSpec(("fc_bias",), (h,))
    if prefix + "embed_tokens.weight" in names:
        specs[prefix + "embed_tokens.weight"] = WeightSpec(("embed",), (config.vocab_size, h))
    for i in range(config.num_layers):
        for name, spec in llama.layer_weight_specs(config, i).items():
            specs[prefix + name.removeprefix("model.")] = spec
    unused_norm = prefix + "layers.0.input_layernorm.weight"
    del specs[unused_norm]
    return specs, frozenset({unused_norm})


def forward(
    params: Params,
    kv_cache: ModelCache,
    input_ids: jax.Array,  # i32[T]: token t + 1 for feature t
    positions: jax.Array,  # i32[T]
    features: jax.Array,  # f[T, H]: the target's final (normed) hidden state, or the draft's
    metadata: AttentionMetadata,
    *,
    config: ModelConfig,
    attention: AttentionBackend,
    embed: jax.Array,  # [V, H]
) -> tuple[jax.Array, ModelCache]:
    """Returns the draft's output f[T, H] (logits = target lm_head of it) and its cache."""
    tokens = embedding_rows(embed, input_ids)
    x = llama.matmul_rows(jnp.concatenate([tokens, features], axis=-1), params["fc"])
    if "fc_bias" in params:
        x = x + params["fc_bias"]
    cos, sin = rope_cos_sin(positions, inverse_frequencies(config.rope, config.head_dim))
    for i, layer in enumerate(params["layers"]):
        normed = x if i == 0 else rms_norm(x, layer["input_norm"], config.rms_norm_eps)
        attn_out, layer_kv = llama.self_attention(layer, normed, cos, sin, kv_cache.layer(i),
                                                  metadata, config, attention)
        x = x + attn_out
        x = x + llama.mlp(layer, rms_norm(x, layer["post_norm"], config.rms_norm_eps))
        kv_cache = kv_cache.with_layer(i, layer_kv)
    return x, kv_cache
