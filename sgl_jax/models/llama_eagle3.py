"""The EAGLE3 draft head: one Llama decoder layer over [token embedding ; target features].

Checkpoints follow the SpecForge / SGLang layout:
    fc.weight [H, 3*Ht], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], midlayer.self_attn.o_proj.weight,
    midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight [Vd, H], d2t [Vd]
with `layers.0.` accepted for `midlayer.` and `draft_id_to_target_id` for `d2t`. Without
`embed_tokens.weight` the draft shares the target's embedding; without `lm_head.weight` it
shares the target's lm_head (then the draft vocabulary is the target's).

Parameters: {"fc": [H, 3*Ht], "input_norm", "hidden_norm", "post_norm", "norm": [H],
"w_qkv": [nkv, (nq/nkv + 2)*hd, 2H], "w_o": [H, nq*hd], "w_gate_up": [I, 2, H], "w_down": [H, I],
optional "embed": [V, H], "lm_head": [Vd, H], "d2t": i32[Vd]}.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, ModelCache
from sgl_jax.layers.norm import rms_norm
from sgl_jax.layers.quantization import embedding_rows
from sgl_jax.layers.rotary import inverse_frequencies, rope_cos_sin
from sgl_jax.layers.weights import WeightSpec
from sgl_jax.models.config import ModelConfig, dense_config_from_hf
from sgl_jax.models.llama import decoder_layer_specs, matmul_rows, mlp, self_attention

ARCHITECTURES = ("LlamaForCausalLMEagle3",)
NUM_CAPTURED = 3  # target states fused by fc
# Saved by training code, unused at inference: which target ids the draft vocabulary holds.
TRAINING_ONLY_TENSORS = frozenset({"t2d"})
_LAYER_PREFIXES = ("midlayer.", "layers.0.")
_D2T_NAMES = ("d2t", "draft_id_to_target_id")
Params = dict[str, Any]


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the decoder layer: widths, heads, rope (theta 10000 when unset), eps
    draft_vocab_size: int
    target_hidden_size: int  # width of each captured target state
    aux_layer_ids: tuple[int, ...] | None  # from eagle_config, "output of layer i" convention

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


def is_eagle3_draft(hf: dict[str, Any]) -> bool:
    """EAGLE3 drafts say so, or are older one-layer Llama configs passed as a draft."""
    architectures = hf.get("architectures") or []
    if any(a in ARCHITECTURES for a in architectures):
        return True
    return "LlamaForCausalLM" in architectures and hf.get("num_hidden_layers") == 1


def config_from_hf(hf: dict[str, Any]) -> Eagle3Config:
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"an EAGLE3 draft has one decoder layer, this config has "
                         f"{hf['num_hidden_layers']}")
    layer = dense_config_from_hf({**hf, "architectures": list(ARCHITECTURES)})
    aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and len(aux) != NUM_CAPTURED:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids must name {NUM_CAPTURED} layers, "
                         f"got {aux}")
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=hf.get("draft_vocab_size") or layer.vocab_size,
        target_hidden_size=hf.get("target_hidden_size") or layer.hidden_size,
        aux_layer_ids=None if aux is None else tuple(aux),
    )


def target_capture_layers(num_target_layers: int, config: Eagle3Config,
                          target: ModelConfig | None = None) -> tuple[int, ...]:
    """Target layers whose *input* residual stream feeds the draft (the decoder captures the
    stream entering layer i; index L is the last layer's output).

    Default: inputs of layers 2, L//2 and L-3. `eagle_aux_hidden_state_layer_ids` name the
    layers whose *output* is captured (SpecForge writes [1, L//2-1, L-4]); the output of
    layer i is the input of layer i + 1, so they map to the same states.

    A hybrid target (`target` with linear-attention layers) feeds the draft attention layers'
    outputs only: explicit ids must name attention layers (a start-up error otherwise), and
    the default takes, for each of the default outputs 1, L//2-1 and L-4, the first
    attention layer at or after it (Qwen3-Next, 48 layers: outputs of 3, 23 and 47).
    """
    n = num_target_layers
    hybrid = target is not None and target.is_hybrid
    if config.aux_layer_ids is not None:
        outputs = config.aux_layer_ids
        if hybrid:
            linear = [i for i in outputs if 0 <= i < n and target.is_linear_layer(i)]
            if linear:
                raise ValueError(
                    f"eagle_aux_hidden_state_layer_ids {list(outputs)} name linear-attention "
                    f"layers {linear} of {target.architecture}: EAGLE3 on a hybrid target "
                    "captures attention layers' outputs only (ids in the 'output of layer i' "
                    "convention)")
    elif hybrid:
        attention = [i for i in range(n) if not target.is_linear_layer(i)]
        outputs = tuple(next((a for a in attention if a >= i), attention[-1])
                        for i in (1, n // 2 - 1, n - 4))
    else:
        outputs = (1, n // 2 - 1, n - 4)
    layers = tuple(i + 1 for i in outputs)
    if not all(0 < i <= n for i in layers):
        raise ValueError(f"EAGLE3 capture layers {layers} do not fit a target with {n} layers")
    return layers


def hf_weight_specs(config: Eagle3Config, names: Collection[str]) -> dict[str, WeightSpec]:
    """The tensors of this draft, in whichever accepted spelling `names` (the checkpoint's
    tensor names) uses."""
    c = config.layer
    h = c.hidden_size
    prefix = next((p for p in _LAYER_PREFIXES if any(n.startswith(p) for n in names)),
                  _LAYER_PREFIXES[0])
    specs = {
        "fc.weight": WeightSpec(("fc",), (h, NUM_CAPTURED * config.target_hidden_size)),
        "norm.weight": WeightSpec(("norm",), (h,)),
        prefix + "hidden_norm.weight": WeightSpec(("hidden_norm",), (h,)),
    }
    specs.update(decoder_layer_specs(c, prefix, (), attn_in=2 * h))
    if "embed_tokens.weight" in names:
        specs["embed_tokens.weight"] = WeightSpec(("embed",), (c.vocab_size, h))
    if "lm_head.weight" in names:
        specs["lm_head.weight"] = WeightSpec(("lm_head",), (config.draft_vocab_size, h))
    d2t = next((n for n in _D2T_NAMES if n in names), None)
    if d2t is not None:
        specs[d2t] = WeightSpec(("d2t",), (config.draft_vocab_size,), integer=True)
    elif config.draft_vocab_size != c.vocab_size:
        raise ValueError(f"the draft vocabulary ({config.draft_vocab_size}) differs from the "
                         f"target's ({c.vocab_size}) but the checkpoint has no d2t mapping")
    return specs


def forward(
    params: Params,
    kv_cache: ModelCache,  # the draft's own one-layer cache
    input_ids: jax.Array,  # i32[T]: token t + 1 for feature t
    positions: jax.Array,  # i32[T]
    features: jax.Array,  # f[T, 3*Ht] target states, or f[T, H] the draft's previous output
    metadata: AttentionMetadata,
    *,
    config: Eagle3Config,
    attention: AttentionBackend,
    embed: jax.Array,  # [V, H]: the draft's own embedding, or the target's
    from_target: bool,
) -> tuple[jax.Array, ModelCache]:
    """One draft step over a ragged batch; returns the pre-norm output h f[T, H] (fed back as
    the next step's features) and the updated cache."""
    c = config.layer
    g = matmul_rows(features, params["fc"]) if from_target else features  # [T, H]
    tokens = embedding_rows(embed, input_ids)
    x = jnp.concatenate([rms_norm(tokens, params["input_norm"], c.rms_norm_eps),
                         rms_norm(g, params["hidden_norm"], c.rms_norm_eps)], axis=-1)
    cos, sin = rope_cos_sin(positions, inverse_frequencies(c.rope, c.head_dim))
    attn_out, layer_kv = self_attention(params, x, cos, sin, kv_cache.layer(0), metadata, c,
                                        attention)
    hidden = g + attn_out
    hidden = hidden + mlp(params, rms_norm(hidden, params["post_norm"], c.rms_norm_eps))
    return hidden, kv_cache.with_layer(0, layer_kv)


def compute_logits(params: Params, hidden: jax.Array, config: Eagle3Config,
                   lm_head: jax.Array) -> jax.Array:
    """hidden f[N, H] (pre-norm) -> f32[N, Vd] over the draft vocabulary; `lm_head` [Vd, H] is
    the draft's own or the target's."""
    x = rms_norm(hidden, params["norm"], config.layer.rms_norm_eps)
    logits = matmul_rows(x, lm_head, preferred_element_type=jnp.float32)
    return logits[:, : config.draft_vocab_size]  # drops rows padded in for sharding


def draft_to_target_ids(draft_ids: jax.Array, params: Params) -> jax.Array:
    """Draft-vocabulary ids -> target ids: target = draft + d2t[draft] (identity without d2t)."""
    d2t = params.get("d2t")
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]
