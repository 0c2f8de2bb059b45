"""ModelRunner: owns the parameters, the KV cache and the sampling state, and runs jitted steps.

Every step is padded to a bucketed shape (`Buckets`), so a warm-up that compiles each bucket
once leaves nothing to compile while serving. Two kinds of batch exist:
decode (one new token per sequence) and extend (prefill chunks or verify windows).
For a hybrid model (Qwen3-Next) the cache also holds each linear layer's recurrent-state
pool; every chunk then names its request's state slot, and the step reads and writes it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from sgl_jax.layers.attention import get_attention_backend, resolve_attention_backend
from sgl_jax.layers.sampler import (
    NO_LOGPROBS,
    SampleOutput,
    SamplingBatch,
    init_penalty_state,
    logprob_detail,
    record_tokens,
    reset_slots,
    sample,
)
from sgl_jax.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax.model_executor.decode_rows import DecodeColumns
from sgl_jax.model_executor.device_state import DeviceState, SlotLengths
from sgl_jax.model_executor.forward_batch import (
    BatchShape,
    Buckets,
    ForwardBatch,
    SeqChunk,
    build_forward_batch,
    token_positions,
)
from sgl_jax.model_executor.packing import Layouts, unpack
from sgl_jax.model_executor.program_params import ProgramParams
from sgl_jax.model_executor.programs import BackgroundBuilder, ExecutableStore, Programs
from sgl_jax.model_executor.target_forward import TargetForward, target_features
from sgl_jax.models.loader import LoadedModel
from sgl_jax.parallel.multihost import device_call
from sgl_jax.process_maps import WarmupForecast
from sgl_jax.sampling_params import MAX_LOGIT_BIAS

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_SUPPRESSED_IDS = 16  # EOS + stop ids a row can ban while min_new_tokens is unmet


def _warn_if_slow_on_cpu(attention_backend: str | None, dtype: jnp.dtype,
                         weights_format: str | None) -> None:
    """Say at start-up why a CPU run will crawl: correct, but many times slower. The
    figures: the demo model (SmolLM2-135M) at batch 1 on a 2-core CPU (docs/models.md)."""
    if jax.default_backend() != "cpu":
        return
    if resolve_attention_backend(attention_backend) == "fa":
        logger.warning("attention backend %s on CPU runs the Pallas kernel in interpret "
                       "mode, which is very slow; --attention-backend native (the CPU "
                       "default) is much faster", attention_backend)
    name = jnp.dtype(dtype).name
    if name in ("bfloat16", "float16"):
        logger.warning("--dtype %s on CPU is slow (most CPUs lack fast %s matmuls: the demo "
                       "model decodes 2.4 tokens/s in bfloat16, 34.8 in float32); --dtype "
                       "float32 (what auto picks on CPU) is much faster", name, name)
    if weights_format is not None:
        logger.warning("%s weights on CPU are slow (XLA:CPU has no fast 8-bit matmul: the "
                       "demo model decodes 5.6 tokens/s with int8 weights, 34.8 in float32); "
                       "leave out --quantization on CPU unless the float weights do not fit "
                       "in memory", weights_format)


def start_host_copies(arrays: Sequence[jax.Array | None]) -> None:
    """Start copying a step's results to the host as soon as they are computed, so reading
    them a step later does not wait for the transfer. A CPU's arrays are host memory
    already: there a copy started early only costs the engine thread (about 50 us each)."""
    if _results_in_host_memory():
        return
    for array in arrays:
        if array is not None:
            array.copy_to_host_async()


@functools.cache
def _results_in_host_memory() -> bool:
    return jax.default_backend() == "cpu"


@dataclass(frozen=True)
class StepOutput:
    """Host copies of one sampling step's results, one row per chunk."""

    tokens: np.ndarray  # i32[n]
    logprobs: np.ndarray | None  # f32[n]: raw log-probability of each token (None: not asked)
    top_logprob_ids: np.ndarray | None  # i32[n, MAX_TOP_LOGPROBS] (None: not asked)
    top_logprobs: np.ndarray | None  # f32[n, MAX_TOP_LOGPROBS]
    features: np.ndarray | None = None  # f[n, F]: a decode step's drafter features (asked)


