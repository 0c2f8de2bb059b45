"""The dense Llama-style decoder shared by Llama, Qwen2 and Qwen3.

Parameters are a plain pytree:
    {"embed": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
     "layers": [{"input_norm": [H], "w_qkv": [(nq + 2*nkv)*hd, H], "w_o": [H, nq*hd],
                 "post_norm": [H], "w_gate_up": [2*I, H], "w_down": [H, I],
                 optional "b_qkv"/"b_o"/"b_gate_up"/"b_down" biases,
                 optional "q_norm"/"k_norm": [hd]}, ...]}
Matrices keep the checkpoint's [out, in] layout: XLA streams a matrix-vector product over
contiguous rows faster than over columns, which is what decode is made of. q|k|v and gate|up
are fused at load time: one larger product streams faster than several small ones.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, LayerKV
from sgl_jax.layers.norm import rms_norm
from sgl_jax.layers.rotary import apply_rope, inverse_frequencies, rope_cos_sin
from sgl_jax.models.config import ModelConfig, dense_config_from_hf
from sgl_jax.models.weights import WeightSpec

ARCHITECTURES = ("LlamaForCausalLM",)
Params = dict[str, Any]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return dense_config_from_hf(hf)


def hf_weight_specs(config: ModelConfig) -> dict[str, WeightSpec]:
    """Every tensor a Hugging Face checkpoint of this config holds, keyed by its name."""
    h, v = config.hidden_size, config.vocab_size
    specs = {
        "model.embed_tokens.weight": WeightSpec(("embed",), (v, h)),
        "model.norm.weight": WeightSpec(("norm",), (h,)),
    }
    if not config.tie_word_embeddings:
        specs["lm_head.weight"] = WeightSpec(("lm_head",), (v, h))
    for i in range(config.num_layers):
        specs.update(_layer_weight_specs(config, i))
    return specs


def _layer_weight_specs(config: ModelConfig, i: int) -> dict[str, WeightSpec]:
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.q_size, config.kv_size
    # hf module -> (our name, in features, out features, has bias, rows in the fused matrix)
    linears = {
        "self_attn.q_proj": ("_qkv", h, q, config.qkv_bias, (0, q)),
        "self_attn.k_proj": ("_qkv", h, kv, config.qkv_bias, (q, q + kv)),
        "self_attn.v_proj": ("_qkv", h, kv, config.qkv_bias, (q + kv, q + 2 * kv)),
        "self_attn.o_proj": ("_o", q, h, config.o_bias, None),
        "mlp.gate_proj": ("_gate_up", h, inter, config.mlp_bias, (0, inter)),
        "mlp.up_proj": ("_gate_up", h, inter, config.mlp_bias, (inter, 2 * inter)),
        "mlp.down_proj": ("_down", inter, h, config.mlp_bias, None),
    }
    prefix = f"model.layers.{i}."
    specs = {
        prefix + "input_layernorm.weight": WeightSpec(("layers", i, "input_norm"), (h,)),
        prefix + "post_attention_layernorm.weight": WeightSpec(("layers", i, "post_norm"), (h,)),
    }
    for module, (name, in_features, out_features, has_bias, rows) in linears.items():
        specs[f"{prefix}{module}.weight"] = WeightSpec(
            ("layers", i, "w" + name), (out_features, in_features), rows
        )
        if has_bias:
            specs[f"{prefix}{module}.bias"] = WeightSpec(
                ("layers", i, "b" + name), (out_features,), rows
            )
    if config.qk_norm:
        hd = config.head_dim
        specs[prefix + "self_attn.q_norm.weight"] = WeightSpec(("layers", i, "q_norm"), (hd,))
        specs[prefix + "self_attn.k_norm.weight"] = WeightSpec(("layers", i, "k_norm"), (hd,))
    return specs


def forward(
    params: Params,
    kv_cache: list[LayerKV],
    input_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    metadata: AttentionMetadata,
    *,
    config: ModelConfig,
    attention: AttentionBackend,
    capture_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, list[LayerKV], tuple[jax.Array, ...]]:
    """Run the decoder over a ragged batch.

    Returns the final-normed hidden states f[T, H], the updated cache, and for each index in
    `capture_layers` the residual stream *entering* that layer (index num_layers means the
    output of the last layer, before the final norm), each f[T, H].
    """
    hidden = params["embed"][input_ids]
    cos, sin = rope_cos_sin(positions, inverse_frequencies(config.rope, config.head_dim))
    captured: dict[int, jax.Array] = {}
    new_cache = []
    for i, layer in enumerate(params["layers"]):
        if i in capture_layers:
            captured[i] = hidden
        hidden, layer_kv = _decoder_layer(
            layer, hidden, cos, sin, kv_cache[i], metadata, config, attention
        )
        new_cache.append(layer_kv)
    captured[config.num_layers] = hidden
    hidden = rms_norm(hidden, params["norm"], config.rms_norm_eps)
    return hidden, new_cache, tuple(captured[i] for i in capture_layers)


def compute_logits(params: Params, hidden: jax.Array, config: ModelConfig) -> jax.Array:
    """hidden f[N, H] (final-normed) -> f32[N, V]."""
    weight = params["embed"] if config.tie_word_embeddings else params["lm_head"]  # [V, H]
    return matmul_rows(hidden, weight, preferred_element_type=jnp.float32)


def _decoder_layer(
    p: Params,
    hidden: jax.Array,  # [T, H]
    cos: jax.Array,  # f32[T, hd]
    sin: jax.Array,
    layer_kv: LayerKV,
    metadata: AttentionMetadata,
    config: ModelConfig,
    attention: AttentionBackend,
) -> tuple[jax.Array, LayerKV]:
    x = rms_norm(hidden, p["input_norm"], config.rms_norm_eps)
    attn_out, layer_kv = self_attention(p, x, cos, sin, layer_kv, metadata, config, attention)
    hidden = hidden + attn_out
    x = rms_norm(hidden, p["post_norm"], config.rms_norm_eps)
    return hidden + mlp(p, x), layer_kv


def self_attention(
    p: Params,
    x: jax.Array,  # [T, H]
    cos: jax.Array,
    sin: jax.Array,
    layer_kv: LayerKV,
    metadata: AttentionMetadata,
    config: ModelConfig,
    attention: AttentionBackend,
) -> tuple[jax.Array, LayerKV]:
    num_tokens, hd = x.shape[0], config.head_dim
    q, k, v = jnp.split(_linear(p, "_qkv", x), [config.q_size, config.q_size + config.kv_size], -1)
    q = q.reshape(num_tokens, config.num_heads, hd)
    k = k.reshape(num_tokens, config.num_kv_heads, hd)
    v = v.reshape(num_tokens, config.num_kv_heads, hd)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out, layer_kv = attention(q, k, v, layer_kv, metadata, scale=hd**-0.5)
    return _linear(p, "_o", out.reshape(num_tokens, config.q_size)), layer_kv


def mlp(p: Params, x: jax.Array) -> jax.Array:
    gate, up = jnp.split(_linear(p, "_gate_up", x), 2, axis=-1)
    return _linear(p, "_down", jax.nn.silu(gate) * up)


def _linear(p: Params, name: str, x: jax.Array) -> jax.Array:
    y = matmul_rows(x, p["w" + name])
    bias = p.get("b" + name)
    return y if bias is None else y + bias


def matmul_rows(x: jax.Array, weight: jax.Array, **kwargs) -> jax.Array:
    """x [T, in] times weight [out, in] -> [T, out] (x @ weight.T without a transpose)."""
    return jax.lax.dot_general(x, weight, (((1,), (1,)), ((), ())), **kwargs)
