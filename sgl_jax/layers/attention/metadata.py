"""What every attention backend receives besides q/k/v: where a ragged batch lives in the cache.

A batch is the concatenation of S sequences' *new* tokens (prefill chunks, single decode tokens
or verify windows). Sequence s owns tokens cu_q_lens[s]:cu_q_lens[s+1] of the flat array; its
KV after this step has kv_lens[s] entries, the first kv_lens[s] - q_len[s] of which (the
prefix) were written by earlier steps. Padding sequences have q_len = kv_len = 0; padding
tokens write their K/V into the reserved null page 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import jax


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # i32[T]: flat cache slot (page * page_size + offset) of each new token
    cu_q_lens: jax.Array  # i32[S + 1]: start of each sequence's new tokens in the flat batch
    kv_lens: jax.Array  # i32[S]: KV length of each sequence after this step
    page_table: jax.Array  # i32[S, P]: pages of each sequence, in order (padding -> page 0)
    # bool[T, W] or None: custom_mask[t, w] says whether token t sees the w-th new token of its
    # own sequence (tree verification). The prefix is always fully visible. None = causal.
    custom_mask: jax.Array | None = None
    max_q_len: int = 1  # static: the longest q_len in the batch, rounded to a bucket

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "cu_q_lens", "kv_lens", "page_table", "custom_mask"],
    meta_fields=["max_q_len"],
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
