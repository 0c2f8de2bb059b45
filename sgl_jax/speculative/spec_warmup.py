"""Compiling a SpecRunner's programs before they serve, and which programs a batch bucket
may run meanwhile (policy/round_timing.py times the round programs for the adaptive policy).

A runner given here may be rank 0's `Mirrored` view of one (several nodes): its device calls
(rounds, catch-ups) reach the other ranks too, so whatever runs while serving
(`time_bucket`) runs a fixed number of them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from sgl_jax.layers.sampler import NO_LOGPROBS
from sgl_jax.model_executor.forward_batch import BatchShape, SeqChunk
from sgl_jax.model_executor.model_runner import greedy_sampling_batch, ready_batch_limit
from sgl_jax.model_executor.programs import build_in_pairs
from sgl_jax.process_maps import WarmupForecast
from sgl_jax.speculative.policy.round_timing import keep_timings, time_rounds
from sgl_jax.speculative.policy.shape_policy import PLAIN
from sgl_jax.speculative.round.program import CatchUpRow, RoundRows, allow_every_id
from sgl_jax.speculative.spec_config import TreeShape
from sgl_jax.speculative.spec_runner import SpecRunner


def warm_up(spec: SpecRunner, sizes: Sequence[int] | None = None, *,
            rare_programs: bool = True, token_sizes: Sequence[int] | None = None) -> None:
    """Compile the round programs of the batch buckets `sizes` (default: every one) and
    time each for the adaptive policy (the fastest of a few runs after the compiling one:
    the others met some other load), then the prefill buckets. Without `rare_programs`,
    the programs few batches need (grammar-masked rounds, prefills of one-token chunks)
    are left to compile on first use, as are the buckets left out of `sizes`
    (`time_bucket` times those when the policy first meets them). `token_sizes`: the prefill
    token buckets to build (default: every one). With a background builder, a bucket's
    shapes beyond its base ones are left to it (loaded from the store, or compiled), and
    the policy takes each once built and timed: the server answers sooner, with plain
    rounds meanwhile."""
    buckets = spec.buckets
    sizes = buckets.bs_paddings if sizes is None else tuple(sizes)
    token_sizes = buckets.token_paddings if token_sizes is None else token_sizes
    prefills = [buckets.extend_shape(tokens) for tokens in token_sizes]
    if rare_programs:  # prefills of one-token chunks
        prefills += [buckets.decode_shape(size) for size in buckets.bs_paddings]
    _warm_undrafted_steps(spec, sizes)
    builder = spec.target.builder
    later = _extra_shapes(spec) if builder else []  # the builder's first jobs (below)
    now = [shape for shape in _extra_shapes(spec) if shape not in later]
    build_in_pairs([build for size in sizes
                    for build in _base_builds(spec, size) + _round_builds(spec, now, size)]
                   + [functools.partial(build_prefill, spec, tokens) for tokens in token_sizes])
    timed = [shape for shape in spec.shapes if shape not in later]
    forecast = WarmupForecast(len(sizes) * (len(timed) + 1) + len(prefills))
    with tqdm(total=forecast.programs, desc="Compiling speculative buckets",
              unit="bucket") as bar:
        def compiled() -> None:
            forecast.compiled()
            bar.update()
        for size in sizes:
            rows = _dummy_rows(spec, size)
            time_rounds(spec, rows, shapes=timed, after_each=compiled)
            keep_timings(spec)
            if rare_programs:
                _warm_masked_round(spec, rows)
            _warm_catch_up(spec, range(size))
            compiled()
        for shape in prefills:
            _warm_prefill(spec, shape)
            compiled()
    for size in sizes if builder else ():
        queue_shapes(spec, size, priority=-1)  # ahead of every bucket not yet asked for
    # Warm-up rounds wrote scratch into the slots; no request reads a slot before its
    # prefill writes its root.


# ---------------------------------------------------------------------- what a bucket may run


def base_shapes(spec: SpecRunner) -> tuple[TreeShape, ...]:
    """The round shapes a batch bucket needs before a batch may use it: plain rounds, and the
    flags' shape when it is the only drafted one (no adaptive menu). With a menu the policy
    takes each drafted shape once it is built and timed (shapes_built)."""
    drafted = [shape for shape in spec.shapes if shape != PLAIN]
    return (PLAIN, *drafted) if len(drafted) == 1 else (PLAIN,)


def round_built(spec: SpecRunner, shape: TreeShape, size: int) -> bool:
    """Whether a round of `shape` in batch bucket `size` can run: its round program, or for
    a plain round that is the target's decode step, that step."""
    if shape == PLAIN and spec.plain_is_decode_step:
        return spec.target.has_program(spec.buckets.decode_shape(size))
    return size in spec.rounds[shape]


