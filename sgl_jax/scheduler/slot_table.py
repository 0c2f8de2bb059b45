"""What a decode step reads of each request, kept per request slot in host arrays.

A request's sampling parameters are written once, when it gets its slot; its page-table row
when its pages change. A decode step gathers the rows of its requests' slots with numpy, so
building a batch costs no Python per request beyond reading a few attributes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sgl_jax.grammar import allow_eos_at_dead_ends, fill_bitmasks
from sgl_jax.layers.sampler import SamplingBatch
from sgl_jax.model_executor.model_runner import greedy_sampling_batch
from sgl_jax.sampling_fields import ROW_FIELDS, Source
from sgl_jax.scheduler.req import Req


class SlotTable:
    def __init__(self, num_slots: int, pages_per_seq: int, vocab_size: int):
        # One more row than slots: the greedy, unpenalised row that padding rows gather.
        self.padding_row = num_slots
        self.page_table = np.zeros((num_slots, pages_per_seq), np.int32)  # i32[S, P]
        self.sampling = greedy_sampling_batch(num_slots + 1, vocab_size)  # S+1 rows
        self.min_new_tokens = np.zeros(num_slots + 1, np.int32)
        self.penalty_slot = np.full(num_slots + 1, -1, np.int32)  # the slot, if penalised
        # The page list each row was written from, and how much of it: a list replaced
        # (admission, release) rewrites the row, a list grown (reservation) its new tail.
        self._page_lists: list[list[int] | None] = [None] * num_slots
        self._pages_written = [0] * num_slots

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
        for req in reqs:
            row, pages = req.slot, req.page_ids
            if pages is not self._page_lists[row]:
                self._page_lists[row], self._pages_written[row] = pages, 0
                self.page_table[row] = 0
            written = self._pages_written[row]
            if written != len(pages):
                self.page_table[row, written: len(pages)] = pages[written:]
                self._pages_written[row] = len(pages)
        return self.page_table[[req.slot for req in reqs]]

    def sampling_rows(self, reqs: Sequence[Req], slots: np.ndarray, num_sampled: np.ndarray,
                      rows: int) -> tuple[SamplingBatch, np.ndarray]:
        """The decode step's sampling arrays over `rows` (padding included) and its penalty
        slots i32[rows]: each request's row at its output position, EOS suppressed while
        min_new_tokens holds; a constrained request's grammar writes the ids it allows."""
        index = np.full(rows, self.padding_row, np.int32)
        index[: len(slots)] = slots
        batch = SamplingBatch(*(getattr(self.sampling, f)[index] for f in _FIELDS))
        batch.position[: len(slots)] = num_sampled
        suppressing = np.zeros(rows, bool)
        suppressing[: len(slots)] = num_sampled < self.min_new_tokens[slots]
        batch.suppress_ids[~suppressing] = -1
        constrained = [(req.grammar, row) for row, req in enumerate(reqs)
                       if req.grammar is not None]
        if constrained:
            _mask_grammar_rows(batch, constrained, reqs)
        return batch, self.penalty_slot[index]


_FIELDS = tuple(SamplingBatch.__dataclass_fields__)


def _mask_grammar_rows(batch: SamplingBatch, constrained: list, reqs: Sequence[Req]) -> None:
    """Each constrained row's allowed ids; a complete grammar may end now, whatever
    min_new_tokens says; at a dead end only EOS."""
    fill_bitmasks(constrained, batch.allowed)
    for grammar, row in constrained:
        if grammar.is_stopped():
            batch.suppress_ids[row] = -1
        allow_eos_at_dead_ends(batch.allowed[row], reqs[row].eos_ids)
