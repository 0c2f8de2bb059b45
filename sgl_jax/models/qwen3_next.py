"""Qwen3-Next (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): a hybrid decoder. Most layers mix
tokens with Gated DeltaNet (linear attention over a recurrent state, `layers/gated_delta_net`),
every `full_attention_interval`-th layer (or as `layer_types` lists) with gated attention;
the MLPs are Qwen3-MoE's experts plus a sigmoid-gated shared expert.

What differs from the Qwen3-MoE decoder (all of it llama.py's, through config flags):
  * gated attention: q_proj yields q and a gate per head ([.., heads, 2 * head_dim] split in
    halves); the attention output is multiplied by sigmoid(gate) before o_proj;
  * RoPE on the first `partial_rotary_factor` (0.25) of head_dim, rotate-half within them;
  * every RMSNorm but GDN's gated one is zero-centred: x * (1 + w), in float32;
  * the linear-attention layers keep, per request, a conv window and a delta-rule state in
    a pool of slots beside the paged KV cache (`mem_cache/state_pool.py`); their cache entry
    in the model's per-layer cache list is that pool, a `GdnState`, instead of (K, V) pages.

Parameters: llama.py's layer dict, where a linear-attention layer holds its GDN parameters
under "linear_attn" instead of w_qkv / w_o (and q/k norms), and an MoE layer holds the
shared expert beside the routed ones (see `layers/moe.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers import gated_delta_net as gdn
from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, ModelCache
from sgl_jax.layers.attention.metadata import from_windows, to_windows
from sgl_jax.layers.weights import WeightSpec
from sgl_jax.models import llama, qwen3_moe
from sgl_jax.models.config import ModelConfig, dense_config_from_hf, moe_fields_from_hf

ARCHITECTURES = ("Qwen3NextForCausalLM",)
# The hub checkpoints carry a multi-token-prediction head, which plain decoding never runs.
IGNORED_TENSOR_PREFIXES = ("mtp.",)
Params = dict[str, Any]
# (GDN parameters, x [T, H], pool GdnState [S, ...], layout) -> (out [T, H], pool); the model
# runner passes this one split over the tensor-parallel mesh.
LinearAttention = Callable[[Params, jax.Array, gdn.GdnState, gdn.SlotLayout],
                           tuple[jax.Array, gdn.GdnState]]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    rope = hf.get("rope_parameters") or {}
    factor = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    return dense_config_from_hf(
        hf, qk_norm=True, **moe_fields_from_hf(hf, shared_expert=True),
        layer_types=layer_types(hf), linear_attention=gdn.GdnConfig.from_hf(hf),
        partial_rotary_factor=float(factor), attn_output_gate=True, zero_centered_norm=True)


def layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    """`layer_types` when given, else layer i is full attention when (i + 1) is a multiple of
    `full_attention_interval` (default 4) and linear attention otherwise."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = hf.get("full_attention_interval", 4)
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(hf["num_hidden_layers"]))


def hf_weight_specs(config: ModelConfig, names: Collection[str] | None = None
                    ) -> dict[str, WeightSpec]:
    """Qwen3-MoE's tensors (experts in the spelling `names` use, shared experts with them),
    with each linear-attention layer's self_attn replaced by its linear_attn."""
    linear = [i for i in range(config.num_layers) if config.is_linear_layer(i)]
    attention = tuple(f"model.layers.{i}.self_attn." for i in linear)
    specs = {name: spec for name, spec in qwen3_moe.hf_weight_specs(config, names).items()
             if not name.startswith(attention)}
    for i in linear:
        specs.update(gdn.linear_attn_specs(config.linear_attention, f"model.layers.{i}.",
                                           ("layers", i, "linear_attn")))
    return specs


def forward(
    params: Params,
    cache: ModelCache,  # the attention layers' pages and the linear layers' GdnState pools
    input_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    metadata: AttentionMetadata,
    *,
    config: ModelConfig,
    attention: AttentionBackend,
    state_slots: jax.Array,  # i32[NB]: each query block's sequence's state slot (0: padding)
    linear_attention: LinearAttention | None = None,
    capture_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, ModelCache, tuple[jax.Array, ...]]:
    """llama.forward's contract, with each sequence's recurrent state read from and written
    back to its slot of the linear layers' pools."""
    attend = llama.attention_mixer(positions, metadata, config, attention)
    layout = slot_layout(metadata, state_slots)
    run = linear_attention or partial(gdn.forward_slots, config=config.linear_attention)

    def linear(p: Params, x: jax.Array, pool: gdn.GdnState) -> tuple[jax.Array, gdn.GdnState]:
        return run(p["linear_attn"], x, pool, layout)

    mixers = [linear if config.is_linear_layer(i) else attend for i in range(config.num_layers)]
    return llama.decoder(params, cache, input_ids, mixers, config=config,
                         capture_layers=capture_layers)


def verify_forward(
    params: Params,
    cache: ModelCache,
    input_ids: jax.Array,  # i32[B * N]: each request's draft tree, node 0 its root
    positions: jax.Array,  # i32[B * N]
    metadata: AttentionMetadata,  # the verify window with the trees' ancestor mask
    *,
    config: ModelConfig,
    attention: AttentionBackend,
    tree: gdn.TreeLayout,
    linear_attention: LinearAttention | None = None,
    capture_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, ModelCache, tuple[jax.Array, ...]]:
    """The target's forward over draft trees (speculative verify). Attention layers attend
    with the tree mask and write the nodes' K/V as `forward` does. Each linear layer runs
    every node from its parent's state, the root from the request's committed state in its
    slot, and writes nothing: its entry in the returned cache's `states` is the state after
    every node,
    GdnState [B * N, ...], for `gdn.commit_node` once the accepted path is known."""
    attend = llama.attention_mixer(positions, metadata, config, attention)
    run = linear_attention or partial(gdn.verify_slots, config=config.linear_attention)

    def linear(p: Params, x: jax.Array, pool: gdn.GdnState) -> tuple[jax.Array, gdn.GdnState]:
        # A packed batch's tokens go to their window slots: the recurrence walks each tree
        # by node index (the nodes left out are invalid in `tree`), and the states stay per
        # window slot for commit_node.
        y, nodes = run(p["linear_attn"], to_windows(x, metadata), pool, tree)
        return from_windows(y, metadata), nodes

    mixers = [linear if config.is_linear_layer(i) else attend for i in range(config.num_layers)]
    return llama.decoder(params, cache, input_ids, mixers, config=config,
                         capture_layers=capture_layers)


compute_logits = llama.compute_logits


def slot_layout(metadata: AttentionMetadata, state_slots: jax.Array) -> gdn.SlotLayout:
    """The ragged batch's blocks as GDN sees them, from the attention layout: a block is its
    sequence's first when it starts at the sequence's first new token (q_start 0), its last
    when the sequence's new tokens end inside it; the sequence is fresh when nothing of it
    is cached (window_start 0: a new or recomputed request's first chunk). Blocks without
    tokens or without a slot are padding: they read and write no slot."""
    qb = metadata.q_block
    new_tokens = metadata.kv_lens - metadata.window_starts  # i32[NB]: the sequence's, this step
    live = (metadata.kv_lens > 0) & (state_slots > 0)
    offsets = metadata.q_starts[:, None] + jnp.arange(qb)[None, :]  # [NB, qb]
    return gdn.SlotLayout(
        slot=jnp.where(live, state_slots, 0),
        first=live & (metadata.q_starts == 0),
        last=live & (metadata.q_starts + qb >= new_tokens),
        fresh=metadata.window_starts == 0,
        valid=live[:, None] & (offsets < new_tokens[:, None]),
    )
