"""What every attention backend receives besides q/k/v: where a ragged batch lives in the cache.

A batch is the concatenation of several sequences' *new* tokens (prefill chunks, single decode
tokens or verify windows), laid out in query blocks of `q_block` tokens: each sequence's
tokens start on a block boundary, so every block belongs to exactly one sequence (a decode
batch uses q_block = 1). Per block the metadata gives that sequence's pages and lengths. The
sequence's KV after this step has kv_len entries; its new tokens occupy KV indices
window_start .. kv_len - 1, and everything before window_start (the prefix) was written by
earlier steps. Padding tokens write their K/V into the reserved null page 0; padding blocks
have kv_len 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import jax


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # i32[T]: flat cache slot (page * page_size + offset) of each token
    page_table: jax.Array  # i32[NB, P]: pages of each query block's sequence (padding -> 0)
    kv_lens: jax.Array  # i32[NB]: KV length of the block's sequence after this step
    window_starts: jax.Array  # i32[NB]: KV index of the sequence's first new token
    q_starts: jax.Array  # i32[NB]: index among the sequence's new tokens of the block's first
    # bool[T, W] or None: custom_mask[t, w] says whether token t sees the w-th new token of its
    # own sequence (tree verification). The prefix is always fully visible. None = causal.
    custom_mask: jax.Array | None = None
    q_block: int = 1  # static: tokens per query block (T = NB * q_block)

    @property
    def num_blocks(self) -> int:
        return self.kv_lens.shape[0]


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "page_table", "kv_lens", "window_starts", "q_starts",
                 "custom_mask"],
    meta_fields=["q_block"],
)

LayerKV = tuple[jax.Array, jax.Array]  # (k_pages, v_pages), each [num_pages, page_size, n_kv, hd]


class AttentionBackend(Protocol):
    """Writes this step's K/V into the layer's paged cache, then attends over it.

    q: [T, n_heads, head_dim]; k, v: [T, n_kv_heads, head_dim].
    Returns the attention output [T, n_heads, head_dim] and the updated layer cache.
    """

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        layer_kv: LayerKV,
        metadata: AttentionMetadata,
        *,
        scale: float,
    ) -> tuple[jax.Array, LayerKV]: ...
