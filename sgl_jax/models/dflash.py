"""DFlash draft heads (arXiv 2602.06036; the z-lab / SpecForge layout): a few Qwen3 decoder
layers that draft a whole block of tokens in one forward pass, conditioned on the target's
hidden states.

config.json: `architectures: ["DFlashDraftModel"]`, Qwen3's attention and MLP fields,
`block_size`, `num_target_layers`, `layer_types` (each "full_attention" or
"sliding_attention"; absent: all full), `sliding_window` (needed when a layer slides), and
`dflash_config: {mask_token_id, target_layer_ids}` (each of the three also read at the top
level, as z-lab's loader does).
Tensors: `fc.weight` [H, L*H] (L target layers), `hidden_norm.weight`, `norm.weight` [H], and
per layer i `layers.{i}.{input_layernorm,post_attention_layernorm}.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`. The embedding and lm_head are the target's.

The forward, in two parts:
- context (`context_kv`): for each committed token t, c_t = hidden_norm(fc([h_l(t) for l in
  target_layer_ids])), h_l the output of target layer l. Every layer's key and value for t
  are k_norm(k_proj(c_t)) (RoPE at t) and v_proj(c_t), from c_t itself (no layer input):
  they are computed once per committed token and kept in the draft's own paged cache.
- the block (`block_forward`): [the last verified token, MASK x (B-1)] at positions s..s+B-1
  runs through the layers as a Qwen3 decoder does, each block query seeing every cached
  context key before s and every key of the block (non-causal inside it); `norm`, then the
  target's lm_head at block positions 1..B-1 gives B-1 drafts at once. The block's own keys
  are written into the cache past the context and overwritten by the next block or by the
  context of what gets committed.
A `sliding_attention` layer (newer heads) with window W hides, from a block query at
position p, every key at position p - W or before: context keys and block keys alike, so a
query still sees every later block key and the block keys up to W - 1 behind it. The cache
keeps every context key; the window only masks them.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, ModelCache
from sgl_jax.layers.quantization import embedding_rows
from sgl_jax.layers.rotary import apply_rope, inverse_frequencies, rope_cos_sin
from sgl_jax.layers.weights import WeightSpec
from sgl_jax.models import llama
from sgl_jax.models.config import ModelConfig, dense_config_from_hf

ARCHITECTURE = "DFlashDraftModel"
Params = dict[str, Any]


@dataclass(frozen=True)
class DFlashConfig:
    layer: ModelConfig  # the draft layers' shapes (a Qwen3 decoder's)
    block_size: int  # B: the block's tokens, the last verified one included
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target layers whose outputs make the context
    num_target_layers: int
    sliding_windows: tuple[int | None, ...]  # per layer: its window W, None for full attention

    def __post_init__(self):
        if len(self.sliding_windows) != self.layer.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for "
                             f"{self.layer.num_layers} layers")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target's capture indices of those outputs (index i: the state entering
        layer i, so the output of layer l is index l + 1)."""
        return tuple(layer + 1 for layer in self.target_layer_ids)


def config_from_hf(hf: dict[str, Any]) -> DFlashConfig:
    def field(name: str, default: Any = None) -> Any:
        value = (hf.get("dflash_config") or {}).get(name, hf.get(name, default))
        if value is None:
            raise ValueError(f"a DFlash head's config.json needs {name} (in dflash_config or "
                             "at the top level)")
        return value

    # Windows are ours to apply per layer; the Qwen3 layer config itself has none.
    layer = dense_config_from_hf({**hf, "architectures": ["Qwen3ForCausalLM"],
                                  "use_sliding_window": False}, qk_norm=True)
    return DFlashConfig(layer=layer, block_size=int(field("block_size", 16)),
                        mask_token_id=int(field("mask_token_id")),
                        target_layer_ids=tuple(int(i) for i in field("target_layer_ids")),
                        num_target_layers=int(field("num_target_layers")),
                        sliding_windows=sliding_windows_from_hf(hf, layer.num_layers))


