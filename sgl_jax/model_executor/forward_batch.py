"""From host-side sequence chunks to the dense, bucketed int32 arrays a jitted step consumes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers.attention import AttentionMetadata
from sgl_jax.layers.attention.metadata import pack_mask_bits


@dataclass(frozen=True)
class SeqChunk:
    """The new tokens of one sequence in one step (a prefill chunk, a decode token, a window)."""

    token_ids: Sequence[int]
    prefix_len: int  # tokens of this sequence already in the KV cache
    page_ids: Sequence[int]  # the sequence's pages, covering prefix_len + len(token_ids) tokens
    positions: Sequence[int] | None = None  # default: prefix_len, prefix_len + 1, ...
    # bool[n, n]: window token i sees window token j (tree verification); None = causal.
    tree_mask: np.ndarray | None = None
    # Hybrid models: the sequence's recurrent-state slot (0, the null slot, for the others).
    state_slot: int = 0


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    logits_indices: jax.Array  # i32[N]: tokens whose logits the step returns
    attention: AttentionMetadata
    state_slots: jax.Array  # i32[NB]: each query block's sequence's state slot (0: padding)


jax.tree_util.register_dataclass(
    ForwardBatch,
    data_fields=["input_ids", "positions", "logits_indices", "attention", "state_slots"],
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

    num_tokens: int  # T: flat new tokens, padding included
    q_block: int  # tokens per query block; every sequence starts on a block boundary
    pages_per_seq: int  # P: page table width, fixed by the context length
    num_logits: int  # N: tokens whose logits are computed

    @property
    def num_blocks(self) -> int:
        return self.num_tokens // self.q_block

    def with_logits_for_every_token(self) -> BatchShape:
        return dataclasses.replace(self, num_logits=self.num_tokens)


# Extend batches align each sequence's chunk to blocks of this many tokens, so attention can
# treat a block as part of one sequence. Small blocks waste little on short prompts.
EXTEND_Q_BLOCK = 16


def aligned(num_tokens: int, q_block: int = EXTEND_Q_BLOCK) -> int:
    """Tokens a chunk occupies in an extend batch."""
    return -(-num_tokens // q_block) * q_block


@dataclass(frozen=True)
class Buckets:
    """The padded shapes steps may take: a decode batch is padded to a batch-size bucket, an
    extend batch (prefill chunks, verify windows) to a token bucket."""

    token_paddings: tuple[int, ...]  # ascending multiples of EXTEND_Q_BLOCK
    bs_paddings: tuple[int, ...]  # ascending
    context_len: int  # longest sequence (prompt + output) a request may reach
    page_size: int

    def __post_init__(self) -> None:
        if any(t % EXTEND_Q_BLOCK for t in self.token_paddings):
            raise ValueError(
                f"token paddings must be multiples of {EXTEND_Q_BLOCK}, got {self.token_paddings}"
            )

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

    def shape_for(self, chunks: Sequence[SeqChunk]) -> BatchShape:
        if all(len(c.token_ids) == 1 and c.tree_mask is None for c in chunks):
            return self.decode_shape(len(chunks))
        needed = sum(aligned(len(c.token_ids)) for c in chunks)
        return self.extend_shape(
            _pad_to(self.token_paddings, needed, "tokens (block-aligned) in an extend batch"))

    def extend_shape(self, tokens: int) -> BatchShape:
        """The shape of an extend batch of token bucket `tokens`."""
        return BatchShape(tokens, EXTEND_Q_BLOCK, self.pages_per_seq, tokens // EXTEND_Q_BLOCK)

    def decode_shape(self, num_seqs: int) -> BatchShape:
        """The shape of a decode step of num_seqs sequences (one token each)."""
        seqs = self.batch_padding(num_seqs)
        return BatchShape(seqs, 1, self.pages_per_seq, seqs)

    def batch_padding(self, num_seqs: int) -> int:
        """The padded batch size for num_seqs sequences (decode steps, verify rounds)."""
        return _pad_to(self.bs_paddings, num_seqs, "sequences in a decode batch")

    def all_shapes(self) -> list[BatchShape]:
        decode = [BatchShape(s, 1, self.pages_per_seq, s) for s in self.bs_paddings]
        return decode + [self.extend_shape(t) for t in self.token_paddings]

    def prompt_width(self, length: int) -> int:
        return _pad_to(self.prompt_widths(), length, "prompt tokens")

    def prompt_widths(self) -> tuple[int, ...]:
        # One width: a prompt's ids are a few KiB even at full context, while every extra
        # width is one more program to compile at start-up.
        return powers_of_two(16, self.context_len)[-1:]


def default_token_paddings(max_tokens: int) -> tuple[int, ...]:
    """64, 256, 1024, ... capped at max_tokens (rounded to a block): each extend bucket costs a
    compilation, and prefill tolerates padding far better than decode does."""
    top = aligned(max_tokens)
    sizes = [s for s in powers_of_two(64, top, step=4) if s < top]
    return (*sizes, top)


def _pad_to(paddings: tuple[int, ...], n: int, what: str) -> int:
    for size in paddings:
        if n <= size:
            return size
    raise ValueError(f"{n} {what} exceed the largest bucket ({paddings[-1]})")


def build_forward_batch(
    chunks: Sequence[SeqChunk], *, page_size: int, shape: BatchShape
) -> ForwardBatch:
    """Pack chunks into arrays of the given padded shape, each chunk starting on a query-block
    boundary. Logits are for each chunk's last token, or for every token position when
    shape.num_logits == shape.num_tokens."""
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
    if (q_lens == 0).any():
        raise ValueError("every chunk needs at least one new token")
    qb = shape.q_block
    starts = np.concatenate([[0], np.cumsum(-(-q_lens // qb) * qb)[:-1]]).astype(np.int32)
    if len(chunks) and starts[-1] + aligned(int(q_lens[-1]), qb) > shape.num_tokens:
        raise ValueError(f"chunks need more than the batch's {shape.num_tokens} tokens")

    input_ids = np.zeros(shape.num_tokens, np.int32)
    positions = np.zeros(shape.num_tokens, np.int32)
    slot_mapping = np.zeros(shape.num_tokens, np.int32)  # padding writes into the null page
    page_table = np.zeros((shape.num_blocks, shape.pages_per_seq), np.int32)
    kv_lens = np.zeros(shape.num_blocks, np.int32)
    window_starts = np.zeros(shape.num_blocks, np.int32)
    q_starts = np.zeros(shape.num_blocks, np.int32)
    state_slots = np.zeros(shape.num_blocks, np.int32)
    for chunk, start, q_len in zip(chunks, starts, q_lens, strict=True):
        span = slice(start, start + q_len)
        kv_index = chunk.prefix_len + np.arange(q_len)
        input_ids[span] = chunk.token_ids
        positions[span] = kv_index if chunk.positions is None else chunk.positions
        pages = np.asarray(chunk.page_ids, np.int32)
        _check_pages(chunk, pages, shape, page_size)
        slot_mapping[span] = pages[kv_index // page_size] * page_size + kv_index % page_size
        blocks = slice(start // qb, (start + aligned(int(q_len), qb)) // qb)
        page_table[blocks, : len(pages)] = pages
        kv_lens[blocks] = chunk.prefix_len + q_len
        window_starts[blocks] = chunk.prefix_len
        q_starts[blocks] = np.arange(blocks.stop - blocks.start) * qb
        state_slots[blocks] = chunk.state_slot

    if shape.num_logits == shape.num_tokens:
        logits_indices = np.arange(shape.num_tokens, dtype=np.int32)
    else:
        logits_indices = np.zeros(shape.num_logits, np.int32)
        logits_indices[: len(chunks)] = starts + q_lens - 1
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        page_table=page_table,
        kv_lens=kv_lens,
        window_starts=window_starts,
        q_starts=q_starts,
        tree_bits=_tree_bits(chunks, starts, shape.num_tokens),
        q_block=qb,
    )
    return ForwardBatch(input_ids, positions, logits_indices, metadata, state_slots)


def build_decode_batch(
    input_ids: np.ndarray,  # i32[n]: each row's last token (-1: still on the device)
    kv_lens: np.ndarray,  # i32[n]: tokens already in the cache before this one
    page_table: np.ndarray,  # i32[n, P]: each row's pages, then the null page
    state_slots: np.ndarray,  # i32[n]: hybrid models' state slots (0: none)
    *, page_size: int, shape: BatchShape,
) -> ForwardBatch:
    """A decode batch (one new token per row) from row arrays, without a loop over rows:
    what build_forward_batch gives for single-token chunks. Padding rows (up to the shape's
    batch size) attend to nothing and write into the null page."""
    n, rows = len(input_ids), shape.num_tokens
    if shape.q_block != 1 or n > rows:
        raise ValueError(f"{n} decode rows do not fit the shape {shape}")
    if (kv_lens >= page_table.shape[1] * page_size).any():
        raise ValueError("a decode row's token lies past its page table")
    pages = np.take_along_axis(page_table, (kv_lens // page_size)[:, None], axis=1)[:, 0]
    if (pages == 0).any():
        raise ValueError("a decode row's token has no page (reserve it first)")
    table = np.zeros((rows, shape.pages_per_seq), np.int32)
    table[:n, : page_table.shape[1]] = page_table
    metadata = AttentionMetadata(
        slot_mapping=_padded(pages * page_size + kv_lens % page_size, rows),
        page_table=table,
        kv_lens=_padded(kv_lens + 1, rows),
        window_starts=_padded(kv_lens, rows),
        q_starts=np.zeros(rows, np.int32),
        tree_bits=None,
        q_block=1,
    )
    return ForwardBatch(_padded(input_ids, rows), _padded(kv_lens, rows),
                        np.arange(rows, dtype=np.int32), metadata, _padded(state_slots, rows))


def _padded(values: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros(rows, np.int32)
    out[: len(values)] = values
    return out


def token_positions(chunks: Sequence[SeqChunk], shape: BatchShape) -> list[np.ndarray]:
    """Where each chunk's tokens sit in the flat (block-aligned) batch."""
    starts, position = [], 0
    for chunk in chunks:
        starts.append(np.arange(position, position + len(chunk.token_ids)))
        position += aligned(len(chunk.token_ids), shape.q_block)
    return starts


