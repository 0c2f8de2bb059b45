"""The target model's forward pass: the one every program runs (plain sampling steps,
speculative prefills and verify rounds).

A hybrid model (Qwen3-Next) keeps a recurrent state per request in its linear-attention
layers' pools. An extend (prompt chunks, decode tokens) reads and updates each request's
state slot; a verify over draft trees runs every node from its request's committed state
without writing the pools, and hands back each node's state for the caller to commit the
accepted one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from sgl_jax.layers import gated_delta_net
from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, ModelCache
from sgl_jax.models import qwen3_next
from sgl_jax.models.loader import LoadedModel


@dataclass(frozen=True)
class TargetForward:
    model: LoadedModel
    attention: AttentionBackend  # already placed on the model's mesh

    @property
    def hybrid(self) -> bool:
        return self.model.config.is_hybrid

    def __call__(
        self, params, kv: list,
        tokens: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        metadata: AttentionMetadata,
        *,
        capture: tuple[int, ...] = (),  # layers whose outputs come back (EAGLE3 features)
        state_slots: jax.Array | None = None,  # i32[NB]: hybrid extends, one per query block
        tree: gated_delta_net.TreeLayout | None = None,  # hybrid verifies: the draft trees
    ) -> tuple[jax.Array, ModelCache, tuple[jax.Array, ...]]:
        """hidden f[T, H] (after the final norm), the cache, the captured layers f[T, H]
        each. With `tree`, a hybrid model's linear layers return each node's state in place
        of their pools (gated_delta_net.commit_node picks the one to keep)."""
        model, config = self.model, self.model.config
        linear = {}
        if tree is not None:
            layer = functools.partial(gated_delta_net.verify_slots,
                                      config=config.linear_attention)
            return qwen3_next.verify_forward(
                params, kv, tokens, positions, metadata, config=config,
                attention=self.attention, tree=tree,
                linear_attention=model.tp.linear_attention(layer), capture_layers=capture)
        if self.hybrid:  # each linear layer runs on its own key heads of every device
            layer = functools.partial(gated_delta_net.forward_slots,
                                      config=config.linear_attention)
            linear = dict(state_slots=state_slots,
                          linear_attention=model.tp.linear_attention(layer))
        return model.impl.forward(params, kv, tokens, positions, metadata, config=config,
                                  attention=self.attention, capture_layers=capture, **linear)

    def logits(self, params, hidden: jax.Array) -> jax.Array:
        """f[T, H] -> f32[T, V]."""
        return self.model.impl.compute_logits(params, hidden, self.model.config)


def target_features(kind: str, hidden: jax.Array, captured: tuple[jax.Array, ...]
                    ) -> jax.Array | None:
    """What a drafter reads of the target per token: f[T, L*H] for "aux" (the captured
    layers, EAGLE3), f[T, H] for "final" (the last hidden state), None for ""."""
    if kind == "aux":
        return jnp.concatenate(captured, axis=-1)
    return hidden if kind == "final" else None
