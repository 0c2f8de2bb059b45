"""STANDALONE: an ordinary small model with the target's vocabulary as the draft.

Its slot j holds token j, so the root (the last committed token) is run again in every draft
window and nothing passes between rounds but its cache. A hybrid one (Qwen3-Next) keeps,
like a hybrid target, a recurrent state per request in the request's slot of its own state
pools: windows run from that state without writing it, and the extend over the accepted
path commits the state after its last token. It reads no target features, so plain rounds
cannot leave it behind: it never defers.
"""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp

from sgl_jax.layers import gated_delta_net
from sgl_jax.layers.attention import AttentionBackend, ModelCache
from sgl_jax.model_executor.forward_batch import window_metadata
from sgl_jax.models import qwen3_next
from sgl_jax.models.loader import LoadedModel
from sgl_jax.speculative.drafters.interface import DraftCache
from sgl_jax.speculative.round.draft_growth import grow_tree
from sgl_jax.speculative.spec_config import TreeShape


class StandaloneDraft:
    """The draft network (head_networks.DraftModel) over a loaded model."""

    uses_target_features = False
    feature_source = ""
    root_in_window = True

    def __init__(self, draft: LoadedModel, attention: AttentionBackend):
        self.model = draft
        self.cache_config = draft.config
        self.attention = attention
        self.params = draft.params
        self.recurrent = draft.config.is_hybrid

    def forward(self, params, kv, tokens, positions, inputs, metadata, *, from_target,
                state_slots=None, tree=None, commit=None):
        """A hybrid draft: with `state_slots` (i32[NB], one per query block) a ragged extend
        that updates each request's state; with `tree` (gated_delta_net.TreeLayout) rows of
        nodes run from the committed states, then the state after node `commit` (i32[B]) is
        written to each active row's slot, or nothing when commit is None."""
        config = self.model.config
        if not self.recurrent:
            hidden, kv, _ = self.model.impl.forward(params, kv, tokens, positions, metadata,
                                                    config=config, attention=self.attention)
            return hidden, kv
        linear = config.linear_attention
        if tree is None:
            layer = partial(gated_delta_net.forward_slots, config=linear)
            hidden, kv, _ = qwen3_next.forward(
                params, kv, tokens, positions, metadata, config=config,
                attention=self.attention, state_slots=state_slots,
                linear_attention=self.model.tp.linear_attention(layer))
            return hidden, kv
        layer = partial(gated_delta_net.verify_slots, config=linear)
        pools = kv.states
        hidden, nodes, _ = qwen3_next.verify_forward(
            params, kv, tokens, positions, metadata, config=config, attention=self.attention,
            tree=tree, linear_attention=self.model.tp.linear_attention(layer))
        written = tree.valid[:, 0]
        kv = nodes.with_states([
            pool if pool is None or commit is None else
            gated_delta_net.commit_node(pool, layer_nodes, tree.slot, commit, written)
            for pool, layer_nodes in zip(pools, nodes.states, strict=True)])
        return hidden, kv

    def logits(self, params, hidden):
        return self.model.impl.compute_logits(params, hidden, self.model.config)

    def to_target(self, params, draft_ids):
        return draft_ids


class StandaloneDrafter:
    features = ""
    capture_layers = ()
    defers = False
    advances_on_plain = True
    full_depth = True
    pairs_next_token = False
    slot_width = 0  # nothing per slot: the root token and the cache are all it reads

    def __init__(self, draft: StandaloneDraft, *, dtype, page_size: int):
        self.draft = draft
        self.params = draft.params
        self.page_size = page_size
        self.slot_dtype = dtype
        self.cache = DraftCache(draft.cache_config, recurrent=draft.recurrent)

    def reach(self, shape: TreeShape) -> int:
        return max(shape.num_steps - 1, 0) * shape.topk + 1  # the root runs in every window

    def chains(self, shape: TreeShape) -> bool:
        return shape.topk == 1

    def idle_hints(self, batch: int) -> None:
        return None

    def prefill(self, params, kv, batch, features, next_ids, run):
        extra = dict(state_slots=batch.state_slots) if self.draft.recurrent else {}
        _, kv = self.draft.forward(params, kv, batch.input_ids, batch.positions, None,
                                   batch.attention, from_target=True, **extra)
        return jnp.zeros((batch.logits_indices.shape[0], 0), self.slot_dtype), kv

    def propose(self, params, kv, inputs, page_table, state_slots, hints, *, shape):
        """Grow each request's tree of `shape` from its root, run again in every window."""
        return grow_tree(self.draft, params, kv, inputs.root_tokens, None, None,
                         inputs.kv_lens, page_table, inputs.active, shape=shape,
                         page_size=self.page_size, state_slots=state_slots)

    def advance(self, params, kv, tree, verified, inputs, page_table, state_slots):
        """Extend over the accepted path's own tokens, root first (a recurrent draft runs
        them as a chain from each row's committed state and commits the state after the
        last)."""
        verdict = verified.verdict
        tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(verdict.path, 0), axis=1)
        batch, width = tokens.shape  # i32[B, S+1]
        start = inputs.kv_lens
        valid = jnp.where(inputs.active, verdict.num_accepted + 1, 0)
        metadata = window_metadata(page_table, start, valid, width, self.page_size)
        positions = (start[:, None] + jnp.arange(width)).reshape(-1)
        extra = {}
        if self.draft.recurrent:
            chain = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32) - 1, (batch, width))
            extra = dict(tree=gated_delta_net.TreeLayout(
                jnp.where(inputs.active, state_slots, 0), chain,
                jnp.arange(width)[None, :] < valid[:, None]), commit=jnp.maximum(valid - 1, 0))
        _, kv = self.draft.forward(params, kv, tokens.reshape(-1), positions, None, metadata,
                                   from_target=True, **extra)
        return jnp.zeros((batch, 0), self.slot_dtype), kv

    def catch_up(self, params, kv: ModelCache, tokens, features, page_table, start, valid):
        raise NotImplementedError("a STANDALONE draft never defers: nothing to catch up")
