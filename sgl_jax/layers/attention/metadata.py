"""What every attention backend receives besides q/k/v: where a ragged batch lives in the cache.

A batch is the concatenation of several sequences' *new* tokens (prefill chunks, single decode
tokens or verify windows), laid out in query blocks of `q_block` tokens: each sequence's
tokens start on a block boundary, so every block belongs to exactly one sequence (a decode
batch uses q_block = 1). Per block the metadata gives that sequence's pages and lengths. The
sequence's KV after this step has kv_len entries; its new tokens occupy KV indices
window_start .. kv_len - 1, and everything before window_start (the prefix) was written by
earlier steps. Padding tokens write their K/V into the reserved null page 0; padding blocks
have kv_len 0.

A layer with a sliding window of W tokens (a static Python int passed to the backend call;
None = none) also hides every key W or more KV indices behind its query: query i sees key j
only when i - W < j. KV index is position for every sequence here, except inside a branching
tree window, where a query's index is its window slot, not its depth: no caller combines a
branching tree with a window (DFlash's non-causal blocks are not trees).

A packed batch (a verify round whose rows check prefixes of different lengths) keeps only
some tokens of each window: `token_windows` gives each of its T tokens' slot in the window
layout the other fields describe, and the backends attend in that layout (to_windows /
from_windows). So every projection and MLP of the model runs over the T tokens verified, not
over every window's full width.

A tree verify window carries its mask as bits: row t holds one bit per new token of its own
sequence (bit w % 32 of word w // 32 says whether token t sees the w-th new token). A window
of up to 32 tokens costs one int32 per query, built on the device; the prefix is always
fully visible and needs no mask at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # i32[T]: flat cache slot (page * page_size + offset) of each token
    page_table: jax.Array  # i32[NB, P]: pages of each query block's sequence (padding -> 0)
    kv_lens: jax.Array  # i32[NB]: KV length of the block's sequence after this step
    window_starts: jax.Array  # i32[NB]: KV index of the sequence's first new token
    q_starts: jax.Array  # i32[NB]: index among the sequence's new tokens of the block's first
    # i32[T, cdiv(W, 32)] or None: packed tree-mask bits of each token over its sequence's
    # window of W new tokens (see pack_mask_bits). None = causal.
    tree_bits: jax.Array | None = None
    q_block: int = 1  # static: tokens per query block (NB * q_block window slots)
    # i32[T] or None: a packed batch's tokens' slots in the window layout (NB * q_block marks
    # a padding token). None: the batch is the window layout (T = NB * q_block).
    token_windows: jax.Array | None = None

    @property
    def num_blocks(self) -> int:
        return self.kv_lens.shape[0]


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "page_table", "kv_lens", "window_starts", "q_starts",
                 "tree_bits", "token_windows"],
    meta_fields=["q_block"],
)

MASK_WORD_BITS = 32


def token_slots(metadata: AttentionMetadata) -> jax.Array:
    """i32[T]: the cache slot each token of the batch writes (a padding token: the null
    slot)."""
    if metadata.token_windows is None:
        return metadata.slot_mapping
    return jnp.take(metadata.slot_mapping, metadata.token_windows, mode="fill", fill_value=0)


def to_windows(x: jax.Array, metadata: AttentionMetadata) -> jax.Array:
    """[T, ...] per token -> [NB * q_block, ...] in the window layout (slots no token fills:
    zeros)."""
    if metadata.token_windows is None:
        return x
    slots = metadata.num_blocks * metadata.q_block
    return jnp.zeros((slots, *x.shape[1:]), x.dtype).at[metadata.token_windows].set(
        x, mode="drop")


def from_windows(x: jax.Array, metadata: AttentionMetadata) -> jax.Array:
    """[NB * q_block, ...] in the window layout -> [T, ...] per token (padding: zeros)."""
    if metadata.token_windows is None:
        return x
    return jnp.take(x, metadata.token_windows, axis=0, mode="fill", fill_value=0)


def pack_mask_bits(mask):
    """bool[..., W] -> i32[..., cdiv(W, 32)]: bit w % 32 of word w // 32 is mask[..., w].

    numpy in, numpy out (host-built batches); a jax array in, packed on the device."""
    xp = np if isinstance(mask, np.ndarray) else jnp
    width = mask.shape[-1]
    words = -(-width // MASK_WORD_BITS)
    padded = xp.pad(mask.astype(xp.int32),
                    [(0, 0)] * (mask.ndim - 1) + [(0, words * MASK_WORD_BITS - width)])
    bits = padded.reshape(*mask.shape[:-1], words, MASK_WORD_BITS)
    # Distinct powers of two: their int32 sum is their OR (bit 31 wraps to the sign bit).
    return (bits << xp.arange(MASK_WORD_BITS, dtype=xp.int32)).sum(-1, dtype=xp.int32)


def window_visible(words: list[jax.Array], window_offset: jax.Array) -> jax.Array:
    """Tree-mask test for keys inside the window.

    words: the mask words of the query rows, each i32[R, 1]; window_offset: i32[R or 1, C],
    each key's index among the window's tokens (negative for prefix keys, which this does not
    decide). Returns bool[R, C]. Written with shifts and compares only, so kernels on any
    backend can run it on loaded tiles.
    """
    visible = jnp.zeros(jnp.broadcast_shapes(words[0].shape, window_offset.shape), jnp.bool_)
    for j, word in enumerate(words):
        shift = window_offset - j * MASK_WORD_BITS
        in_word = (shift >= 0) & (shift < MASK_WORD_BITS)
        bit = (word >> jnp.clip(shift, 0, MASK_WORD_BITS - 1)) & 1
        visible = visible | (in_word & (bit == 1))
    return visible


def within_sliding_window(key_index: jax.Array, query_index: jax.Array,
                          sliding_window: int) -> jax.Array:
    """Whether each key lies inside its query's sliding window (i - W < j); the arguments
    broadcast to the result's bool shape."""
    return key_index > query_index - sliding_window


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's paged K/V: its pages are `k` and `v` from `first_page` on.

    The pages are [num_pages, n_kv, page_size, hd]. Head-major within a page, so one KV
    head's tokens of a page are one contiguous [page_size, hd] slab: gathering a sequence's
    keys per head (what attention reads) is a plain copy of slabs, with no transpose. A model's
    layers share one pair of arrays (`ModelCache`), each at its own offset, so a step program
    takes and returns two arrays for the whole cache instead of two per layer: every array
    crossing a compiled call costs the dispatching thread its own work, both ways. Page ids,
    slots and page tables are the layer's own (0 .. pages_per_layer - 1); a backend adds the
    offset where it reads and writes (`slots`, and its kernel's `page_offset`)."""

    k: jax.Array  # [num_pages, n_kv, page_size, hd]: every layer's pages
    v: jax.Array
    first_page: int = 0  # static: the layer's page 0

    def slots(self, slots: jax.Array) -> jax.Array:
        """The layer's flat cache slots (page * page_size + offset) in the shared arrays."""
        return slots + self.first_page * self.k.shape[2]

    def write(self, slots: jax.Array, k: jax.Array, v: jax.Array) -> LayerKV:
        """k, v [T, n_kv, hd] written at the layer's slots i32[T], cast to the pages' dtype."""
        slots = self.slots(slots)
        return dataclasses.replace(self, k=write_slots(self.k, slots, k),
                                   v=write_slots(self.v, slots, v))


jax.tree_util.register_dataclass(LayerKV, data_fields=["k", "v"], meta_fields=["first_page"])


@dataclass(frozen=True)
class ModelCache:
    """What a model's layers keep between steps: every attention layer's pages in one pair of
    arrays [A * P, n_kv, page_size, hd] (attention layer a's page p is row a * P + p), and a
    hybrid model's linear layers' recurrent-state pools (`states[i]`; None for attention
    layers). `layer(i)` is what layer i's mixer reads; `with_layer(i, ...)` what it wrote."""

    k: jax.Array | None  # None: a model without attention layers
    v: jax.Array | None
    states: tuple  # per layer: a linear layer's state pool, None for an attention layer
    pages_per_layer: int  # static: P

    @property
    def num_layers(self) -> int:
        return len(self.states)

    def layer(self, i: int):
        """Layer i's cache: its LayerKV view of the shared pages, or its state pool."""
        if self.states[i] is not None:
            return self.states[i]
        return LayerKV(self.k, self.v, self._attention_index(i) * self.pages_per_layer)

    def with_layer(self, i: int, cache) -> ModelCache:
        """The cache after layer i wrote `cache` (what its mixer returned)."""
        if isinstance(cache, LayerKV):
            return dataclasses.replace(self, k=cache.k, v=cache.v)
        states = list(self.states)
        states[i] = cache
        return dataclasses.replace(self, states=tuple(states))

    def with_states(self, states: list) -> ModelCache:
        """Every linear layer's pool replaced (None for attention layers)."""
        return dataclasses.replace(self, states=tuple(states))

    def every_layer_slots(self, slots: jax.Array) -> jax.Array:
        """i32[A, ...]: layer-local slots as every attention layer's slots in the shared
        arrays (one gather or scatter then moves a token's K/V in all layers)."""
        layers = sum(s is None for s in self.states)
        offsets = jnp.arange(layers, dtype=slots.dtype) * self.pages_per_layer * self.k.shape[2]
        return offsets.reshape((layers,) + (1,) * slots.ndim) + slots[None]

    def _attention_index(self, i: int) -> int:
        return sum(s is None for s in self.states[:i])


jax.tree_util.register_dataclass(ModelCache, data_fields=["k", "v", "states"],
                                 meta_fields=["pages_per_layer"])


def write_slots(pages: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """pages [num_pages, n_kv, page_size, hd] with new [T, n_kv, hd] written at the flat cache
    slots i32[T] (slot = page * page_size + offset)."""
    page_size = pages.shape[2]
    return pages.at[slots // page_size, :, slots % page_size].set(new.astype(pages.dtype))


def read_slots(pages: jax.Array, slots: jax.Array) -> jax.Array:
    """The [T, n_kv, hd] entries of pages [num_pages, n_kv, page_size, hd] at slots i32[T]."""
    page_size = pages.shape[2]
    return pages[slots // page_size, :, slots % page_size]


class AttentionBackend(Protocol):
    """Writes this step's K/V into the layer's paged cache, then attends over it.

    q: [T, n_heads, head_dim]; k, v: [T, n_kv_heads, head_dim]. sliding_window (static):
    hide keys that many tokens or more behind each query; None attends over everything.
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
        sliding_window: int | None = None,
    ) -> tuple[jax.Array, LayerKV]: ...
