"""Compiling a SpecRunner's programs before they serve, and timing its round programs for the
adaptive policy (SpecRunner.round_seconds).

A runner given here may be rank 0's `Mirrored` view of one (several nodes): its device calls
(rounds, catch-ups) reach the other ranks too, so whatever runs while serving
(`time_bucket`) runs a fixed number of them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from sgl_jax.model_executor.forward_batch import BatchShape, SeqChunk
from sgl_jax.model_executor.model_runner import greedy_sampling_batch
from sgl_jax.process_maps import WarmupForecast
from sgl_jax.speculative.config import TreeShape
from sgl_jax.speculative.round import CatchUpRow, RoundRows, allow_every_id
from sgl_jax.speculative.spec_runner import SpecRunner


def warm_up(spec: SpecRunner, sizes: Sequence[int] | None = None, *,
            rare_programs: bool = True) -> None:
    """Compile the round programs of the batch buckets `sizes` (default: every one) and
    time each for the adaptive policy (the fastest of a few runs after the compiling one:
    the others met some other load), then the prefill buckets. Without `rare_programs`,
    the programs few batches need (grammar-masked rounds, prefills of one-token chunks)
    are left to compile on first use, as are the buckets left out of `sizes`
    (`time_bucket` times those when the policy first meets them)."""
    buckets = spec.buckets
    sizes = buckets.bs_paddings if sizes is None else tuple(sizes)
    prefills = [s for s in buckets.all_shapes() if rare_programs or s.q_block > 1]
    _warm_undrafted_steps(spec, sizes)
    total = len(sizes) * (len(spec.shapes) + 1) + len(prefills)
    forecast = WarmupForecast(total)
    with tqdm(total=total, desc="Compiling speculative buckets", unit="bucket") as bar:
        def compiled() -> None:
            forecast.compiled()
            bar.update()
        for size in sizes:
            rows = _dummy_rows(spec, size)
            _time_rounds(spec, rows, after_each=compiled)
            if rare_programs:
                _warm_masked_round(spec, rows)
            _warm_catch_up(spec, range(size))
            compiled()
        for shape in prefills:
            _warm_prefill(spec, shape)
            compiled()
    # Warm-up rounds wrote scratch into the slots; no request reads a slot before its
    # prefill writes its root.


def time_bucket(spec: SpecRunner, size: int) -> None:
    """Compile and time the round programs of batch bucket `size` while serving: padding
    rows only (they write nothing, so the requests' slots and caches stay as they were),
    and a fixed number of runs (other nodes replay these rounds and must run the same
    ones). The bucket's other programs are compiled with them, so no later batch of this
    size compiles."""
    _time_rounds(spec, _padding_rows(spec, size), runs=2, budget_s=0.0)
    _warm_undrafted_steps(spec, [size])
    _warm_catch_up(spec, [-1] * size)


def _warm_undrafted_steps(spec: SpecRunner, sizes: Sequence[int]) -> None:
    """Where plain rounds leave the draft behind, a round where no request has a draft is
    the target's decode step: compile those of the batch buckets `sizes`."""
    if spec.defers_draft:
        spec.target.warmup([s for s in spec.buckets.all_shapes()
                            if s.q_block == 1 and s.num_tokens in sizes])


def _warm_catch_up(spec: SpecRunner, slots: Sequence[int]) -> None:
    """Where plain rounds leave the draft behind: a catch-up of nothing for `slots` (-1:
    padding, which writes no root)."""
    if spec.defers_draft:
        spec.catch_up([CatchUpRow(slot, [0], 0, [], np.zeros((0, spec.feature_width)))
                       for slot in slots])


def _warm_masked_round(spec: SpecRunner, rows: RoundRows) -> None:
    size = len(rows.slots)
    tree = spec.draft_trees(rows)
    spec.masked_verify(rows, greedy_sampling_batch(size, spec.vocab_size), False, tree,
                       allow_every_id(tree.tokens.shape, spec.vocab_size)).result()


def _time_rounds(spec: SpecRunner, rows: RoundRows, *,
                 after_each: Callable[[], None] = lambda: None, runs: int = 5,
                 budget_s: float = 1.0) -> None:
    """round_seconds of every shape for `rows`' bucket: a compiling run, then the
    fastest of `runs` (or of those that fit in `budget_s`)."""
    size = len(rows.slots)
    sampling = greedy_sampling_batch(size, spec.vocab_size)
    for shape in spec.shapes:
        def run(shape: TreeShape = shape) -> None:
            spec.round(rows, sampling, False, shape).result()
        run()
        spec.round_seconds[shape, size] = _fastest_seconds(run, runs, budget_s)
        after_each()


def _warm_prefill(spec: SpecRunner, shape: BatchShape) -> None:
    chunks = _dummy_chunks(shape, spec.buckets.context_len, spec.page_size)
    count = len(chunks)
    slots = spec.target.scratch_state_slots(count)
    chunks = [dataclasses.replace(c, state_slot=slot)
              for c, slot in zip(chunks, slots, strict=True)]
    spec.prefill(chunks, greedy_sampling_batch(count, spec.vocab_size),
                 np.zeros(count, bool), False, [0] * count,
                 np.full(count, -1, np.int32)).result()


def _dummy_rows(spec: SpecRunner, count: int) -> RoundRows:
    """Warm-up rows: real slots (a padding row may cost less than a request's), every
    token in the null page."""
    zeros = np.zeros(count, np.int32)
    return RoundRows(np.arange(count, dtype=np.int32),
                     np.zeros((count, spec.buckets.pages_per_seq), np.int32),
                     zeros, zeros, zeros,
                     np.array(spec.target.scratch_state_slots(count), np.int32),
                     np.full(count, spec.shape.num_steps, np.int32),
                     spec.drafter.idle_hints(count))


def _padding_rows(spec: SpecRunner, count: int) -> RoundRows:
    """Rows that are all padding (slot -1, the null page, the null state slot)."""
    zeros = np.zeros(count, np.int32)
    return RoundRows(np.full(count, -1, np.int32),
                     np.zeros((count, spec.buckets.pages_per_seq), np.int32),
                     zeros, zeros, zeros, zeros, zeros, spec.drafter.idle_hints(count))


def _fastest_seconds(fn, runs: int = 5, budget_s: float = 1.0) -> float:
    """The fastest of `runs` calls of fn, or of those that fit in `budget_s` (at least 2)."""
    times: list[float] = []
    while len(times) < runs and (len(times) < 2 or sum(times) < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _dummy_chunks(shape: BatchShape, context_len: int, page_size: int) -> list[SeqChunk]:
    """Chunks filling a bucket that write only into the null page (warm-up)."""
    if shape.q_block == 1:
        return [SeqChunk([0], 0, [0]) for _ in range(shape.num_tokens)]
    length = min(shape.num_tokens, context_len)
    return [SeqChunk([0] * length, 0, [0] * -(-length // page_size))]