def bucket_usable(spec: SpecRunner, size: int) -> bool:
    """Whether a batch may run in batch bucket `size` now: its base shapes' round programs,
    the target's decode step (rounds where no request drafts) and, for a drafter that plain
    rounds leave behind, the catch-up are built."""
    deferred = not spec.defers_draft or size in spec.catch_ups
    return (deferred and spec.target.has_program(spec.buckets.decode_shape(size))
            and all(round_built(spec, shape, size) for shape in base_shapes(spec)))


def shapes_built(spec: SpecRunner, size: int) -> tuple[TreeShape, ...]:
    """The round shapes whose programs for batch bucket `size` are built."""
    return tuple(shape for shape in spec.shapes if round_built(spec, shape, size))


def bucket_built(spec: SpecRunner, size: int) -> bool:
    """Whether every program a round of batch bucket `size` may run is built (the
    grammar-masked pair apart: SpecRunner.masked_built)."""
    return bucket_usable(spec, size) and len(shapes_built(spec, size)) == len(spec.shapes)


def ready_padding(spec: SpecRunner, num_rows: int) -> int:
    """The padded batch size of a round or catch-up of `num_rows` rows: with a background
    builder, the smallest bucket that fits them and is usable (a round never waits for a
    compile while the bucket it would fit best is still building); else, or while none that
    fits is usable, the smallest that fits."""
    fits = [size for size in spec.buckets.bs_paddings if size >= num_rows]
    if spec.target.builder is not None:
        usable = [size for size in fits if bucket_usable(spec, size)]
        if usable:
            return usable[0]
    return spec.buckets.batch_padding(num_rows)


def time_bucket(spec: SpecRunner, size: int, shapes: Sequence[TreeShape]) -> bool:
    """Time the round programs of `shapes` in batch bucket `size` while serving (compiling
    those not built yet): padding rows only (they write nothing, so the requests' slots and
    caches stay as they were), and a fixed number of runs (other nodes replay these rounds
    and must run the same ones). The bucket's other base programs are run with them, so no
    later batch of this size compiles them. Returns whether the timings are clean: no
    background build shared the CPU meanwhile (it slows some shapes more than others, so
    the policy would misprice them: untimed_shapes offers those again once it is done).
    Only clean timings are kept for later processes."""
    builder = spec.target.builder
    clean = builder is None or builder.idle()
    time_rounds(spec, _padding_rows(spec, size), shapes=shapes, runs=2, budget_s=0.0)
    clean = clean and (builder is None or builder.idle())
    if clean:
        keep_timings(spec, shapes, size)
    _warm_undrafted_steps(spec, [size])
    _warm_catch_up(spec, [-1] * size)
    return clean


def untimed_shapes(spec: SpecRunner, size: int, timed: Collection[tuple[TreeShape, int]],
                   provisional: Collection[tuple[TreeShape, int]] = ()) -> list[TreeShape]:
    """The shapes of batch bucket `size` the adaptive policy has no timing for (`timed`)
    and may time now: with a background builder those built so far, else every one (timing
    compiles them); and once the builder is idle, those of its `provisional` timings (taken
    while it was building, time_bucket)."""
    builder = spec.target.builder
    shapes = spec.shapes if builder is None else shapes_built(spec, size)
    stale = provisional if builder is not None and builder.idle() else ()
    return [shape for shape in shapes if (shape, size) not in timed or (shape, size) in stale]