def sliding_windows_from_hf(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window from `layer_types` and `sliding_window` (None: full attention)."""
    kinds = hf.get("layer_types") or ["full_attention"] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, but the DFlash head has "
                         f"{num_layers}")
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"DFlash layer types {unknown} are not supported: only "
                         "full_attention and sliding_attention")
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    window = hf.get("sliding_window")
    if sliding and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"DFlash layers {sliding} are sliding_attention, but config.json's "
                         f"sliding_window is {window!r}, not a positive number of tokens")
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def hf_weight_specs(config: DFlashConfig, names: Collection[str] = ()
                    ) -> dict[str, WeightSpec]:
    layer, h = config.layer, config.layer.hidden_size
    specs = {
        "fc.weight": WeightSpec(("fc",), (h, len(config.target_layer_ids) * h)),
        "hidden_norm.weight": WeightSpec(("hidden_norm",), (h,)),
        "norm.weight": WeightSpec(("norm",), (h,)),
    }
    for i in range(layer.num_layers):
        specs.update(llama.decoder_layer_specs(layer, f"layers.{i}.", ("layers", i)))
    return specs


def context(params: Params, features: jax.Array, config: DFlashConfig) -> jax.Array:
    """features f[T, L*H] (the target layers' outputs, concatenated) -> c f[T, H]."""
    return llama.norm(llama.matmul_rows(features, params["fc"]), params["hidden_norm"],
                      config.layer)


def context_keys_values(
    params: Params,
    features: jax.Array,  # f[T, L*H]: the target's, at committed tokens
    positions: jax.Array,  # i32[T]
    config: DFlashConfig,
) -> list[tuple[jax.Array, jax.Array]]:
    """Every layer's context keys f[T, n_kv, hd] (k_norm, RoPE at `positions`) and values."""
    layer_config = config.layer
    c = context(params, features, config)
    cos, sin = rope_cos_sin(positions, inverse_frequencies(layer_config.rope,
                                                           layer_config.rotary_dim))
    keys_values = []
    for p in params["layers"]:
        _, _, k, v = llama.qkv_heads(p, c, layer_config)
        keys_values.append((apply_rope(llama.norm(k, p["k_norm"], layer_config), cos, sin), v))
    return keys_values


def context_kv(
    params: Params,
    kv_cache: ModelCache,
    features: jax.Array,  # f[T, L*H]: the target's, at committed tokens
    positions: jax.Array,  # i32[T]
    slot_mapping: jax.Array,  # i32[T]: where each token's keys go (0: the null slot)
    *,
    config: DFlashConfig,
) -> ModelCache:
    """Write every layer's context keys and values for the tokens into the cache."""
    for i, (k, v) in enumerate(context_keys_values(params, features, positions, config)):
        kv_cache = kv_cache.with_layer(i, kv_cache.layer(i).write(slot_mapping, k, v))
    return kv_cache


def block_forward(
    params: Params,
    kv_cache: ModelCache,
    input_ids: jax.Array,  # i32[T]: each block, its last verified token then mask tokens
    positions: jax.Array,  # i32[T]
    metadata: AttentionMetadata,  # one query block per block, every block key visible
    *,
    config: DFlashConfig,
    attention: AttentionBackend,
    embed: jax.Array,  # [V, H]: the target's
) -> tuple[jax.Array, ModelCache]:
    """The blocks' final-normed hidden states f[T, H] (the target's lm_head of each one past
    the first is a draft) and the cache, the blocks' own keys written past the context."""
    layer_config = config.layer
    x = embedding_rows(embed, input_ids)
    mixers = _layer_mixers(positions, metadata, config, attention)
    for i, (p, attend) in enumerate(zip(params["layers"], mixers, strict=True)):
        x, layer_kv = llama.decoder_layer(p, x, attend, kv_cache.layer(i), layer_config)
        kv_cache = kv_cache.with_layer(i, layer_kv)
    return llama.norm(x, params["norm"], layer_config), kv_cache


def _layer_mixers(positions: jax.Array, metadata: AttentionMetadata, config: DFlashConfig,
                  attention: AttentionBackend) -> list[llama.Mixer]:
    """One attention mixer per layer, with that layer's window; one mixer per distinct window
    so RoPE tables are built once. Full layers call the backend without a window argument."""
    mixers = {window: llama.attention_mixer(positions, metadata, config.layer,
                                            _windowed(attention, window))
              for window in set(config.sliding_windows)}
    return [mixers[window] for window in config.sliding_windows]


def _windowed(attention: AttentionBackend, window: int | None) -> AttentionBackend:
    return attention if window is None else functools.partial(attention, sliding_window=window)


def full_block_mask(num_blocks: int, block_size: int) -> jax.Array:
    """bool[NB, B, B]: every block token sees every other (DFlash's non-causal block)."""
    return jnp.ones((num_blocks, block_size, block_size), bool)
