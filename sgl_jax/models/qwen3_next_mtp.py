"""Qwen3-Next's multi-token-prediction (MTP) module: the NEXTN drafter of Qwen3-Next and
Qwen3-Coder-Next.

The checkpoints ship it beside the target's weights, and nothing in config.json announces it
(it is there iff `mtp.fc.weight` is). Its tensors:
    mtp.fc.weight [H, 2H]; mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight,
    mtp.norm.weight [H]; mtp.layers.0.*: one decoder layer of the target's full-attention
    kind (gated attention with q/k norms and partial rotary; the sparse MoE with its gated
    shared expert, under the same names as the target's layers).
It has no embedding or lm_head of its own: it uses the target's.

Per position t it reads the target's final-norm hidden state h_t (the one fed to lm_head)
and token t+1, and predicts token t+2:
    x = fc([pre_fc_norm_embedding(embed(token t+1)) ; pre_fc_norm_hidden(h_t)])
    x = the layer over x (its own paged KV cache), out = mtp.norm(x), logits = lm_head(out).
Draft steps after the first feed back `out` in place of h_t, with the MTP's own draft token:
the one layer serves every step. Every norm is zero-centred (x * (1 + w)), as the target's.
Its KV slot t holds the pair (h_t, token t+1), as an EAGLE head's does (drafts.EagleDraft).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, ModelCache
from sgl_jax.layers.quantization import embedding_rows
from sgl_jax.layers.weights import WeightSpec
from sgl_jax.models import llama, qwen3_moe
from sgl_jax.models.config import ModelConfig

PREFIX = "mtp."
_LAYER = PREFIX + "layers.0."
Params = dict[str, Any]


def has_mtp(names: Collection[str]) -> bool:
    """Whether a checkpoint's tensor names hold an MTP module."""
    return PREFIX + "fc.weight" in names


def layer_config(target: ModelConfig, names: Collection[str]) -> ModelConfig:
    """The MTP's shapes: the target's, as one full-attention layer whose MLP is a mixture of
    experts where the checkpoint's layer has a router (as every Qwen3-Next layer does)."""
    moe = _LAYER + "mlp.gate.weight" in names
    return dataclasses.replace(
        target, num_layers=1, layer_types=("full_attention",) if target.layer_types else (),
        num_experts=target.num_experts if moe else 0, decoder_sparse_step=1, mlp_only_layers=())


def hf_weight_specs(config: ModelConfig, names: Collection[str]) -> dict[str, WeightSpec]:
    """The MTP's tensors (`config` from layer_config), experts in the spelling `names` use."""
    h = config.hidden_size
    specs = {
        PREFIX + "fc.weight": WeightSpec(("fc",), (h, 2 * h)),
        PREFIX + "pre_fc_norm_embedding.weight": WeightSpec(("pre_fc_norm_embedding",), (h,)),
        PREFIX + "pre_fc_norm_hidden.weight": WeightSpec(("pre_fc_norm_hidden",), (h,)),
        PREFIX + "norm.weight": WeightSpec(("norm",), (h,)),
    }
    layer = llama.decoder_layer_specs(config, _LAYER, ("layers", 0))
    if config.is_moe_layer(0):
        layer = {name: spec for name, spec in layer.items()
                 if not name.startswith(_LAYER + "mlp.")}
        layer.update(qwen3_moe.moe_layer_specs(
            config, _LAYER + "mlp.", ("layers", 0),
            fused=_LAYER + "mlp.experts.gate_up_proj" in names))
    return {**specs, **layer}


def forward(
    params: Params,
    kv_cache: ModelCache,  # one layer's pages
    input_ids: jax.Array,  # i32[T]: token t + 1 for position t
    positions: jax.Array,  # i32[T]
    features: jax.Array,  # f[T, H]: the target's final-norm hidden state, or the MTP's output
    metadata: AttentionMetadata,
    *,
    config: ModelConfig,
    attention: AttentionBackend,
    embed: jax.Array,  # [V, H]: the target's
) -> tuple[jax.Array, ModelCache]:
    """Returns the MTP's normed output f[T, H] (logits: the target's lm_head of it, and the
    next step's features) and its cache."""
    token = llama.norm(embedding_rows(embed, input_ids), params["pre_fc_norm_embedding"], config)
    hidden = llama.norm(features, params["pre_fc_norm_hidden"], config)
    x = llama.matmul_rows(jnp.concatenate([token, hidden], axis=-1), params["fc"])
    attend = llama.attention_mixer(positions, metadata, config, attention)
    x, layer_kv = llama.decoder_layer(params["layers"][0], x, attend, kv_cache.layer(0), config)
    return llama.norm(x, params["norm"], config), kv_cache.with_layer(0, layer_kv)
