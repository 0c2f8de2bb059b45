"""Timing a SpecRunner's round programs for the adaptive policy (SpecRunner.round_seconds),
and keeping the timings in the executable store, so a later process with the same programs
starts with them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from sgl_jax.model_executor import decode_rows
from sgl_jax.model_executor.model_runner import greedy_sampling_batch
from sgl_jax.speculative.policy.shape_policy import PLAIN
from sgl_jax.speculative.round.program import RoundRows
from sgl_jax.speculative.spec_config import TreeShape
from sgl_jax.speculative.spec_runner import SpecRunner

TIMINGS = "round_seconds"  # the executable store's record of them


def time_rounds(spec: SpecRunner, rows: RoundRows, *,
                shapes: Sequence[TreeShape] | None = None,
                after_each: Callable[[], None] = lambda: None, runs: int = 5,
                budget_s: float = 1.0) -> None:
    """round_seconds of `shapes` (default: every one) for `rows`' bucket: a compiling run,
    then the fastest of `runs` (or of those that fit in `budget_s`), unless an earlier
    process with the same programs (the executable store's fingerprint) kept its figure."""
    size = len(rows.slots)
    sampling = greedy_sampling_batch(size, spec.vocab_size)
    store = spec.target.store
    kept = store.read_json(TIMINGS) if store else {}
    for shape in spec.shapes if shapes is None else shapes:
        def run(shape: TreeShape = shape) -> None:
            if shape == PLAIN and spec.plain_is_decode_step:
                _run_decode_step(spec, rows)
            else:
                spec.round(rows, sampling, False, shape).result()
        run()
        seconds = kept.get(_timing_key(shape, size))
        spec.round_seconds[shape, size] = seconds or _fastest_seconds(run, runs, budget_s)
        after_each()


def _run_decode_step(spec: SpecRunner, rows: RoundRows) -> None:
    """The target's decode step over `rows` (what a plain round runs), to its results."""
    ints, floats = spec.target.decode_columns.padding_rows(len(rows.slots))
    real = rows.slots >= 0
    ints[real, decode_rows.SLOT], ints[real, decode_rows.EMITS] = rows.slots[real], 1
    ints[:, decode_rows.KV_LEN] = np.maximum(rows.kv_lens, 0)
    ints[:, decode_rows.TOKEN] = np.maximum(rows.root_tokens, 0)
    ints[:, decode_rows.STATE_SLOT] = rows.state_slots
    spec.target.launch_decode(ints, floats, None, len(rows.slots), want_top_logprobs=False,
                              want_logprobs=False, want_features=spec.defers_draft).result()


def keep_timings(spec: SpecRunner, shapes: Sequence[TreeShape] | None = None,
                 size: int | None = None) -> None:
    """Add round_seconds to the executable store's record for later processes: every
    timing, or only those of `shapes` in bucket `size`."""
    store = spec.target.store
    if not store:
        return
    kept = store.read_json(TIMINGS)
    keys = spec.round_seconds if shapes is None else [(shape, size) for shape in shapes]
    kept.update({_timing_key(shape, bucket): spec.round_seconds[shape, bucket]
                 for shape, bucket in keys})
    store.write_json(TIMINGS, kept)


def _timing_key(shape: TreeShape, size: int) -> str:
    return f"{shape.name} x {size}"


def _fastest_seconds(fn, runs: int = 5, budget_s: float = 1.0) -> float:
    """The fastest of `runs` calls of fn, or of those that fit in `budget_s` (at least 2)."""
    times: list[float] = []
    while len(times) < runs and (len(times) < 2 or sum(times) < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
