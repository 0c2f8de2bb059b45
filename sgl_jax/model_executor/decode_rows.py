"""A decode step's host inputs as one int32 row and one float32 row per request.

A decode step (one new token per request) needs little from the host that the device cannot
derive: each request's slot, KV length, input token (or -1: the slot's last sampled token,
still on the device), output position and state slot, its page-table row and its sampling
parameters. The scheduler keeps the parts that change only when a request joins or gains a
page in per-slot tables laid out as these rows (scheduler/slot_table.py), so a step's inputs
are two row gathers and a few columns written: no per-field arrays to gather, pad and pack.
Inside the program `DecodeColumns.unpack` derives what the model and the sampler read (cache
slots, attention lengths, padding rows, min_new_tokens' suppression) from the columns.

Columns of an int row: SLOT (the request's slot, -1: none), EMITS (1: a request's row whose
token is kept, 0: a row computed without keeping its token, -1: a padding row, which reads and
writes nothing), STATE_SLOT, PENALTY_SLOT (-1: none), MIN_NEW_TOKENS, KV_LEN (tokens cached
before this one), TOKEN, POSITION (the index in the request's output of the token sampled),
DETAIL (the log-probabilities the step computes, the same in every row), then each int
sampling field of sampling_fields.ROW_FIELDS (2-D ones their width wide), then the page-table
row. TOKEN, KV_LEN and POSITION are -1 where only the device knows them: the slot's last token
or its lengths, which the step or speculative round before left and the host has not read
yet. A float row holds the float sampling fields. The grammar bitmask (`allowed`, a STEP field
V/32 words wide) travels apart: a batch without a grammar sends a constant of -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers.attention import AttentionMetadata
from sgl_jax.layers.sampler import SamplingBatch
from sgl_jax.model_executor.device_state import SlotLengths
from sgl_jax.model_executor.forward_batch import ForwardBatch
from sgl_jax.sampling_fields import ROW_FIELDS, RowField

(SLOT, EMITS, STATE_SLOT, PENALTY_SLOT, MIN_NEW_TOKENS, KV_LEN, TOKEN, POSITION,
 DETAIL) = range(9)
_FIXED = 9
# Fields not kept per slot: the output position is a column of its own, the bitmask apart.
_NOT_IN_ROWS = ("position", "allowed")


@dataclass(frozen=True)
class DecodeColumns:
    """Where every value lies in a decode step's rows (static: part of its program's key)."""

    pages_per_seq: int  # P: the page-table row's width
    page_size: int
    widths: tuple[tuple[str, int], ...]  # the 2-D sampling fields' widths: ("E", n), ("M", n)

    @property
    def fields(self) -> tuple[tuple[RowField, bool, int, int], ...]:
        """(field, floating, first column, width) of each sampling field kept in the rows."""
        widths, placed, next_column = dict(self.widths), [], [_FIXED, 0]
        for field in ROW_FIELDS:
            if field.name in _NOT_IN_ROWS:
                continue
            floating = np.dtype(field.dtype).kind == "f"
            width = 1 if field.width is None else widths[field.width]
            placed.append((field, floating, next_column[floating], width))
            next_column[floating] += width
        return tuple(placed)

    @property
    def first_page_column(self) -> int:
        return _FIXED + sum(width for _, floating, _, width in self.fields if not floating)

    @property
    def num_ints(self) -> int:
        return self.first_page_column + self.pages_per_seq

    @property
    def num_floats(self) -> int:
        return sum(width for _, floating, _, width in self.fields if floating)

    def padding_rows(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(ints, floats) of `rows` padding rows: no request, nothing read or written."""
        ints = np.zeros((rows, self.num_ints), np.int32)
        ints[:, SLOT] = ints[:, EMITS] = ints[:, PENALTY_SLOT] = -1
        return ints, np.zeros((rows, self.num_floats), np.float32)

    def rows_of(self, batch: ForwardBatch, sampling: SamplingBatch, penalty_slots: np.ndarray,
                slots: np.ndarray, emits: np.ndarray, detail: int
                ) -> tuple[np.ndarray, np.ndarray]:
        """(ints, floats) of a decode-shaped host batch built by build_forward_batch (one token
        a row), its sampling rows (EOS suppression already resolved) and the row arrays a
        step takes: the same step in this layout. A row that emits nothing (mid-prefill) is
        computed, its token dropped."""
        rows, real = len(batch.input_ids), batch.attention.kv_lens > 0
        ints, floats = self.padding_rows(rows)
        ints[:, SLOT] = slots
        ints[:, EMITS] = np.where(real, emits, -1)
        ints[:, STATE_SLOT] = batch.state_slots
        ints[:, PENALTY_SLOT] = penalty_slots
        ints[:, MIN_NEW_TOKENS] = np.iinfo(np.int32).max  # suppress_ids are as the host left them
        ints[:, KV_LEN] = batch.attention.window_starts
        ints[:, TOKEN] = batch.input_ids
        ints[:, POSITION] = sampling.position
        ints[:, DETAIL] = detail
        ints[:, self.first_page_column:] = batch.attention.page_table
        for field, floating, start, width in self.fields:
            values = np.asarray(getattr(sampling, field.name))
            target = floats if floating else ints
            target[:, start: start + width] = (values.view(np.int32) if values.dtype == np.uint32
                                               else values).reshape(rows, width)
        return ints, floats

    def column(self, name: str) -> tuple[bool, slice]:
        """Whether sampling field `name` is a float one, and its columns."""
        for field, floating, start, width in self.fields:
            if field.name == name:
                return floating, slice(start, start + width)
        raise KeyError(name)

    def unpack(self, ints: jax.Array, floats: jax.Array, allowed: jax.Array,
               lengths: SlotLengths) -> tuple[ForwardBatch, SamplingBatch, jax.Array,
                                              jax.Array, jax.Array, jax.Array]:
        """Inside the step: ints i32[N, num_ints], floats f32[N, num_floats], allowed
        i32[N, W] and the slots' device lengths (for a KV_LEN or POSITION of -1: a round the
        host has not read yet decided it) -> (the batch, its sampling rows, penalty slots
        i32[N], request slots i32[N], whether each row emits bool[N], the log-probability
        detail i32[])."""
        slot = jnp.maximum(ints[:, SLOT], 0)
        ints = ints.at[:, KV_LEN].set(_or_device(ints[:, KV_LEN], lengths.kv_lens[slot]))
        ints = ints.at[:, POSITION].set(_or_device(ints[:, POSITION],
                                                   lengths.num_sampled[slot]))
        kv_lens, live = ints[:, KV_LEN], ints[:, EMITS] >= 0
        page_table = ints[:, self.first_page_column:]  # i32[N, P]
        page = jnp.take_along_axis(page_table, (kv_lens // self.page_size)[:, None], axis=1)
        metadata = AttentionMetadata(
            slot_mapping=jnp.where(live, page[:, 0] * self.page_size
                                   + kv_lens % self.page_size, 0),
            page_table=page_table,
            kv_lens=jnp.where(live, kv_lens + 1, 0),
            window_starts=kv_lens,
            q_starts=jnp.zeros_like(kv_lens),
            tree_bits=None,
            q_block=1,
        )
        rows = ints.shape[0]
        batch = ForwardBatch(ints[:, TOKEN], kv_lens, jnp.arange(rows, dtype=jnp.int32),
                             metadata, ints[:, STATE_SLOT])
        return (batch, self._sampling(ints, floats, allowed), ints[:, PENALTY_SLOT],
                ints[:, SLOT], ints[:, EMITS] > 0, ints[0, DETAIL])

    def _sampling(self, ints: jax.Array, floats: jax.Array, allowed: jax.Array
                  ) -> SamplingBatch:
        values = {"position": ints[:, POSITION], "allowed": allowed}
        for field, floating, start, width in self.fields:
            block = (floats if floating else ints)[:, start: start + width]
            block = block if field.width is not None else block[:, 0]
            if np.dtype(field.dtype) == np.uint32:
                block = jax.lax.bitcast_convert_type(block, jnp.uint32)
            values[field.name] = block
        # EOS and stop ids are banned only while the request is short of min_new_tokens.
        suppressing = (ints[:, POSITION] < ints[:, MIN_NEW_TOKENS])[:, None]
        values["suppress_ids"] = jnp.where(suppressing, values["suppress_ids"], -1)
        return SamplingBatch(**values)


def _or_device(host: jax.Array, device: jax.Array) -> jax.Array:
    """i32[N]: the host's value, or the device's where the host sent -1."""
    return jnp.where(host < 0, device, host)
