"""What a step reads of each request, kept per request slot in host arrays.

A request's sampling parameters are written once, when it gets its slot; its page-table row
when its pages change. They are kept as a decode step's rows (model_executor/decode_rows.py):
a decode step gathers its requests' rows and writes the few columns that change every step,
so building one costs no Python per request beyond reading a few attributes. Extend steps
and speculative rounds read the same values by field (`sampling`, views of those rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sgl_jax.grammar import allow_eos_at_dead_ends, fill_bitmasks
from sgl_jax.layers.sampler import SamplingBatch
from sgl_jax.model_executor import decode_rows
from sgl_jax.model_executor.decode_rows import DecodeColumns
from sgl_jax.model_executor.model_runner import greedy_sampling_batch
from sgl_jax.sampling_fields import ROW_FIELDS, Source
from sgl_jax.scheduler.req import Req


class SlotTable:
    def __init__(self, num_slots: int, columns: DecodeColumns, vocab_size: int):
        # One more row than slots: the greedy, unpenalised row that padding rows gather.
        self.padding_row = num_slots
        self.columns = columns
        # A decode step's rows (model_executor/decode_rows.py), per slot: what changes when a
        # request joins or gains a page is written here once; a step gathers its rows.
        self.ints = np.zeros((num_slots + 1, columns.num_ints), np.int32)  # i32[S+1, Ci]
        self.floats = np.zeros((num_slots + 1, columns.num_floats), np.float32)  # f32[S+1, Cf]
        self.ints[:, decode_rows.SLOT] = np.arange(num_slots + 1)
        self.ints[:, decode_rows.EMITS] = 1
        self.ints[num_slots, decode_rows.SLOT] = self.ints[num_slots, decode_rows.EMITS] = -1
        # The same values by field, as views of those rows: S+1 rows of each sampling field.
        self.sampling = self._sampling_views(num_slots + 1, vocab_size)
        self.page_table = self.ints[:num_slots, columns.first_page_column:]  # i32[S, P]
        self.min_new_tokens = self.ints[:, decode_rows.MIN_NEW_TOKENS]  # i32[S+1]
        self.penalty_slot = self.ints[:, decode_rows.PENALTY_SLOT]  # i32[S+1]: -1 = none
        self.penalty_slot[:] = -1
        # The page list each row was written from, and how much of it: a list replaced
        # (admission, release) rewrites the row, a list grown (reservation) its new tail.
        self._page_lists: list[list[int] | None] = [None] * num_slots
        self._pages_written = [0] * num_slots

    def _sampling_views(self, rows: int, vocab_size: int) -> SamplingBatch:
        """Each sampling field as a view of its columns (position and the grammar bitmask,
        written per step, as arrays of their own), filled with its neutral value."""
        neutral = greedy_sampling_batch(rows, vocab_size)
        views = {}
        for field in _FIELDS:
            if field in ("position", "allowed"):
                views[field] = getattr(neutral, field)
                continue
            floating, columns = self.columns.column(field)
            view = (self.floats if floating else self.ints)[:, columns]
            dtype = getattr(neutral, field).dtype
            view = view.view(dtype) if view.dtype != dtype else view
            view = view if view.shape == getattr(neutral, field).shape else view[:, 0]
            view[...] = getattr(neutral, field)
            views[field] = view
        return SamplingBatch(**views)

    def join(self, req: Req) -> None:
        """Write the sampling parameters of a request that just got its slot."""
        row, p, s = req.slot, req.params, self.sampling
        holders = {Source.PARAMS: p, Source.REQ: req}
        for field in ROW_FIELDS:  # the values copied as they are; the others neutral for now
            holder = holders.get(field.source)
            getattr(s, field.name)[row] = (field.neutral if holder is None
                                           else getattr(holder, field.name))
        stop_ids = sorted(req.stop_ids())
        s.suppress_ids[row, : len(stop_ids)] = stop_ids  # applied while min_new_tokens holds
        if p.logit_bias:
            ids, values = zip(*p.logit_bias, strict=True)
            s.bias_ids[row, : len(ids)], s.bias_values[row, : len(ids)] = ids, values
        self.min_new_tokens[row] = p.min_new_tokens
        self.penalty_slot[row] = req.slot if p.uses_penalties else -1
        self._page_lists[row] = None

    def page_rows(self, reqs: Sequence[Req]) -> np.ndarray:
        """i32[n, P]: the requests' page-table rows, brought up to date first."""
        self._write_pages(reqs)
        return self.page_table[np.fromiter((req.slot for req in reqs), np.int32, len(reqs))]

    def _write_pages(self, reqs: Sequence[Req]) -> None:
        for req in reqs:
            if self._pages_changed(req):
                self._write_page_row(req)

    def _pages_changed(self, req: Req) -> bool:
        pages = req.page_ids
        return (pages is not self._page_lists[req.slot]
                or self._pages_written[req.slot] != len(pages))

    def _write_page_row(self, req: Req) -> None:
        """The request's page-table row: rewritten for a new list, its new tail else."""
        row, pages = req.slot, req.page_ids
        if pages is not self._page_lists[row]:
            self._page_lists[row], self._pages_written[row] = pages, 0
            self.page_table[row] = 0
        written = self._pages_written[row]
        self.page_table[row, written: len(pages)] = pages[written:]
        self._pages_written[row] = len(pages)

    def slots_of(self, reqs: Sequence[Req], rows: int) -> np.ndarray:
        """i32[rows]: the requests' slots, then the padding row up to `rows`."""
        index = np.full(rows, self.padding_row, np.int32)
        index[: len(reqs)] = np.fromiter((r.slot for r in reqs), np.int32, len(reqs))
        return index

    def decode_rows(self, reqs: Sequence[Req], slots: np.ndarray, detail: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A decode step's inputs over the rows of `slots` (slots_of: padding included): ints
        i32[rows, Ci] and floats f32[rows, Cf] in the layout of decode_rows.DecodeColumns,
        and the grammar bitmask i32[rows, W] of a batch with a constrained request (None: no
        row has one)."""
        # One pass over the requests: pages gained, the four columns that change every step
        # (-1 where only the device knows: the last token of a step in flight; the lengths a
        # speculative round in flight decides), and which rows a grammar masks.
        changing, constrained = [], []
        for row, req in enumerate(reqs):
            if self._pages_changed(req):
                self._write_page_row(req)
            extra = req.inflight_extra
            changing += (req.state_slot, -1 if extra else req.kv_len,  # flat: one conversion
                         -1 if req.num_inflight else req.last_token,
                         -1 if extra else req.num_sampled)
            if req.grammar is not None:
                constrained.append((req.grammar, row))
        ints, floats = self.ints[slots], self.floats[slots]
        ints[:len(reqs), _STEP_COLUMNS] = np.array(changing, np.int32).reshape(
            len(reqs), len(_STEP_COLUMNS))
        ints[:, decode_rows.DETAIL] = detail
        if not constrained:
            return ints, floats, None
        allowed = self.sampling.allowed[slots]
        _mask_grammar_rows(allowed, ints[:, decode_rows.MIN_NEW_TOKENS], constrained, reqs)
        return ints, floats, allowed

    def sampling_rows(self, reqs: Sequence[Req], slots: np.ndarray, num_sampled: np.ndarray,
                      rows: int) -> tuple[SamplingBatch, np.ndarray]:
        """The step's sampling arrays over `rows` (padding included) and its penalty
        slots i32[rows]: each request's row at its output position, EOS suppressed while
        min_new_tokens holds; a constrained request's grammar writes the ids it allows."""
        index = np.full(rows, self.padding_row, np.int32)
        index[: len(slots)] = slots
        batch = SamplingBatch(*(getattr(self.sampling, f)[index] for f in _FIELDS))
        batch.position[: len(slots)] = num_sampled
        min_new_tokens = self.min_new_tokens[index]
        constrained = [(req.grammar, row) for row, req in enumerate(reqs)
                       if req.grammar is not None]
        if constrained:
            _mask_grammar_rows(batch.allowed, min_new_tokens, constrained, reqs)
        batch.suppress_ids[batch.position >= min_new_tokens] = -1
        return batch, self.penalty_slot[index]


_FIELDS = tuple(SamplingBatch.__dataclass_fields__)
# The columns of a decode row written each step, in the order decode_rows fills them.
_STEP_COLUMNS = [decode_rows.STATE_SLOT, decode_rows.KV_LEN, decode_rows.TOKEN,
                 decode_rows.POSITION]


def _mask_grammar_rows(allowed: np.ndarray, min_new_tokens: np.ndarray, constrained: list,
                       reqs: Sequence[Req]) -> None:
    """Each constrained row's allowed ids (allowed i32[rows, W]); a complete grammar may end
    now, whatever min_new_tokens says (its row's copy set to 0); at a dead end only EOS."""
    fill_bitmasks(constrained, allowed)
    for grammar, row in constrained:
        if grammar.is_stopped():
            min_new_tokens[row] = 0
        allow_eos_at_dead_ends(allowed[row], reqs[row].eos_ids)