class PendingStep:
    """A dispatched step's results, still on the device: their copy to the host starts at
    once (asynchronously), and `result()` waits for it. Only what some row asked for is
    copied."""

    def __init__(self, num_rows: int, tokens: jax.Array, logprobs: jax.Array | None = None,
                 top: tuple[jax.Array, jax.Array] | None = None,
                 features: jax.Array | None = None):
        self._num_rows = num_rows
        self._arrays = (tokens, logprobs, *(top or (None, None)), features)
        start_host_copies(self._arrays)

    @classmethod
    def of_sample(cls, num_rows: int, out: SampleOutput, want_logprobs: bool, want_top: bool,
                  features: jax.Array | None = None) -> PendingStep:
        """A sampling step's result, holding the log-probabilities some row wanted (and the
        drafter's features, where asked)."""
        return cls(num_rows, out.tokens, out.logprob if want_logprobs else None,
                   (out.top_logprob_ids, out.top_logprobs) if want_top else None, features)

    def result(self) -> StepOutput:
        n = self._num_rows
        return StepOutput(*(None if a is None else np.asarray(a)[:n] for a in self._arrays))


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        *,
        num_pages: int,
        page_size: int,
        buckets: Buckets | None = None,
        attention_backend: str = "native",
        capture_layers: tuple[int, ...] = (),
        # What a decode step hands a drafter that plain steps leave behind (target_forward's
        # target_features kind: "aux" over capture_layers, "final", or "" for nothing).
        features: str = "",
        num_request_slots: int = 1,  # rows of the per-request device state (penalties, tokens)
        num_state_slots: int = 0,  # hybrid models: recurrent-state slots, the null slot included
        kv_dtype: jax.typing.DTypeLike | None = None,  # the KV pages'; None: the model dtype
        store: ExecutableStore | None = None,  # compiled programs kept between processes
        builder: BackgroundBuilder | None = None,  # None: a missing program compiles when due
    ):
        if model.config.is_hybrid and num_state_slots < 2:
            raise ValueError(f"{model.config.architecture} keeps a recurrent state per request: "
                             "the runner needs num_state_slots >= 2 (slot 0 is the null slot)")
        self.model = model
        self.config = model.config
        self.page_size = page_size
        self.buckets = buckets or Buckets.automatic(
            max_tokens=4096, max_seqs=64, context_len=model.config.max_position_embeddings,
            page_size=page_size,
        )
        self.num_compilations = 0  # traces of the jitted functions; steady serving adds none
        self.tp = model.tp
        # What the KV pages store (--kv-cache-dtype); a drafter's own cache stores the same.
        self.kv_dtype = jnp.dtype(model.dtype if kv_dtype is None else kv_dtype)
        self.state = DeviceState(
            kv_cache=allocate_kv_cache(
                model.config, num_pages=num_pages, page_size=page_size, dtype=model.dtype,
                tp=self.tp, num_state_slots=num_state_slots, kv_dtype=self.kv_dtype),
            penalties=self.tp.put_replicated(
                init_penalty_state(num_request_slots, self.config.vocab_size)),
            last_tokens=self.tp.put_replicated(jnp.zeros(num_request_slots, jnp.int32)),
            lengths=self.tp.put_replicated(SlotLengths(
                jnp.zeros(num_request_slots, jnp.int32), jnp.zeros(num_request_slots,
                                                                   jnp.int32))))
        self.features = features
        self.num_state_slots = num_state_slots if model.config.is_hybrid else 0
        _warn_if_slow_on_cpu(attention_backend, model.dtype, model.weights.name)
        # The target's forward, which speculative rounds run too.
        self.target_forward = TargetForward(
            model, self.tp.attention(get_attention_backend(attention_backend)))
        forward = functools.partial(self._forward, capture=capture_layers)
        self.logits_step = jax.jit(
            functools.partial(self._logits_step_impl, forward=forward), donate_argnums=(1,)
        )
        self._sampling_step = jax.jit(
            functools.partial(self._sampling_step_impl, forward=forward),
            donate_argnums=(1, 2, 3), static_argnames=("packing",),
        )
        self._reset_slots = jax.jit(self._reset_slots_impl, donate_argnums=(0,))
        self.store, self.builder = store, builder
        # The parameters as the sampling steps take them (few arguments: see ProgramParams).
        self.program_params = ProgramParams(model.params)
        # Compiled sampling steps by bucket, and the layout of each one's packed host inputs
        # (decode steps': their rows' columns): serving calls them directly, never tracing.
        self.sampling_programs = Programs("sampling_step", self._sampling_step, store)
        self._layouts = Layouts()
        self.decode_columns = decode_columns(self.buckets.pages_per_seq, page_size)
        # i32[N, W] of -1 by bucket rows: the bitmask of a step that no grammar masks, made
        # once (never written: a step may read it in place); and by bucket, the same placed
        # where its program reads it, so an unconstrained step sends no bitmask.
        self._unmasked: dict[int, np.ndarray] = {}
        self._unmasked_on_device: dict[BatchShape, jax.Array] = {}

    # ------------------------------------------------------------------ public steps

    def forward(
        self, chunks: Sequence[SeqChunk], *, all_logits: bool = False
    ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Run chunks and return raw logits (no sampling): for tests and benchmarks.

        Logits are f32[num_chunks, V] for each chunk's last token, or f32[num_tokens, V] for
        every token with all_logits; captured hidden states are f[num_tokens, H] each.
        """
        self._check_state_slots(chunks)
        shape = self.buckets.shape_for(chunks)
        if all_logits:
            shape = shape.with_logits_for_every_token()
        batch = build_forward_batch(chunks, page_size=self.page_size, shape=shape)
        state = self.state
        state.kv_cache, logits, captured = self.logits_step(self.model.params, state.kv_cache,
                                                             batch)
        tokens = np.concatenate(token_positions(chunks, shape))  # real tokens in the padded batch
        logits = np.asarray(logits)[tokens if all_logits else slice(len(chunks))]
        return logits, tuple(np.asarray(h)[tokens] for h in captured)

    @device_call
    def step(
        self,
        chunks: Sequence[SeqChunk],  # a decode chunk's token -1: its slot's last sampled token
        sampling: SamplingBatch,  # host arrays, one row per chunk (padded here)
        penalty_slots: np.ndarray,  # i32[n]: -1 for requests without penalties
        emits: np.ndarray,  # bool[n]: whether the row's token is kept (False mid-prefill)
        want_top_logprobs: bool,
        *,
        slots: np.ndarray | None = None,  # i32[n]: request slots (last_tokens rows); -1 none
        want_logprobs: bool = True,
    ) -> PendingStep:
        """Dispatch chunks and the sampling of each one's next token, without waiting: an
        emitting row's token is also kept on the device as its slot's last token."""
        self._check_state_slots(chunks)
        shape = self.buckets.shape_for(chunks)
        batch = build_forward_batch(chunks, page_size=self.page_size, shape=shape)
        rows = shape.num_logits
        sampling = jax.tree.map(lambda a: pad_rows(np.asarray(a), rows), sampling)
        n = len(chunks)
        slots = np.full(n, -1, np.int32) if slots is None else slots
        host = (batch, dataclasses.replace(sampling, allowed=None),
                pad_rows(penalty_slots.astype(np.int32), rows, -1),
                pad_rows(slots.astype(np.int32), rows, -1), pad_rows(emits, rows, False),
                logprob_detail(want_logprobs, want_top_logprobs))
        if shape.q_block == 1:  # one token a row: a decode-shaped program's rows
            ints, floats = self.decode_columns.rows_of(*host)
        else:
            (ints, floats), _ = self._layouts.pack(shape, host)
        return self.launch(shape, ints, floats, sampling.allowed, n,
                           want_top_logprobs=want_top_logprobs, want_logprobs=want_logprobs)

    @device_call
    def launch_decode(
        self,
        ints: np.ndarray,  # i32[N, Ci]: the rows of decode_rows.DecodeColumns, N a bucket
        floats: np.ndarray,  # f32[N, Cf]
        allowed: np.ndarray | None,  # i32[N, W]: the grammar bitmask (None: no grammar)
        num_rows: int,  # real rows, first in the batch
        *,
        want_top_logprobs: bool,
        want_logprobs: bool,
        want_features: bool = False,
    ) -> PendingStep:
        """Dispatch a decode step from its rows (SlotTable.decode_rows); with
        `want_features`, its results hold each row's drafter features (the runner's
        `features`) too."""
        shape = self.buckets.decode_shape(ints.shape[0])
        return self.launch(shape, ints, floats, allowed, num_rows,
                           want_top_logprobs=want_top_logprobs, want_logprobs=want_logprobs,
                           want_features=want_features)

    @device_call
    def launch(
        self,
        shape: BatchShape,  # the bucket
        ints: np.ndarray,  # the step's packed host inputs, in the layout of its bucket's
        floats: np.ndarray,  # program (decode: DecodeColumns; extend: its Packing)
        allowed: np.ndarray | None,  # i32[N, W]: the grammar bitmask (None: every id)
        num_rows: int,  # real rows, first in the batch
        *,
        want_top_logprobs: bool,
        want_logprobs: bool,
        want_features: bool = False,
    ) -> PendingStep:
        """Dispatch a step padded to its bucket (see step and launch_decode): every step,
        extend or decode, is dispatched here."""
        program = self._sampling_program(
            shape, (ints, floats, self._every_id_allowed(shape.num_logits)
                    if allowed is None else allowed))
        if allowed is None:
            allowed = self._every_id_allowed_on_device(shape, program)
        state = self.state
        (state.kv_cache, state.penalties, state.last_tokens, out, features) = program(
            self.program_params.arrays, state.kv_cache, state.penalties, state.last_tokens,
            state.lengths, ints, floats, allowed)
        return PendingStep.of_sample(num_rows, out, want_logprobs, want_top_logprobs,
                                     features if want_features else None)

    def _every_id_allowed(self, rows: int) -> np.ndarray:
        """i32[rows, W] of -1: every id allowed."""
        if rows not in self._unmasked:
            self._unmasked[rows] = np.full((rows, bitmask_words(self.config.vocab_size)), -1,
                                           np.int32)
        return self._unmasked[rows]

    def _every_id_allowed_on_device(self, shape: BatchShape, program: jax.stages.Compiled
                                    ) -> jax.Array:
        """_every_id_allowed of the bucket's rows, on the device as its program reads it."""
        if shape not in self._unmasked_on_device:
            self._unmasked_on_device[shape] = jax.device_put(
                self._every_id_allowed(shape.num_logits), program.input_shardings[0][7])
        return self._unmasked_on_device[shape]

    @device_call
    def reset_penalty_slot(self, slot: int, prompt_ids: Sequence[int]) -> None:
        """Start a request with penalties in `slot`: clear its counts, mark its prompt as seen."""
        width = self.buckets.prompt_width(len(prompt_ids))
        ids = np.full((1, width), -1, np.int32)
        ids[0, : len(prompt_ids)] = prompt_ids
        self.state.penalties = self._reset_slots(self.state.penalties, np.array([slot], np.int32),
                                                 ids)

    def warmup(self, shapes: Sequence[BatchShape] | None = None) -> None:
        """Build every bucket's program (or `shapes`') now, so serving never waits on the
        compiler: loaded from the executable store where kept, else traced and compiled
        without being run (a dummy 2048-token prefill alone takes seconds on a CPU). Tracing
        holds the GIL, so a pool compiles the programs already traced meanwhile."""
        shapes = [s for s in (self.buckets.all_shapes() if shapes is None else shapes)
                  if s not in self.sampling_programs]
        workers = max(1, min(4, os.cpu_count() or 1))
        forecast = WarmupForecast(len(shapes))
        with ThreadPoolExecutor(workers) as pool, tqdm(
                total=len(shapes), desc="Compiling step buckets", unit="bucket") as bar:
            for future in [pool.submit(self.build_program, shape) for shape in shapes]:
                future.result()
                forecast.compiled()
                bar.update()
        self.reset_penalty_slot(0, [])
        logger.info("Warm-up done: %d programs traced and compiled, %d loaded",
                    self.sampling_programs.traced, self.sampling_programs.loaded)

    def build_program(self, shape: BatchShape) -> None:
        """Build one bucket's sampling step without running it (any thread)."""
        self._sampling_program(shape, self._dummy_step_inputs(shape))

    def has_program(self, shape: BatchShape) -> bool:
        return shape in self.sampling_programs

    def decode_batch_limit(self, wanted: int) -> int:
        """The most sequences a decode step may take without waiting for a compile (see
        ready_batch_limit); decode buckets up to `wanted`'s are built in the background."""
        return ready_batch_limit(
            self.buckets.bs_paddings, wanted, self.builder,
            lambda size: self.has_program(self.buckets.decode_shape(size)),
            lambda size: self.build_program(self.buckets.decode_shape(size)), "decode step")

    def prefill_token_limit(self, wanted: int) -> int:
        """The most tokens an extend batch may take without waiting for a compile; token
        buckets up to `wanted`'s are built in the background."""
        return ready_batch_limit(
            self.buckets.token_paddings, wanted, self.builder,
            lambda tokens: self.has_program(self.buckets.extend_shape(tokens)),
            lambda tokens: self.build_program(self.buckets.extend_shape(tokens)),
            "extend step")

    def _sampling_program(self, shape: BatchShape, inputs: tuple) -> jax.stages.Compiled:
        """The sampling step of a bucket, built now if nothing built it yet; `inputs` are a
        call's (ints, floats, allowed), or arrays of their shapes."""
        program = self.sampling_programs.get(shape)
        if program is None:
            packing = (self.decode_columns if shape.q_block == 1
                       else self._layouts.layout_of(shape))
            program = self.sampling_programs.build(
                shape, self.program_params.arrays, self.state.kv_cache, self.state.penalties,
                self.state.last_tokens, self.state.lengths, *inputs, packing=packing)
        return program

    # ------------------------------------------------------------------ jitted bodies

    def _forward(self, params, kv_cache, batch: ForwardBatch, *, capture):
        self._log_compilation(batch)
        hidden, kv_cache, captured = self.target_forward(
            params, kv_cache, batch.input_ids, batch.positions, batch.attention,
            capture=capture, state_slots=batch.state_slots)
        logits = self.target_forward.logits(params, hidden[batch.logits_indices])
        return kv_cache, logits, captured, hidden

    def _logits_step_impl(self, params, kv_cache, batch, *, forward):
        kv_cache, logits, captured, _ = forward(params, kv_cache, batch)
        return kv_cache, *self.tp.constrain_replicated((logits, captured))

    def _sampling_step_impl(self, params, kv_cache, penalties, last_tokens, lengths, ints,
                            floats, allowed, *, packing, forward):
        params = self.program_params.unstack(params)
        features = None
        if isinstance(packing, DecodeColumns):
            batch, sampling, penalty_slots, slots, emits, detail = packing.unpack(
                ints, floats, allowed, lengths)
        else:
            batch, sampling, penalty_slots, slots, emits, detail = unpack(packing, ints, floats)
            sampling = dataclasses.replace(sampling, allowed=allowed)
        if batch.attention.q_block == 1:  # decode rows may read their input on the device
            batch = dataclasses.replace(batch, input_ids=_with_last_tokens(
                batch.input_ids, last_tokens, slots))
        kv_cache, logits, captured, hidden = forward(params, kv_cache, batch)
        if batch.attention.q_block == 1:  # f[N, F]: what a drafter left behind reads later
            features = target_features(self.features, hidden, captured)
        out = sample(logits, sampling, penalties, penalty_slots, detail=detail,
                     num_top_logprobs=MAX_TOP_LOGPROBS)
        penalties = record_tokens(penalties, penalty_slots, out.tokens, emits)
        kept = jnp.where(emits & (slots >= 0), slots, last_tokens.shape[0])  # others: dropped
        last_tokens = last_tokens.at[kept].set(out.tokens, mode="drop")
        return kv_cache, *self.tp.constrain_replicated((penalties, last_tokens, out, features))

    def _reset_slots_impl(self, penalties, slots, prompt_ids):
        self.num_compilations += 1
        return self.tp.constrain_replicated(reset_slots(penalties, slots, prompt_ids))

    # ------------------------------------------------------------------ helpers

    def scratch_state_slots(self, count: int) -> list[int]:
        """State slots for `count` warm-up rows: a hybrid model's need distinct real slots
        (their states are scratch: no request holds a slot during warm-up), others the null
        slot."""
        if not self.num_state_slots:
            return [0] * count
        return [1 + i % (self.num_state_slots - 1) for i in range(count)]

    def _check_state_slots(self, chunks: Sequence[SeqChunk]) -> None:
        """A hybrid model's chunks must each name a distinct real state slot."""
        if not self.num_state_slots:
            return
        slots = [c.state_slot for c in chunks]
        if not all(0 < s < self.num_state_slots for s in slots) or len(set(slots)) < len(slots):
            raise ValueError(f"every chunk needs its own state slot in 1..."
                             f"{self.num_state_slots - 1}, got {slots}")

    def _dummy_step_inputs(self, shape: BatchShape) -> tuple:
        """(ints, floats, allowed) of a sampling step of the given shape, every row padding
        (for compiling it)."""
        rows = shape.num_logits
        allowed = self._every_id_allowed(rows)
        if shape.q_block == 1:
            return (*self.decode_columns.padding_rows(rows), allowed)
        # One chunk padded up to the shape; it never needs more than a context's pages.
        length = min(shape.num_tokens, self.buckets.context_len)
        chunks = [SeqChunk([0] * length, 0, [0] * -(-length // self.page_size))]
        batch = build_forward_batch(chunks, page_size=self.page_size, shape=shape)
        sampling = greedy_sampling_batch(rows, self.config.vocab_size)
        host = (batch, dataclasses.replace(sampling, allowed=None), np.full(rows, -1, np.int32),
                np.full(rows, -1, np.int32), np.zeros(rows, bool), np.int32(NO_LOGPROBS))
        (ints, floats), _ = self._layouts.pack(shape, host)
        return ints, floats, allowed

    def _log_compilation(self, batch: ForwardBatch) -> None:
        # Runs only while tracing, i.e. once per new bucket of shapes.
        self.num_compilations += 1
        meta = batch.attention
        logger.info(
            "Compiling step #%d: tokens=%d q_block=%d pages/seq=%d logits=%d%s",
            self.num_compilations, batch.input_ids.shape[0], meta.q_block,
            meta.page_table.shape[1], batch.logits_indices.shape[0],
            " tree-mask" if meta.tree_bits is not None else "",
        )


def ready_batch_limit(sizes: Sequence[int], wanted: int, builder: BackgroundBuilder | None,
                      is_built: Callable[[int], bool], build: Callable[[int], None],
                      name: str) -> int:
    """The largest of the buckets `sizes` (ascending: batch sizes, or extend token counts)
    up to which every bucket's programs are built (`is_built(size)`); the missing buckets up
    to the one `wanted` needs go to `builder` (job ids `(name, size)`), smallest first.
    Without a builder, or before even the smallest is built, every size is allowed (a
    missing program then compiles when due)."""
    if builder is None or not is_built(sizes[0]):
        return sizes[-1]
    limit = next((s for s in sizes if not is_built(s)), None)
    if limit is None:
        return sizes[-1]
    needed = next((s for s in sizes if s >= wanted), sizes[-1])
    for size in sizes:
        if limit <= size <= needed and not is_built(size):
            builder.submit((name, size), functools.partial(build, size),
                           priority=sizes.index(size))
    return max(s for s in sizes if s < limit)


def _with_last_tokens(input_ids: jax.Array, last_tokens: jax.Array, slots: jax.Array
                      ) -> jax.Array:
    """i32[N] decode inputs: a -1 becomes the row's slot's last sampled token."""
    return jnp.where(input_ids < 0, last_tokens[jnp.maximum(slots, 0)], input_ids)


def pad_rows(array: np.ndarray, rows: int, fill=0) -> np.ndarray:
    """array [n, ...] -> [rows, ...], the rows past n filled with `fill`."""
    pad = [(0, rows - array.shape[0])] + [(0, 0)] * (array.ndim - 1)
    return np.pad(array, pad, constant_values=fill)


def bitmask_words(vocab_size: int) -> int:
    """Width of a row of the grammar bitmask: one bit per token id."""
    return -(-vocab_size // 32)


def decode_columns(pages_per_seq: int, page_size: int) -> DecodeColumns:
    """The layout of a decode step's rows for page tables `pages_per_seq` wide."""
    return DecodeColumns(pages_per_seq, page_size,
                         (("E", MAX_SUPPRESSED_IDS), ("M", MAX_LOGIT_BIAS)))


def greedy_sampling_batch(rows: int, vocab_size: int) -> SamplingBatch:
    """Host arrays for `rows` greedy rows without penalties, biases or grammars (padding and
    warm-up)."""
    return SamplingBatch.neutral(rows, E=MAX_SUPPRESSED_IDS, M=MAX_LOGIT_BIAS,
                                 W=bitmask_words(vocab_size))
