"""Drafters: what proposes each round's trees, behind one interface.

A drafter takes part in three programs of the runner (spec_runner.py):

- the prefill, where it may read the target's features over the prompt (`prefill`);
- each round, where it proposes a tree per row within the round's shape (`propose`) and,
  once the target has accepted a path, advances over the accepted tokens (`advance`);
- a catch-up, for drafters that plain rounds may leave behind (`defers`).

What it keeps between rounds lives in its own paged KV cache (DeviceState.draft_kv, empty
for none) and in one row per request slot (`SlotState.draft`, `slot_width` wide). A drafter
that works on the host (NGRAM) hands its proposals to the round as `RoundRows.hints`.

`ModelDrafter` runs a draft network (EAGLE3, EAGLE, STANDALONE: speculative/drafts.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from sgl_jax.layers import gated_delta_net
from sgl_jax.layers.attention import LayerKV
from sgl_jax.model_executor.forward_batch import ForwardBatch, window_metadata
from sgl_jax.scheduler.req import Req
from sgl_jax.speculative.drafts import DraftModel, TreeShape, grow_tree
from sgl_jax.speculative.round import RoundInputs, Verified
from sgl_jax.speculative.tree import DraftTree


class Drafter(Protocol):
    features: str  # what it reads of the target: "aux" (captured layers), "final" or ""
    defers: bool  # plain rounds may leave it behind, to be caught up later
    advances_on_plain: bool  # a plain round must still advance it (else: the target's step)
    full_depth: bool  # every tree reaches the round's depth (else its depth varies by row)
    # Its cache slot t pairs the target's features at t with token t+1 (EAGLE's heads), so a
    # prompt's last cached slot needs the token after the prompt.
    pairs_next_token: bool
    slot_width: int  # D: its per-slot state SlotState.draft [S, D]
    slot_dtype: Any
    params: Any  # its weights (shared target arrays included), or {}

    def reach(self, shape: TreeShape) -> int:
        """KV slots past kv_len its windows write in a round of `shape`."""

    def chains(self, shape: TreeShape) -> bool:
        """Whether every tree it proposes in a round of `shape` is a chain."""

    def idle_hints(self, batch: int) -> Any:
        """`RoundRows.hints` for rows it proposes nothing for (None: it takes no hints)."""

    def prefill(self, params, kv, batch: ForwardBatch, features: jax.Array | None,
                next_ids: jax.Array, run: jax.Array) -> tuple[jax.Array, list[LayerKV]]:
        """Extend over a prefill batch; returns its slot rows [rows, D] at each chunk's last
        token (written where the chunk completes a prompt)."""

    def propose(self, params, kv, inputs: RoundInputs, page_table: jax.Array,
                state_slots: jax.Array, hints: Any, *, shape: TreeShape
                ) -> tuple[DraftTree, list[LayerKV]]: ...

    def advance(self, params, kv, tree: DraftTree, verified: Verified, inputs: RoundInputs,
                page_table: jax.Array, state_slots: jax.Array
                ) -> tuple[jax.Array, list[LayerKV]]:
        """Move past the accepted tokens; returns the new slot rows [B, D]."""


class Proposer(Protocol):
    """The host half of a drafter that proposes on the host, fed every token the host reads
    (speculative/decoder.py calls it)."""

    def add_request(self, req: Req) -> None:
        """A request is admitted (again, after a retraction)."""

    def extend(self, req: Req, tokens: Sequence[int]) -> None: ...

    def finish(self, req: Req) -> None: ...

    def flush(self) -> None:
        """Forget what finished requests left (the server's caches are flushed)."""

    def hints(self, reqs: Sequence[Req], padded: int) -> Any:
        """RoundRows.hints for a round of `reqs`, padded to `padded` rows."""

    def offered(self, hints: Any, rows: int) -> list[bool]:
        """Per request of `hints`' first `rows`: whether it has a draft to offer."""


class NoProposer:
    """For drafters that propose on the device alone."""

    def add_request(self, req: Req) -> None:
        pass

    def extend(self, req: Req, tokens: Sequence[int]) -> None:
        pass

    def finish(self, req: Req) -> None:
        pass

    def flush(self) -> None:
        pass

    def hints(self, reqs: Sequence[Req], padded: int) -> None:
        return None

    def offered(self, hints: None, rows: int) -> list[bool]:
        return [True] * rows


class ModelDrafter:
    """A draft network: trees grown step by step (EAGLE-2), the draft extended over the
    accepted path after verification."""

    def __init__(self, draft: DraftModel, *, dtype, page_size: int):
        self.draft = draft
        self.params = draft.params
        self.page_size = page_size
        self.features = draft.feature_source if draft.uses_target_features else ""
        self.slot_width = draft.cache_config.hidden_size if draft.uses_target_features else 0
        self.slot_dtype = dtype
        self.advances_on_plain = True
        self.full_depth = True
        self.pairs_next_token = draft.uses_target_features
        # A recurrent draft's state would need its own catch-up: it keeps extending.
        self.defers = draft.uses_target_features and not draft.recurrent

    def reach(self, shape: TreeShape) -> int:
        s, k = shape.num_steps, shape.topk
        return max(s - 1, 0) * k + int(self.draft.root_in_window)

    def chains(self, shape: TreeShape) -> bool:
        return shape.topk == 1

    def idle_hints(self, batch: int) -> None:
        return None

    def prefill(self, params, kv, batch, features, next_ids, run):
        rows = batch.logits_indices.shape[0]
        draft = self.draft
        if not draft.uses_target_features:
            extra = dict(state_slots=batch.state_slots) if draft.recurrent else {}
            _, kv = draft.forward(params, kv, batch.input_ids, batch.positions, None,
                                  batch.attention, from_target=True, **extra)
            return jnp.zeros((rows, 0), self.slot_dtype), kv

        def extend(kv):  # -> root outputs f[rows, H], kv
            hidden, kv = draft.forward(params, kv, next_ids, batch.positions, features,
                                       batch.attention, from_target=True)
            return hidden[batch.logits_indices], kv

        def skip(kv):
            return jnp.zeros((rows, self.slot_width), self.slot_dtype), kv

        return jax.lax.cond(run, extend, skip, kv)

    def propose(self, params, kv, inputs, page_table, state_slots, hints, *, shape):
        """Grow each request's tree of `shape` from its root. The one-node shape (plain
        decoding) runs no draft at all."""
        roots = inputs.root_tokens
        if shape.num_draft_tokens == 1:
            return DraftTree(roots[:, None], jnp.full((roots.shape[0], 1), -1, jnp.int32)), kv
        root_hidden = root_logits = None
        if self.draft.uses_target_features:
            root_hidden = inputs.draft
            root_logits = self.draft.logits(params, root_hidden)
        return grow_tree(self.draft, params, kv, roots, root_hidden, root_logits,
                         inputs.kv_lens, page_table, inputs.active, shape=shape,
                         page_size=self.page_size, state_slots=state_slots)

    def advance(self, params, kv, tree, verified, inputs, page_table, state_slots):
        """Extend the draft over the accepted path: its output at the new root is the
        bonus token's pair (f[B, 0] for a draft that reads no target features)."""
        verdict = verified.verdict
        if self.draft.uses_target_features:  # pairs (features of node, the token after it)
            tokens = verdict.tokens
        else:  # the accepted path's own tokens, root first
            tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(verdict.path, 0), axis=1)
        valid = jnp.where(inputs.active, verdict.num_accepted + 1, 0)
        return self.extend(params, kv, tokens, verified.features, page_table, inputs.kv_lens,
                           valid, jnp.where(inputs.active, state_slots, 0))

    def extend(self, params, kv: list[LayerKV],
               tokens: jax.Array,  # i32[B, W]: the draft's input per position
               features: jax.Array | None,  # f[B*W, F]: the target's, per position
               page_table: jax.Array,  # i32[B, P]
               start: jax.Array,  # i32[B]: tokens the draft's cache holds
               valid: jax.Array,  # i32[B]: real positions per row (0: nothing written)
               state_slots: jax.Array,  # i32[B]: a recurrent draft's slots (0: none)
               ) -> tuple[jax.Array, list[LayerKV]]:
        """Run the draft over `valid` new positions per row from `start`; returns its output
        at each row's last one (f[B, H]; f[B, 0] for a draft that reads no target features).
        A recurrent draft runs them as a chain from each row's committed state and commits
        the state after the last."""
        batch, width = tokens.shape
        metadata = window_metadata(page_table, start, valid, width, self.page_size)
        positions = (start[:, None] + jnp.arange(width)).reshape(-1)
        last = jnp.maximum(valid - 1, 0)
        extra = {}
        if self.draft.recurrent:
            chain = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32) - 1, (batch, width))
            extra = dict(tree=gated_delta_net.TreeLayout(
                state_slots, chain, jnp.arange(width)[None, :] < valid[:, None]), commit=last)
        hidden, kv = self.draft.forward(params, kv, tokens.reshape(-1), positions, features,
                                        metadata, from_target=True, **extra)
        if not self.draft.uses_target_features:
            return jnp.zeros((batch, 0), self.slot_dtype), kv
        root_hidden = jnp.take_along_axis(hidden.reshape(batch, width, -1),
                                          last[:, None, None], axis=1)[:, 0]
        return root_hidden, kv
