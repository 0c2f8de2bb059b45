"""Drafters: what proposes each round's trees, behind one interface.

A drafter takes part in the runner's programs (spec_runner.py):

- the prefill, where it may read the target's features over the prompt (`prefill`);
- each round, where it proposes a tree per row within the round's shape (`propose`) and,
  once the target has accepted a path, advances over the accepted tokens (`advance`);
- a catch-up, for drafters that plain rounds may leave behind (`defers`, `catch_up`).

What it keeps between rounds lives in its own paged KV cache (`cache`: its shapes; the
runner allocates it with the target's page ids) and in one row per request slot
(`SlotState.draft`, `slot_width` wide). A drafter that works on the host (NGRAM) hands its
proposals to the round as `RoundRows.hints`, made by its `Proposer`.

The drafters, one module each in this folder: `HeadDrafter` (EAGLE3, EAGLE, NEXTN: eagle.py),
`StandaloneDrafter` (standalone.py), `DFlashDrafter` (dflash.py), `DSparkDrafter` (dspark.py),
`NgramDrafter` (ngram/drafter.py); each algorithm's factory (factories.py) builds one with its
proposer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import ModelCache
from sgl_jax.mem_cache.kv_cache import allocate_kv_cache, kv_bytes_per_token
from sgl_jax.mem_cache.state_pool import state_bytes_per_slot
from sgl_jax.model_executor.forward_batch import ForwardBatch
from sgl_jax.models.config import ModelConfig
from sgl_jax.parallel import TensorParallel
from sgl_jax.scheduler.req import Req
from sgl_jax.speculative.round.program import RoundInputs, Verified
from sgl_jax.speculative.round.tree import DraftTree
from sgl_jax.speculative.spec_config import TreeShape


@dataclass(frozen=True)
class DraftCache:
    """A drafter's own paged cache: its layers' shapes. It uses the target's page ids (one
    allocator serves both), is split over the target's mesh by the same rules and stores the
    target's KV dtype; a recurrent draft keeps its states in the target's state slots."""

    config: ModelConfig
    recurrent: bool = False

    def bytes_per_token(self, kv_dtype: Any, tp: TensorParallel) -> int:
        return kv_bytes_per_token(self.config, kv_dtype, tp)

    def state_bytes_per_slot(self, dtype: Any, tp: TensorParallel) -> int:
        return state_bytes_per_slot(self.config, dtype, tp) if self.recurrent else 0

    def allocate(self, *, num_pages: int, page_size: int, dtype: Any, tp: TensorParallel,
                 num_state_slots: int, kv_dtype: Any) -> ModelCache:
        return allocate_kv_cache(self.config, num_pages=num_pages, page_size=page_size,
                                 dtype=dtype, tp=tp, kv_dtype=kv_dtype,
                                 num_state_slots=num_state_slots if self.recurrent else 0)


class Drafter(Protocol):
    features: str  # what it reads of the target: "aux" (captured layers), "final" or ""
    capture_layers: tuple[int, ...]  # the target layers "aux" features are taken from
    defers: bool  # plain rounds may leave it behind, to be caught up later (`catch_up`)
    advances_on_plain: bool  # a plain round must still advance it (else: the target's step)
    full_depth: bool  # every tree reaches the round's depth (else its depth varies by row)
    # Its cache slot t pairs the target's features at t with token t+1 (EAGLE's heads), so a
    # prompt's last cached slot needs the token after the prompt, and a cached page's last
    # slot the token after the page (speculative/next_token_pages.py).
    pairs_next_token: bool
    slot_width: int  # D: its per-slot state SlotState.draft [S, D]
    slot_dtype: Any
    params: Any  # its weights (shared target arrays included), or {}
    cache: DraftCache | None  # its own paged cache (None: it keeps none)

    def reach(self, shape: TreeShape) -> int:
        """KV slots past kv_len its windows write in a round of `shape`."""

    def chains(self, shape: TreeShape) -> bool:
        """Whether every tree it proposes in a round of `shape` is a chain."""

    def idle_hints(self, batch: int) -> Any:
        """`RoundRows.hints` for rows it proposes nothing for (None: it takes no hints)."""

    def prefill(self, params, kv, batch: ForwardBatch, features: jax.Array | None,
                next_ids: jax.Array, run: jax.Array) -> tuple[jax.Array, ModelCache]:
        """Extend over a prefill batch; returns its slot rows [rows, D] at each chunk's last
        token (written where the chunk completes a prompt)."""

    def propose(self, params, kv, inputs: RoundInputs, page_table: jax.Array,
                state_slots: jax.Array, hints: Any, *, shape: TreeShape
                ) -> tuple[DraftTree, ModelCache]:
        """A tree per row of `shape`, which has more than one node (the runner handles the
        one-node shape, plain decoding, without asking)."""

    def advance(self, params, kv, tree: DraftTree, verified: Verified, inputs: RoundInputs,
                page_table: jax.Array, state_slots: jax.Array
                ) -> tuple[jax.Array, ModelCache]:
        """Move past the accepted tokens; returns the new slot rows [B, D]."""

    def catch_up(self, params, kv: ModelCache,
                 tokens: jax.Array,  # i32[B, W]: the token after each pending position
                 features: jax.Array,  # f[B*W, F]: the target's, per pending position
                 page_table: jax.Array,  # i32[B, P]
                 start: jax.Array,  # i32[B]: tokens the draft's cache holds
                 valid: jax.Array,  # i32[B]: pending positions per row (0: nothing written)
                 ) -> tuple[jax.Array, ModelCache]:
        """Extend over the positions plain rounds left behind (only asked of a drafter that
        `defers`); returns the slot rows [B, D] at each row's last one."""


def root_only_tree(roots: jax.Array) -> DraftTree:
    """roots i32[B] as one-node trees: a round of the one-node shape (plain decoding)."""
    return DraftTree(roots[:, None], jnp.full((roots.shape[0], 1), -1, jnp.int32))


class Proposer(Protocol):
    """The host half of a drafter that proposes on the host, fed every token the host reads
    (speculative/decode_loop.py calls it)."""

    on_host: bool  # whether `hints` does work on the host (then asked only where it may pay)

    def add_request(self, req: Req) -> None:
        """A request is admitted (again, after a retraction)."""

    def extend(self, emitted: Sequence[tuple[Req, list[int], bool]]) -> None:
        """A settled step's new tokens: (request, its token ids, whether they finished it)."""

    def finish(self, req: Req) -> None: ...

    def flush(self) -> None:
        """Forget what finished requests left (the server's caches are flushed)."""

    def hints(self, reqs: Sequence[Req], padded: int) -> Any:
        """RoundRows.hints for a round of `reqs`, padded to `padded` rows."""

    def offered(self, hints: Any, rows: int) -> list[bool]:
        """Per request of `hints`' first `rows`: whether it has a draft to offer."""


class NoProposer:
    """For drafters that propose on the device alone."""

    on_host = False

    def add_request(self, req: Req) -> None:
        pass

    def extend(self, emitted: Sequence[tuple[Req, list[int], bool]]) -> None:
        pass

    def finish(self, req: Req) -> None:
        pass

    def flush(self) -> None:
        pass

    def hints(self, reqs: Sequence[Req], padded: int) -> None:
        return None

    def offered(self, hints: None, rows: int) -> list[bool]:
        return [True] * rows
