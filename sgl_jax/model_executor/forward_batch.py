"""From host-side sequence chunks to the dense, bucketed int32 arrays a jitted step consumes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from sgl_jax.layers.attention import AttentionMetadata


@dataclass(frozen=True)
class SeqChunk:
    """The new tokens of one sequence in one step (a prefill chunk, a decode token, a window)."""

    token_ids: Sequence[int]
    prefix_len: int  # tokens of this sequence already in the KV cache
    page_ids: Sequence[int]  # the sequence's pages, covering prefix_len + len(token_ids) tokens
    positions: Sequence[int] | None = None  # default: prefix_len, prefix_len + 1, ...
    # bool[n, n]: window token i sees window token j (tree verification); None = causal.
    tree_mask: np.ndarray | None = None


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    logits_indices: jax.Array  # i32[N]: tokens whose logits the step returns
    attention: AttentionMetadata


jax.tree_util.register_dataclass(
    ForwardBatch,
    data_fields=["input_ids", "positions", "logits_indices", "attention"],
    meta_fields=[],
)


def bucket(n: int) -> int:
    """Round up to a power of two so a handful of shapes serve every batch."""
    return 1 << max(n - 1, 0).bit_length()


def build_forward_batch(
    chunks: Sequence[SeqChunk], *, page_size: int, all_logits: bool = False
) -> ForwardBatch:
    """Pack chunks into bucketed arrays. Logits are for each chunk's last token, or every token."""
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
    if (q_lens == 0).any():
        raise ValueError("every chunk needs at least one new token")
    num_tokens, num_seqs = bucket(int(q_lens.sum())), bucket(len(chunks))
    pages_per_seq = bucket(max(len(c.page_ids) for c in chunks))
    cu_q_lens = np.zeros(num_seqs + 1, np.int32)
    cu_q_lens[1 : len(chunks) + 1] = np.cumsum(q_lens)
    cu_q_lens[len(chunks) + 1 :] = cu_q_lens[len(chunks)]

    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # padding writes into the null page
    kv_lens = np.zeros(num_seqs, np.int32)
    page_table = np.zeros((num_seqs, pages_per_seq), np.int32)
    for s, chunk in enumerate(chunks):
        span = slice(cu_q_lens[s], cu_q_lens[s + 1])
        kv_index = chunk.prefix_len + np.arange(q_lens[s])
        input_ids[span] = chunk.token_ids
        positions[span] = kv_index if chunk.positions is None else chunk.positions
        pages = np.asarray(chunk.page_ids, np.int32)
        _check_pages(chunk, pages, page_size)
        slot_mapping[span] = pages[kv_index // page_size] * page_size + kv_index % page_size
        kv_lens[s] = chunk.prefix_len + q_lens[s]
        page_table[s, : len(pages)] = pages

    max_q_len = bucket(int(q_lens.max()))
    if all_logits:
        logits_indices = np.arange(num_tokens, dtype=np.int32)
    else:
        logits_indices = np.zeros(num_seqs, np.int32)
        logits_indices[: len(chunks)] = cu_q_lens[1 : len(chunks) + 1] - 1
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        page_table=page_table,
        custom_mask=_custom_mask(chunks, cu_q_lens, num_tokens, max_q_len),
        max_q_len=max_q_len,
    )
    return ForwardBatch(input_ids, positions, logits_indices, metadata)


def _check_pages(chunk: SeqChunk, pages: np.ndarray, page_size: int) -> None:
    needed = -(-(chunk.prefix_len + len(chunk.token_ids)) // page_size)
    if len(pages) < needed:
        raise ValueError(f"chunk needs {needed} pages of {page_size} tokens, got {len(pages)}")


def _custom_mask(
    chunks: Sequence[SeqChunk], cu_q_lens: np.ndarray, num_tokens: int, width: int
) -> np.ndarray | None:
    """bool[T, W] rows of each chunk's tree mask, or None when every chunk is causal."""
    has_mask = [c.tree_mask is not None for c in chunks]
    if not any(has_mask):
        return None
    if not all(has_mask):
        raise ValueError("a batch with tree masks must give one for every chunk")
    mask = np.zeros((num_tokens, width), bool)
    for s, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        if chunk.tree_mask.shape != (n, n):
            raise ValueError(f"tree_mask must be [{n}, {n}], got {list(chunk.tree_mask.shape)}")
        mask[cu_q_lens[s] : cu_q_lens[s] + n, :n] = chunk.tree_mask
    return mask
