"""HeadDrafter: a draft head that reads the target's features (EAGLE3, EAGLE, NEXTN).

Its cache slot t pairs the target's features at t with token t+1, so after an extend its
output at the last pair predicts the first draft token: that output is the request slot's
row (`SlotState.draft`, f[S, H]) the next tree grows from. Trees are EAGLE-2's
(round/draft_growth.grow_tree); after verification the head extends over the accepted path's pairs.
Plain rounds may leave it behind: it is caught up from the target features they returned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import ModelCache
from sgl_jax.model_executor.forward_batch import window_metadata
from sgl_jax.speculative.drafters.head_networks import DraftModel
from sgl_jax.speculative.drafters.interface import DraftCache
from sgl_jax.speculative.round.draft_growth import grow_tree
from sgl_jax.speculative.spec_config import TreeShape


class HeadDrafter:
    advances_on_plain = True
    full_depth = True
    pairs_next_token = True
    defers = True  # its cache is caught up from the target's features alone

    def __init__(self, draft: DraftModel, *, dtype, page_size: int,
                 capture_layers: tuple[int, ...] = ()):
        self.draft = draft
        self.params = draft.params
        self.page_size = page_size
        self.features = draft.feature_source
        self.capture_layers = capture_layers
        self.slot_width = draft.cache_config.hidden_size
        self.slot_dtype = dtype
        self.cache = DraftCache(draft.cache_config)

    def reach(self, shape: TreeShape) -> int:
        return max(shape.num_steps - 1, 0) * shape.topk

    def chains(self, shape: TreeShape) -> bool:
        return shape.topk == 1

    def idle_hints(self, batch: int) -> None:
        return None

    def prefill(self, params, kv, batch, features, next_ids, run):
        rows = batch.logits_indices.shape[0]

        def extend(kv):  # -> root outputs f[rows, H], kv
            hidden, kv = self.draft.forward(params, kv, next_ids, batch.positions, features,
                                            batch.attention, from_target=True)
            return hidden[batch.logits_indices], kv

        def skip(kv):
            return jnp.zeros((rows, self.slot_width), self.slot_dtype), kv

        return jax.lax.cond(run, extend, skip, kv)

    def propose(self, params, kv, inputs, page_table, state_slots, hints, *, shape):
        """Grow each request's tree of `shape` from its root pair's output."""
        root_hidden = inputs.draft
        return grow_tree(self.draft, params, kv, inputs.root_tokens, root_hidden,
                         self.draft.logits(params, root_hidden), inputs.kv_lens, page_table,
                         inputs.active, shape=shape, page_size=self.page_size)

    def advance(self, params, kv, tree, verified, inputs, page_table, state_slots):
        """Extend over the accepted path's pairs (features of node, the token after it): the
        output at the new root is the bonus token's pair."""
        verdict = verified.verdict
        valid = jnp.where(inputs.active, verdict.num_accepted + 1, 0)
        return self.catch_up(params, kv, verdict.tokens, verified.features, page_table,
                             inputs.kv_lens, valid)

    def catch_up(self, params, kv: ModelCache,
                 tokens: jax.Array,  # i32[B, W]: the token after each position
                 features: jax.Array,  # f[B*W, F]: the target's, per position
                 page_table: jax.Array,  # i32[B, P]
                 start: jax.Array,  # i32[B]: tokens the draft's cache holds
                 valid: jax.Array,  # i32[B]: real positions per row (0: nothing written)
                 ) -> tuple[jax.Array, ModelCache]:
        """Run the head over `valid` new pairs per row from `start`; returns its output at
        each row's last one (f[B, H])."""
        batch, width = tokens.shape
        metadata = window_metadata(page_table, start, valid, width, self.page_size)
        positions = (start[:, None] + jnp.arange(width)).reshape(-1)
        hidden, kv = self.draft.forward(params, kv, tokens.reshape(-1), positions, features,
                                        metadata, from_target=True)
        last = jnp.maximum(valid - 1, 0)
        root_hidden = jnp.take_along_axis(hidden.reshape(batch, width, -1),
                                          last[:, None, None], axis=1)[:, 0]
        return root_hidden, kv