def batch_limit(spec: SpecRunner, wanted: int) -> int:
    """The most requests a round may take with the programs built so far: the largest
    usable bucket (bucket_usable; a smaller batch pads to the smallest usable one that fits
    it, ready_padding). The bucket `wanted` requests need goes to the
    builder ahead of the smaller ones missing (queue_bucket), so a burst waits for one
    bucket's base programs, not for every bucket below it. Without a builder, or before
    the smallest bucket is usable, any size."""
    sizes, builder = spec.buckets.bs_paddings, spec.target.builder
    if builder is None or not bucket_usable(spec, sizes[0]):
        return sizes[-1]
    needed = next((size for size in sizes if size >= wanted), sizes[-1])
    for size in sizes:
        if size <= needed and not bucket_built(spec, size):
            queue_bucket(spec, size, first=size == needed)
    return max(size for size in sizes if bucket_usable(spec, size))


def queue_bucket(spec: SpecRunner, size: int, *, first: bool = False) -> None:
    """Queue batch bucket `size` on the background builder: its base programs
    (bucket_usable), and behind every bucket's base programs its other round shapes, a job
    a shape (a drafted shape may take a CPU 10 s to compile: a burst that needs another
    bucket waits for one, not for all); `first`: ahead of every other bucket's (the one a
    waiting batch needs). A job queued before keeps its place."""
    builder, index = spec.target.builder, spec.buckets.bs_paddings.index(size)
    later = len(spec.buckets.bs_paddings)
    builder.submit(("speculative bucket", size),
                   lambda: _build_all(_base_builds(spec, size)), priority=-2 if first else index)
    queue_shapes(spec, size, priority=later if first else later + 1 + index)


def queue_shapes(spec: SpecRunner, size: int, priority: int) -> None:
    """Queue the round shapes of batch bucket `size` beyond its base ones, a job each."""
    for shape in _extra_shapes(spec):
        spec.target.builder.submit(
            ("speculative shape", size, shape.name), priority=priority,
            build=lambda shape=shape: _build_all(_round_builds(spec, [shape], size)))


def _build_all(builds: Sequence[Callable[[], object]]) -> None:
    for build in builds:
        build()


def masked_ready(spec: SpecRunner, bucket: int) -> bool:
    """Whether the grammar-masked pair of `bucket` may run now; with a builder, one not built
    yet goes to it (the batch takes plain rounds meanwhile)."""
    if spec.target.builder is None or spec.masked_built(bucket):
        return True
    spec.target.builder.submit(("masked round", bucket),
                               functools.partial(build_masked, spec, bucket),
                               priority=spec.buckets.bs_paddings.index(bucket))
    return False


def build_bucket(spec: SpecRunner, size: int) -> None:
    """Build, never run, every program a round of batch bucket `size` may run but the
    grammar-masked pair (build_masked): from any thread, while the engine serves."""
    _build_all(_base_builds(spec, size) + _round_builds(spec, _extra_shapes(spec), size))


def _extra_shapes(spec: SpecRunner) -> list[TreeShape]:
    base = base_shapes(spec)
    return [shape for shape in spec.shapes if shape not in base]


def _base_builds(spec: SpecRunner, size: int) -> list[Callable[[], object]]:
    """The programs that make batch bucket `size` usable (bucket_usable)."""
    builds = _round_builds(spec, base_shapes(spec), size)
    builds.append(functools.partial(spec.target.build_program, spec.buckets.decode_shape(size)))
    if spec.defers_draft:
        inputs = spec.catch_up_inputs(
            [CatchUpRow(-1, [0], 0, [], np.zeros((0, spec.feature_width)))] * size, size)
        draft = spec.draft_state
        builds.append(functools.partial(spec.catch_ups.build, size, spec.drafter.params,
                                        draft.kv, draft.slots, *inputs))
    return builds