def _check_pages(chunk: SeqChunk, pages: np.ndarray, shape: BatchShape, page_size: int) -> None:
    needed = -(-(chunk.prefix_len + len(chunk.token_ids)) // page_size)
    if len(pages) < needed:
        raise ValueError(f"chunk needs {needed} pages of {page_size} tokens, got {len(pages)}")
    if len(pages) > shape.pages_per_seq:
        raise ValueError(
            f"chunk has {len(pages)} pages; the page table holds {shape.pages_per_seq} per "
            "sequence (the context length)"
        )


def _tree_bits(
    chunks: Sequence[SeqChunk], starts: np.ndarray, num_tokens: int
) -> np.ndarray | None:
    """i32[T, cdiv(W, 32)]: each token's packed tree-mask row over its chunk's new tokens
    (W = the longest chunk), or None when every chunk is causal."""
    has_mask = [c.tree_mask is not None for c in chunks]
    if not any(has_mask):
        return None
    if not all(has_mask):
        raise ValueError("a batch with tree masks must give one for every chunk")
    mask = np.zeros((num_tokens, max(len(c.token_ids) for c in chunks)), bool)
    for chunk, start in zip(chunks, starts, strict=True):
        n = len(chunk.token_ids)
        if chunk.tree_mask.shape != (n, n):
            raise ValueError(f"tree_mask must be [{n}, {n}], got {list(chunk.tree_mask.shape)}")
        mask[start : start + n, :n] = chunk.tree_mask
    return pack_mask_bits(mask)


# ---------------------------------------------------------------- windows built on the device


def kv_slots(page_table: jax.Array, kv_index: jax.Array, page_size: int) -> jax.Array:
    """page_table i32[B, P], kv_index i32[B, W] -> flat cache slots i32[B, W]. Indices past the
    page table go to the null slot 0 instead of wrapping onto a real page."""
    num_pages = page_table.shape[1]
    page_index = kv_index // page_size
    pages = jnp.take_along_axis(page_table, jnp.clip(page_index, 0, num_pages - 1), axis=1)
    return jnp.where(page_index < num_pages, pages * page_size + kv_index % page_size, 0)


def window_metadata(
    page_table: jax.Array,  # i32[B, P]
    prefix_lens: jax.Array,  # i32[B]: tokens of each sequence already in the cache
    num_valid: jax.Array,  # i32[B]: real tokens in each window (0 for a padding row)
    width: int,  # W, static: tokens per window, padding included
    page_size: int,
    tree_mask: jax.Array | None = None,  # bool[B, W, W]; None = causal
) -> AttentionMetadata:
    """Attention metadata for B windows of W new tokens each, built inside a jitted step
    (speculative verify and draft steps): every window is one query block. Padding tokens
    write into the null slot."""
    offsets = jnp.arange(width)[None, :]
    slots = kv_slots(page_table, prefix_lens[:, None] + offsets, page_size)
    slots = jnp.where(offsets < num_valid[:, None], slots, 0)
    return AttentionMetadata(
        slot_mapping=slots.reshape(-1),
        page_table=page_table,
        kv_lens=jnp.where(num_valid > 0, prefix_lens + num_valid, 0),
        window_starts=prefix_lens,
        q_starts=jnp.zeros_like(prefix_lens),
        tree_bits=None if tree_mask is None else pack_mask_bits(tree_mask.reshape(-1, width)),
        q_block=width,
    )
