"""From host-side sequence chunks to the dense, bucketed int32 arrays a jitted step consumes."""

from __future__ import annotations

import dataclasses
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
    """Round up to a power of two."""
    return 1 << max(n - 1, 0).bit_length()


def powers_of_two(low: int, high: int, step: int = 2) -> tuple[int, ...]:
    """low, low*step, ... up to the first such size >= high."""
    sizes = [low]
    while sizes[-1] < high:
        sizes.append(sizes[-1] * step)
    return tuple(sizes)


@dataclass(frozen=True)
class BatchShape:
    """The static shape of one compiled step."""

    num_tokens: int  # T: flat new tokens
    num_seqs: int  # S: sequences (rows of the page table, of logits)
    pages_per_seq: int  # P: page table width, fixed by the context length
    max_q_len: int  # Q: query rows per sequence in attention
    num_logits: int  # N: tokens whose logits are computed

    def with_logits_for_every_token(self) -> BatchShape:
        return dataclasses.replace(self, num_logits=self.num_tokens)


# An extend batch lays queries out as [S, T] in attention, so it holds only a few sequences.
MAX_EXTEND_SEQS = 8


@dataclass(frozen=True)
class Buckets:
    """The padded shapes steps may take: a decode batch is padded to a batch-size bucket, an
    extend batch (prefill chunks, verify windows) to a token bucket and a small sequence count."""

    token_paddings: tuple[int, ...]  # ascending
    bs_paddings: tuple[int, ...]  # ascending
    context_len: int  # longest sequence (prompt + output) a request may reach
    page_size: int

    @classmethod
    def automatic(
        cls, *, max_tokens: int, max_seqs: int, context_len: int, page_size: int
    ) -> Buckets:
        return cls(default_token_paddings(max_tokens), powers_of_two(1, max_seqs), context_len,
                   page_size)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context_len // self.page_size)

    @property
    def max_tokens(self) -> int:
        return self.token_paddings[-1]

    @property
    def max_seqs(self) -> int:
        return self.bs_paddings[-1]

    @property
    def extend_seq_paddings(self) -> tuple[int, ...]:
        return tuple(s for s in self.bs_paddings if s <= MAX_EXTEND_SEQS) or self.bs_paddings[:1]

    def shape_for(self, chunks: Sequence[SeqChunk]) -> BatchShape:
        if all(len(c.token_ids) == 1 and c.tree_mask is None for c in chunks):
            seqs = _pad_to(self.bs_paddings, len(chunks), "sequences in a decode batch")
            return BatchShape(seqs, seqs, self.pages_per_seq, 1, seqs)
        tokens = _pad_to(self.token_paddings, sum(len(c.token_ids) for c in chunks), "tokens")
        seqs = _pad_to(self.extend_seq_paddings, len(chunks), "sequences in an extend batch")
        return BatchShape(tokens, seqs, self.pages_per_seq, tokens, seqs)

    def all_shapes(self) -> list[BatchShape]:
        decode = [BatchShape(s, s, self.pages_per_seq, 1, s) for s in self.bs_paddings]
        extend = [
            BatchShape(t, s, self.pages_per_seq, t, s)
            for i, t in enumerate(self.token_paddings)
            for s in self.extend_seq_paddings
            if s <= t and self._reachable(i, s)
        ]
        return decode + extend

    def _reachable(self, token_bucket: int, seqs: int) -> bool:
        """Can s sequences (each at most a context long) fill more than the bucket below?"""
        below = self.token_paddings[token_bucket - 1] if token_bucket else 0
        return below < seqs * self.context_len

    def prompt_width(self, length: int) -> int:
        return _pad_to(self.prompt_widths(), length, "prompt tokens")

    def prompt_widths(self) -> tuple[int, ...]:
        return powers_of_two(16, self.context_len)


def default_token_paddings(max_tokens: int) -> tuple[int, ...]:
    """64, 256, 1024, ... capped at max_tokens: each extend bucket costs a compilation, and
    prefill tolerates padding far better than decode does."""
    sizes = [s for s in powers_of_two(64, max_tokens, step=4) if s < max_tokens]
    return (*sizes, max_tokens)


def _pad_to(paddings: tuple[int, ...], n: int, what: str) -> int:
    for size in paddings:
        if n <= size:
            return size
    raise ValueError(f"{n} {what} exceed the largest bucket ({paddings[-1]})")


def build_forward_batch(
    chunks: Sequence[SeqChunk], *, page_size: int, shape: BatchShape
) -> ForwardBatch:
    """Pack chunks into arrays of the given padded shape; logits are for each chunk's last
    token, or for every token when shape.num_logits == shape.num_tokens."""
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
    if (q_lens == 0).any():
        raise ValueError("every chunk needs at least one new token")
    num_tokens, num_seqs = shape.num_tokens, shape.num_seqs
    cu_q_lens = np.zeros(num_seqs + 1, np.int32)
    cu_q_lens[1 : len(chunks) + 1] = np.cumsum(q_lens)
    cu_q_lens[len(chunks) + 1 :] = cu_q_lens[len(chunks)]

    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # padding writes into the null page
    kv_lens = np.zeros(num_seqs, np.int32)
    page_table = np.zeros((num_seqs, shape.pages_per_seq), np.int32)
    for s, chunk in enumerate(chunks):
        span = slice(cu_q_lens[s], cu_q_lens[s + 1])
        kv_index = chunk.prefix_len + np.arange(q_lens[s])
        input_ids[span] = chunk.token_ids
        positions[span] = kv_index if chunk.positions is None else chunk.positions
        pages = np.asarray(chunk.page_ids, np.int32)
        _check_pages(chunk, pages, shape, page_size)
        slot_mapping[span] = pages[kv_index // page_size] * page_size + kv_index % page_size
        kv_lens[s] = chunk.prefix_len + q_lens[s]
        page_table[s, : len(pages)] = pages

    if shape.num_logits == num_tokens:
        logits_indices = np.arange(num_tokens, dtype=np.int32)
    else:
        logits_indices = np.zeros(num_seqs, np.int32)
        logits_indices[: len(chunks)] = cu_q_lens[1 : len(chunks) + 1] - 1
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        page_table=page_table,
        custom_mask=_custom_mask(chunks, cu_q_lens, num_tokens, shape.max_q_len),
        max_q_len=shape.max_q_len,
    )
    return ForwardBatch(input_ids, positions, logits_indices, metadata)


def _check_pages(chunk: SeqChunk, pages: np.ndarray, shape: BatchShape, page_size: int) -> None:
    needed = -(-(chunk.prefix_len + len(chunk.token_ids)) // page_size)
    if len(pages) < needed:
        raise ValueError(f"chunk needs {needed} pages of {page_size} tokens, got {len(pages)}")
    if len(pages) > shape.pages_per_seq:
        raise ValueError(
            f"chunk has {len(pages)} pages; the page table holds {shape.pages_per_seq} per "
            "sequence (the context length)"
        )


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
