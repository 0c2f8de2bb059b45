"""The Llama-style decoder shared by Llama, Qwen2, Qwen3 and Qwen3-MoE.

Parameters are a plain pytree:
    {"embed": [V, H], "norm": [H], "lm_head": [V, H] (absent when tied),
     "layers": [{"input_norm": [H], "w_qkv": [nkv, (nq/nkv + 2)*hd, H], "w_o": [H, nq*hd],
                 "post_norm": [H], "w_gate_up": [I, 2, H], "w_down": [H, I],
                 optional "b_qkv"/"b_o"/"b_gate_up"/"b_down" biases,
                 optional "q_norm"/"k_norm": [hd]}, ...]}
A layer holding a router ("w_router") and expert stacks instead of w_gate_up / w_down runs
the mixture-of-experts MLP of `sgl_jax.layers.moe` (Qwen3-MoE, see qwen3_moe.py).
`decoder` runs the stack with any token mixer per layer (hybrid models put Gated DeltaNet
in some, see qwen3_next.py); config flags add Qwen3-Next's gated attention (q_proj yields
q and a gate per head: w_qkv's q part is then q | gate per head), partial rotary and
zero-centred norms.
Matrices keep the checkpoint's [out, in] layout: XLA streams a matrix-vector product over
contiguous rows faster than over columns, which is what decode is made of. q|k|v and gate|up
are fused at load time: one larger product streams faster than several small ones. The fused
matrices keep a leading group axis (one group per KV head; one gate|up pair per intermediate
feature), and split along it for tensor parallelism without cutting through q, k or v. Token
tables may carry padding rows past V when sharded, so logits are cut back to V.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, LayerKV, ModelCache
from sgl_jax.layers.linear import matmul_rows
from sgl_jax.layers.moe import has_experts, moe_mlp
from sgl_jax.layers.norm import rms_norm
from sgl_jax.layers.quantization import embedding_rows
from sgl_jax.layers.rotary import apply_rope, inverse_frequencies, rope_cos_sin
from sgl_jax.layers.weights import FusedPart, WeightSpec
from sgl_jax.models.config import ModelConfig, dense_config_from_hf

ARCHITECTURES = ("LlamaForCausalLM",)
Params = dict[str, Any]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return dense_config_from_hf(hf)


def hf_weight_specs(config: ModelConfig, names: Collection[str] | None = None
                    ) -> dict[str, WeightSpec]:
    """Every tensor a Hugging Face checkpoint of this config holds, keyed by its name (dense
    checkpoints have one spelling, so the checkpoint's `names` are not needed)."""
    h, v = config.hidden_size, config.vocab_size
    specs = {
        "model.embed_tokens.weight": WeightSpec(("embed",), (v, h)),
        "model.norm.weight": WeightSpec(("norm",), (h,)),
    }
    if not config.tie_word_embeddings:
        specs["lm_head.weight"] = WeightSpec(("lm_head",), (v, h))
    for i in range(config.num_layers):
        specs.update(layer_weight_specs(config, i))
    return specs


def layer_weight_specs(config: ModelConfig, i: int) -> dict[str, WeightSpec]:
    return decoder_layer_specs(config, f"model.layers.{i}.", ("layers", i))


def decoder_layer_specs(
    config: ModelConfig, prefix: str, path: tuple[str | int, ...], attn_in: int | None = None
) -> dict[str, WeightSpec]:
    """The tensors of one decoder layer named `prefix`..., placed under `path`; `attn_in` is
    the width the q/k/v projections read (the hidden size unless given)."""
    h, inter = config.hidden_size, config.intermediate_size
    attn_in = attn_in or h
    qkv, gate_up = _qkv_parts(config), _gate_up_parts(config)
    q_rows = config.q_size * (2 if config.attn_output_gate else 1)
    # hf module -> (our name, in features, out features, has bias, where in a fused parameter)
    linears = {
        "self_attn.q_proj": ("_qkv", attn_in, q_rows, config.qkv_bias, qkv[0]),
        "self_attn.k_proj": ("_qkv", attn_in, config.kv_size, config.qkv_bias, qkv[1]),
        "self_attn.v_proj": ("_qkv", attn_in, config.kv_size, config.qkv_bias, qkv[2]),
        "self_attn.o_proj": ("_o", config.q_size, h, config.o_bias, None),
        "mlp.gate_proj": ("_gate_up", h, inter, config.mlp_bias, gate_up[0]),
        "mlp.up_proj": ("_gate_up", h, inter, config.mlp_bias, gate_up[1]),
        "mlp.down_proj": ("_down", inter, h, config.mlp_bias, None),
    }
    specs = {
        prefix + "input_layernorm.weight": WeightSpec((*path, "input_norm"), (h,)),
        prefix + "post_attention_layernorm.weight": WeightSpec((*path, "post_norm"), (h,)),
    }
    for module, (name, in_features, out_features, has_bias, part) in linears.items():
        specs[f"{prefix}{module}.weight"] = WeightSpec(
            (*path, "w" + name), (out_features, in_features), part and part(in_features)
        )
        if has_bias:
            specs[f"{prefix}{module}.bias"] = WeightSpec(
                (*path, "b" + name), (out_features,), part and part()
            )
    if config.qk_norm:
        hd = config.head_dim
        specs[prefix + "self_attn.q_norm.weight"] = WeightSpec((*path, "q_norm"), (hd,))
        specs[prefix + "self_attn.k_norm.weight"] = WeightSpec((*path, "k_norm"), (hd,))
    return specs


def _qkv_parts(config: ModelConfig) -> list[Callable[..., FusedPart]]:
    """q, k and v inside w_qkv [G, W, in]: group g holds the q heads that read KV head g,
    then k and v of that head (W = (nq/G + 2) * hd), so splitting groups keeps them whole.
    With an output gate each q head is q | gate (2 * hd rows, as q_proj holds them)."""
    groups, hd = config.num_kv_heads, config.head_dim
    q_width = config.num_heads // groups * hd * (2 if config.attn_output_gate else 1)
    spans = [(0, q_width), (q_width, q_width + hd), (q_width + hd, q_width + 2 * hd)]

    def part(start: int, stop: int) -> Callable[..., FusedPart]:
        return lambda *in_features: FusedPart(
            (groups, q_width + 2 * hd, *in_features), (groups, stop - start, *in_features),
            (slice(None), slice(start, stop)),
        )
    return [part(*span) for span in spans]


def _gate_up_parts(config: ModelConfig) -> list[Callable[..., FusedPart]]:
    """gate and up inside w_gate_up [I, 2, in]: each intermediate feature's gate and up rows
    side by side, so any split of the features keeps its pairs."""
    inter = config.intermediate_size

    def part(i: int) -> Callable[..., FusedPart]:
        return lambda *in_features: FusedPart(
            (inter, 2, *in_features), (inter, 1, *in_features), (slice(None), slice(i, i + 1))
        )
    return [part(0), part(1)]


def forward(
    params: Params,
    kv_cache: ModelCache,
    input_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    metadata: AttentionMetadata,
    *,
    config: ModelConfig,
    attention: AttentionBackend,
    capture_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, ModelCache, tuple[jax.Array, ...]]:
    """Run the decoder over a ragged batch.

    Returns the final-normed hidden states f[T, H], the updated cache, and for each index in
    `capture_layers` the residual stream *entering* that layer (index num_layers means the
    output of the last layer, before the final norm), each f[T, H].
    """
    attend = attention_mixer(positions, metadata, config, attention)
    return decoder(params, kv_cache, input_ids, [attend] * config.num_layers, config=config,
                   capture_layers=capture_layers)


# A token mixer: (layer params, normed input [T, H], the layer's cache) -> (output [T, H],
# the layer's cache after it).
Mixer = Callable[[Params, jax.Array, Any], tuple[jax.Array, Any]]


def attention_mixer(positions: jax.Array, metadata: AttentionMetadata, config: ModelConfig,
                    attention: AttentionBackend) -> Mixer:
    """Self-attention over the paged KV cache, as a token mixer (positions i32[T])."""
    cos, sin = rope_cos_sin(positions, inverse_frequencies(config.rope, config.rotary_dim))

    def attend(p: Params, x: jax.Array, layer_kv: LayerKV) -> tuple[jax.Array, LayerKV]:
        return self_attention(p, x, cos, sin, layer_kv, metadata, config, attention)
    return attend


def decoder(
    params: Params,
    cache: ModelCache,
    input_ids: jax.Array,  # i32[T]
    mixers: Sequence[Mixer],  # one per layer
    *,
    config: ModelConfig,
    capture_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, ModelCache, tuple[jax.Array, ...]]:
    """The pre-norm decoder stack (see `forward` for what it returns): each layer is
    x + mixer(norm(x)), then x + mlp(norm(x))."""
    hidden = embedding_rows(params["embed"], input_ids)
    captured: dict[int, jax.Array] = {}
    for i, (layer, mix) in enumerate(zip(params["layers"], mixers, strict=True)):
        if i in capture_layers:
            captured[i] = hidden
        hidden, layer_cache = decoder_layer(layer, hidden, mix, cache.layer(i), config)
        cache = cache.with_layer(i, layer_cache)
    captured[config.num_layers] = hidden
    hidden = norm(hidden, params["norm"], config)
    return hidden, cache, tuple(captured[i] for i in capture_layers)


def decoder_layer(p: Params, x: jax.Array, mix: Mixer, layer_cache: Any, config: ModelConfig
                  ) -> tuple[jax.Array, Any]:
    """One pre-norm layer: x + mix(norm(x)), then x + feed_forward(norm(x)); x [T, H]."""
    mixed, layer_cache = mix(p, norm(x, p["input_norm"], config), layer_cache)
    x = x + mixed
    return x + feed_forward(p, norm(x, p["post_norm"], config), config), layer_cache


def norm(x: jax.Array, weight: jax.Array, config: ModelConfig) -> jax.Array:
    """The model's RMSNorm (zero-centred for Qwen3-Next)."""
    return rms_norm(x, weight, config.rms_norm_eps, zero_centered=config.zero_centered_norm)


def compute_logits(params: Params, hidden: jax.Array, config: ModelConfig) -> jax.Array:
    """hidden f[N, H] (final-normed) -> f32[N, V]."""
    weight = params["embed"] if config.tie_word_embeddings else params["lm_head"]  # [V', H]
    logits = matmul_rows(hidden, weight, preferred_element_type=jnp.float32)
    return logits[:, : config.vocab_size]  # V' > V when the table is padded for sharding


def feed_forward(p: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
    """x [T, H] -> [T, H] through the layer's MLP: mixture of experts when it has a router."""
    if has_experts(p):
        return moe_mlp(p, x, top_k=config.num_experts_per_tok,
                       norm_topk_prob=config.norm_topk_prob)
    return mlp(p, x)


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
    q, gate, k, v = qkv_heads(p, x, config)
    if config.qk_norm:
        q, k = norm(q, p["q_norm"], config), norm(k, p["k_norm"], config)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out, layer_kv = attention(q, k, v, layer_kv, metadata, scale=hd**-0.5)
    if config.attn_output_gate:
        out = out * jax.nn.sigmoid(gate)
    return _linear(p, "_o", out.reshape(num_tokens, config.q_size)), layer_kv


def qkv_heads(p: Params, x: jax.Array, config: ModelConfig
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [T, H] -> q [T, nq, hd], the output gate [T, nq, hd] (empty without one), k and v
    [T, G, hd] (G KV heads: more than the config's when sharded), before norms and RoPE."""
    num_tokens, hd = x.shape[0], config.head_dim
    qkv = _linear(p, "_qkv", x)  # [T, G, W]
    q_width = qkv.shape[-1] - 2 * hd
    q = qkv[..., :q_width].reshape(num_tokens, config.num_heads, -1)  # [T, nq, hd or 2 hd]
    k, v = qkv[..., q_width : q_width + hd], qkv[..., q_width + hd :]
    return q[..., :hd], q[..., hd:], k, v


def mlp(p: Params, x: jax.Array) -> jax.Array:
    gate_up = _linear(p, "_gate_up", x)  # [T, I, 2]
    gate, up = gate_up[..., 0], gate_up[..., 1]
    return _linear(p, "_down", jax.nn.silu(gate) * up)


def _linear(p: Params, name: str, x: jax.Array) -> jax.Array:
    y = matmul_rows(x, p["w" + name])
    bias = p.get("b" + name)
    return y if bias is None else y + bias