def _round_builds(spec: SpecRunner, shapes: Sequence[TreeShape], size: int
                  ) -> list[Callable[[], object]]:
    """The round programs of `shapes` in batch bucket `size`, one call each (padding rows)."""
    rows = _padding_rows(spec, size)
    sampling = greedy_sampling_batch(size, spec.vocab_size)
    builds = []
    for shape in shapes:
        if shape == PLAIN and spec.plain_is_decode_step:  # a _base_builds program
            continue
        packed, packing = spec.packed_round_inputs(shape, rows, sampling, np.int32(NO_LOGPROBS))
        builds.append(functools.partial(spec.rounds[shape].build, size, *spec.state_args(),
                                        *packed, packing=packing))
    return builds


def build_masked(spec: SpecRunner, size: int) -> None:
    """Build, never run, the grammar-masked pair of batch bucket `size` (any thread)."""
    rows = _padding_rows(spec, size)
    draft = spec.draft_state
    trees = spec.tree_drafts.build(size, spec.drafter.params, draft.kv, draft.slots,
                                   spec.state.lengths, spec.state.last_tokens, rows)
    # The tree comes back to the host between the two (draft_trees): plain host arrays.
    tree = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trees.out_info[0])
    spec.masked_verifies.build(
        size, *spec.state_args(), rows, tree, greedy_sampling_batch(size, spec.vocab_size),
        np.int32(NO_LOGPROBS), allow_every_id(tree.tokens.shape, spec.vocab_size))


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
                       for slot in slots], padded=len(slots))


def _warm_masked_round(spec: SpecRunner, rows: RoundRows) -> None:
    size = len(rows.slots)
    tree = spec.draft_trees(rows)
    spec.masked_verify(rows, greedy_sampling_batch(size, spec.vocab_size), False, tree,
                       allow_every_id(tree.tokens.shape, spec.vocab_size)).result()


def _warm_prefill(spec: SpecRunner, shape: BatchShape) -> None:
    spec.prefill(*_dummy_prefill(spec, shape)).result()


def build_prefill(spec: SpecRunner, tokens: int) -> None:
    """Build, never run, the prefill program of token bucket `tokens` (any thread)."""
    chunks, sampling, emits, _, next_tokens, slots = _dummy_prefill(
        spec, spec.buckets.extend_shape(tokens))
    shape, inputs = spec.prefill_inputs(chunks, sampling, emits, np.int32(NO_LOGPROBS),
                                        next_tokens, slots, run_draft=True)
    spec.prefills.build(shape, *spec.state_args(), *inputs)


def prefill_limit(spec: SpecRunner, wanted: int) -> int:
    """The most tokens a prefill may take with the programs built so far; the token buckets
    `wanted` needs go to the builder."""
    return ready_batch_limit(
        spec.buckets.token_paddings, wanted, spec.target.builder,
        lambda tokens: spec.buckets.extend_shape(tokens) in spec.prefills,
        functools.partial(build_prefill, spec), "speculative prefill")


def _dummy_prefill(spec: SpecRunner, shape: BatchShape) -> tuple:
    """Arguments of a prefill filling `shape` that writes only into the null page."""
    chunks = _dummy_chunks(shape, spec.buckets.context_len, spec.page_size)
    count = len(chunks)
    slots = spec.target.scratch_state_slots(count)
    chunks = [dataclasses.replace(c, state_slot=slot)
              for c, slot in zip(chunks, slots, strict=True)]
    return (chunks, greedy_sampling_batch(count, spec.vocab_size), np.zeros(count, bool),
            False, [0] * count, np.full(count, -1, np.int32))


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


def _dummy_chunks(shape: BatchShape, context_len: int, page_size: int) -> list[SeqChunk]:
    """Chunks filling a bucket that write only into the null page (warm-up)."""
    if shape.q_block == 1:
        return [SeqChunk([0], 0, [0]) for _ in range(shape.num_tokens)]
    length = min(shape.num_tokens, context_len)
    return [SeqChunk([0] * length, 0, [0] * -(-length // page_size))]
