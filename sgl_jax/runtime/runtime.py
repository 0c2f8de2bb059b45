"""Runtime: builds and owns what runs (the model, its pools, the runners and their warm-up,
the scheduler and the thread that drives it) and takes it all down again.

The Engine (entrypoints/engine.py) puts a front door before it: requests come in as
scheduler requests (`submit`), and the scheduler's outputs go to the callback the runtime was
built with. With several nodes, rank 0 runs the scheduler and sends every device call to
the other ranks, which replay them on their own runners (parallel/multihost.py) until rank 0
stops.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from sgl_jax.cache import enable_compilation_cache
from sgl_jax.layers.attention import resolve_attention_backend
from sgl_jax.mem_cache.page_allocator import PageAllocator
from sgl_jax.mem_cache.radix_cache import RadixCache
from sgl_jax.mem_cache.state_slots import StateSlotAllocator
from sgl_jax.model_executor.forward_batch import Buckets, default_token_paddings, powers_of_two
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.model_executor.programs import BackgroundBuilder
from sgl_jax.models.loader import load_model
from sgl_jax.parallel import TensorParallel, init_distributed, shutdown_distributed
from sgl_jax.parallel.multihost import (
    Mirrored,
    StepReceiver,
    StepSender,
    channel_address,
    follow,
)
from sgl_jax.process_maps import return_free_heap
from sgl_jax.runtime import warmup
from sgl_jax.runtime.budget import PoolSizes, size_pools
from sgl_jax.runtime.executables import open_store
from sgl_jax.runtime.usage import RuntimeUsage, usage_of
from sgl_jax.scheduler.cache_manager import CacheManager
from sgl_jax.scheduler.decoding import Decoding, PlainDecoding
from sgl_jax.scheduler.engine_loop import EngineLoop
from sgl_jax.scheduler.prefill_manager import PrefillLimits
from sgl_jax.scheduler.req import Req
from sgl_jax.scheduler.scheduler import OutputCallback, Scheduler
from sgl_jax.scheduler.slot_table import SlotTable
from sgl_jax.server_args import ServerArgs
from sgl_jax.speculative.decode_loop import SpecDecoder
from sgl_jax.speculative.drafters.factories import DrafterSetup, make_drafter, round_shapes
from sgl_jax.speculative.round.verify import AcceptThresholds
from sgl_jax.speculative.spec_runner import SpecRunner
from sgl_jax.version import __version__

logger = logging.getLogger(__name__)


class Runtime:
    """What serves one model on this process's devices. Its parts are public for inspection
    (tests, benchmarks); only the engine thread touches the scheduler's state, so `call`
    runs a function there."""

    def __init__(self, args: ServerArgs, *, on_output: OutputCallback):
        self.args = args = _settled(args)
        self.model = load_model(args.model_path, dtype=args.dtype, revision=args.revision,
                                tp=TensorParallel.of_size(args.tp_size),
                                quantization=args.quantization)
        self.context_length = args.context_length or self.model.config.max_position_embeddings
        buckets = self._buckets()
        self.adaptive = args.speculative is not None and self._adaptive()
        drafter = self._drafter()
        pools = size_pools(args, self.model, buckets, self.context_length,
                           drafter and drafter.drafter.params, drafter and drafter.drafter.cache)
        self.store = open_store(args, self.model)
        # Larger buckets build here while the server answers (one process, warm-up on).
        self.builder = (BackgroundBuilder() if args.nnodes == 1 and not args.skip_server_warmup
                        else None)
        self.allocator = PageAllocator(pools.num_pages)
        self.state_slots = (StateSlotAllocator(pools.num_state_slots)
                            if pools.num_state_slots else None)
        self.runner: ModelRunner | None = self._model_runner(buckets, pools, drafter)
        self.spec_runner: SpecRunner | None = drafter and self._spec_runner(drafter)
        # Kept apart from the runners, which shutdown() lets go of.
        self.lookahead = self.spec_runner.lookahead if self.spec_runner else 0
        if not args.skip_server_warmup:  # every rank compiles the same buckets
            warmup.warm_up(self.runner, self.spec_runner)
        self.loop: EngineLoop | None = None
        self._sender: StepSender | None = None
        self._refusal: str | None = None  # why new requests are refused (shutting down)
        if args.node_rank > 0:
            self._follow_rank0()
            return
        runner, spec = self._device_views()
        self.decoding = self._decoding(runner, spec, drafter)
        self.scheduler = self._scheduler(runner, on_output)
        self.loop = EngineLoop(self.scheduler, self._on_crash)

    def start_background_builds(self) -> None:
        """Let the builder start on the larger buckets: once the caller is ready to serve
        (its tracing would hold the GIL against the rest of the start)."""
        if self.builder is not None:
            self.builder.resume()

    # ------------------------------------------------------------------ building

    def _buckets(self) -> Buckets:
        args = self.args
        tokens = args.precompile_token_paddings or default_token_paddings(args.max_prefill_tokens)
        seqs = args.precompile_bs_paddings or powers_of_two(1, args.max_running_requests)
        seqs = tuple(s for s in seqs if s <= args.max_running_requests) or seqs[:1]
        return Buckets(tokens, seqs, self.context_length, args.page_size)

    def _adaptive(self) -> bool:
        """The adaptive policy needs every candidate shape compiled and timed at warm-up."""
        if self.args.speculative.adaptive and self.args.skip_server_warmup:
            logger.warning("--speculative-adaptive (and --speculative-per-request-lengths) "
                           "needs the warm-up's timing of every round shape; with "
                           "--skip-server-warmup every round takes the flags' shape")
        return self.args.speculative.adaptive and not self.args.skip_server_warmup

    def _drafter(self) -> DrafterSetup | None:
        spec = self.args.speculative
        if spec is None:
            return None
        return make_drafter(spec, self.model, attention_backend=self.args.attention_backend,
                            page_size=self.args.page_size,
                            shapes=round_shapes(spec, self.adaptive))

    def _model_runner(self, buckets: Buckets, pools: PoolSizes,
                      drafter: DrafterSetup | None) -> ModelRunner:
        """The target's runner; beside a drafter that plain rounds leave behind, its decode
        steps hand back what that drafter reads of each token (for the catch-up)."""
        defers = drafter is not None and drafter.drafter.defers
        return ModelRunner(
            self.model, num_pages=pools.num_pages, page_size=self.args.page_size,
            buckets=buckets, attention_backend=self.args.attention_backend,
            capture_layers=drafter.drafter.capture_layers if defers else (),
            features=drafter.drafter.features if defers else "",
            num_request_slots=buckets.max_seqs, num_state_slots=pools.num_state_slots,
            kv_dtype=pools.kv_dtype, store=self.store, builder=self.builder)

    def _spec_runner(self, setup: DrafterSetup) -> SpecRunner:
        spec = self.args.speculative
        logger.info("Speculative decoding: %s, steps %d, topk %d, draft tokens %d, capture %s, "
                    "adaptive %s", spec.algorithm, spec.num_steps, spec.eagle_topk,
                    spec.num_draft_tokens, setup.drafter.capture_layers,
                    "on" if self.adaptive else "off")
        thresholds = AcceptThresholds(spec.accept_threshold_single, spec.accept_threshold_acc)
        return SpecRunner(self.runner, setup.drafter, spec.shape, thresholds=thresholds,
                          shapes=round_shapes(spec, self.adaptive))

    def _device_views(self) -> tuple[ModelRunner, SpecRunner | None]:
        """The runners as the scheduler calls them: with several nodes, rank 0's view of
        them, which sends their device calls to the other ranks first."""
        if self.args.nnodes == 1:
            return self.runner, self.spec_runner
        self._sender = StepSender(channel_address(self.args.dist_init_addr),
                                  self.args.nnodes - 1)
        spec = self.spec_runner and Mirrored(self.spec_runner, "spec", self._sender)
        return Mirrored(self.runner, "runner", self._sender), spec

    def _decoding(self, runner: ModelRunner, spec: SpecRunner | None,
                  drafter: DrafterSetup | None) -> Decoding:
        """Plain or speculative decoding over the runners."""
        buckets = self.runner.buckets
        self.slot_table = SlotTable(buckets.max_seqs, self.runner.decode_columns,
                                    self.model.config.vocab_size)
        if spec is None:
            return PlainDecoding(runner, self.slot_table)
        return SpecDecoder(spec, runner, self.slot_table, adaptive=self.adaptive,
                           proposer=drafter.proposer)

    def _scheduler(self, runner: ModelRunner, on_output: OutputCallback) -> Scheduler:
        args, buckets = self.args, self.runner.buckets
        cache = CacheManager(self.allocator, self._radix_cache(), args.page_size,
                             page_reuse=self.decoding.page_reuse, states=self.state_slots)
        limits = PrefillLimits(
            max_prefill_tokens=min(args.max_prefill_tokens, buckets.max_tokens),
            chunk_size=min(args.chunk_size, buckets.max_tokens),
            # below the smallest batch bucket, the flag still caps the batch (padded up)
            max_running_requests=min(args.max_running_requests, buckets.max_seqs),
            completion_lookahead=self.lookahead,
            prompt_ends_in_prefill=self.spec_runner is not None)
        return Scheduler(runner, cache, limits, self.slot_table, self.decoding,
                         on_output=on_output, decode_log_interval=args.decode_log_interval,
                         overlap=not args.disable_overlap_schedule)

    def _radix_cache(self) -> RadixCache | None:
        config = self.model.config
        if self.args.disable_radix_cache:
            return None
        if config.is_hybrid:
            logger.info("Radix prefix cache off: %s keeps a recurrent state per request in its "
                        "linear-attention layers, which cannot be rebuilt from cached KV pages",
                        config.architecture)
            return None
        return RadixCache(self.allocator, self.args.page_size)

    def _follow_rank0(self) -> None:
        """Ranks > 0 take no requests: they replay rank 0's device calls until it stops."""
        args = self.args
        logger.info("Rank %d of %d: following rank 0 at %s", args.node_rank, args.nnodes,
                    args.dist_init_addr)
        receiver = StepReceiver(channel_address(args.dist_init_addr))
        try:
            calls = follow(receiver, {"runner": self.runner, "spec": self.spec_runner})
        finally:
            receiver.close()
        logger.info("Rank %d: rank 0 stopped after %d steps", args.node_rank, calls)
        shutdown_distributed()
        self._release_device_state()

    # ------------------------------------------------------------------ serving

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + generated tokens one request can have: the context length, or the
        KV pool (less what a step writes past a request's tokens) if that is smaller."""
        pool = self.allocator.capacity * self.args.page_size - self.lookahead
        return min(self.context_length, pool)

    def call(self, command: Callable[[Scheduler], Any]) -> Any:
        """Run `command(scheduler)` on the engine thread and return its result."""
        return self.ensure_running().call(command)

    def submit(self, command: Callable[[Scheduler], Any]) -> Future:
        """Run `command(scheduler)` on the engine thread; its result comes as a Future."""
        return self.ensure_running().submit(command)

    def add_requests(self, reqs: list[Req]) -> Future:
        def add_all(scheduler: Scheduler) -> None:
            for req in reqs:
                scheduler.add_request(req)
        return self.submit(add_all)

    def stop_admitting(self, why: str) -> None:
        """Refuse new requests from now on (`ensure_admitting` raises with `why`); the running
        ones go on."""
        self._refusal = why

    def ensure_admitting(self) -> None:
        """A RuntimeError says why no new request is taken (shut down, or shutting down)."""
        self.ensure_running()
        if self._refusal is not None:
            raise RuntimeError(self._refusal)

    def abort_all(self, message: str) -> None:
        """Abort every running and waiting request: each caller gets an abort with `message`."""
        self.call(lambda scheduler: scheduler.abort_all(message))

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        self.submit(lambda scheduler: scheduler.abort(rid, message))

    def end(self, rid: str, reason: dict[str, Any]) -> None:
        """Finish a request now for `reason` (the output side found a stop string)."""
        self.submit(lambda scheduler: scheduler.end(rid, reason))

    def flush_cache(self) -> bool:
        """Drop every cached prefix (and what the decoding keeps of finished requests);
        refused (False) while requests are running."""
        def flush(scheduler: Scheduler) -> bool:
            scheduler.settle_if_idle()
            if scheduler.has_work:
                return False
            scheduler.cache.flush()
            scheduler.decoding.flush()
            return True
        return self.call(flush)

    def usage(self) -> RuntimeUsage:
        """Pages, state slots and requests in use now (read on the engine thread)."""
        return self.call(usage_of)

    def server_info(self) -> dict[str, Any]:
        """What the runtime serves and how it is doing (/get_server_info)."""
        def info(scheduler: Scheduler) -> dict[str, Any]:
            cache = scheduler.cache
            return {**self._settings(), **usage_of(scheduler).server_info(),
                    "cache_hit_rate": cache.cache_hit_tokens / max(cache.cache_query_tokens, 1),
                    "num_retractions": scheduler.decode.num_retractions,
                    "num_compilations": scheduler.runner.num_compilations,
                    "scheduler_phases": scheduler.stats.phases_info(),
                    "programs_building": self.builder.pending() if self.builder else 0,
                    **scheduler.decoding.server_info(), "version": __version__}
        return self.call(info)

    def _settings(self) -> dict[str, Any]:
        dtype = np.dtype(self.model.dtype).name
        return {**self.args.to_dict(), "dtype": dtype,  # what `auto` resolved to
                # int8 / fp8 (quantized here, or an FP8 checkpoint's), else the dtype's name
                "weights_format": self.model.weights.name or dtype,
                "context_length": self.context_length,
                "max_total_num_tokens": self.allocator.capacity * self.args.page_size,
                "kv_pages_dtype": self.runner.kv_dtype.name}  # what kv_cache_dtype means

    # ------------------------------------------------------------------ stopping

    @property
    def running(self) -> bool:
        return self.loop is not None

    def shutdown(self, abandon_builds: bool = False) -> None:
        """Abort what is still running or waiting, stop the engine thread, release the device
        memory. A background build that is compiling is waited for, unless `abandon_builds`
        (a server about to exit: see BackgroundBuilder.stop)."""
        if self.loop is None:
            return
        self.abort_all("engine shut down")
        self.loop.stop()
        self.loop = None
        if self.builder is not None and abandon_builds:
            self.builder.stop(BUILD_GRACE_S)
        elif self.builder is not None:
            self.builder.stop()  # its default wait: the build's programs go with the rest
        if self._sender is not None:
            self._sender.close()
            shutdown_distributed()
        self._release_device_state()

    def _release_device_state(self) -> None:
        """Let go of the runners: the KV cache, the parameters' last users and every compiled
        program. XLA:CPU maps each compiled kernel's code into the process apart (about three
        memory mappings a kernel, a few hundred a program), and the kernel allows a process
        65530 mappings: a runtime kept after shutdown must not keep its programs, or a second
        one built in the same process would crash while it compiles. The runners sit in
        reference cycles (their jitted functions close over them): collect them now rather
        than at some later cyclic collection. JAX's tracing and lowering caches also hold
        the runners' jitted functions (every program built ahead of its first call left about
        370 mappings of each tiny engine behind): they are cleared too. Another engine alive in
        this process keeps its compiled programs; only what it traces anew pays."""
        self.runner = self.spec_runner = None
        self.scheduler = self.decoding = None
        gc.collect()
        jax.clear_caches()
        gc.collect()
        return_free_heap()

    def ensure_running(self) -> EngineLoop:
        """The engine loop; a RuntimeError says why there is none."""
        if self.loop is None and self.args.node_rank > 0:
            raise RuntimeError(f"this engine is rank {self.args.node_rank} of "
                               f"{self.args.nnodes}: it only replays rank 0's steps, and rank "
                               "0 has stopped; send requests to rank 0")
        if self.loop is None:
            raise RuntimeError("the engine has been shut down")
        return self.loop

    def _on_crash(self, exc: BaseException) -> None:
        """Engine thread: a step raised; fail every request instead of hanging its caller."""
        self.scheduler.abort_all(f"internal error: {exc!r}")


# Seconds a server about to exit waits for a background build that is compiling.
BUILD_GRACE_S = 1.0


def _settled(args: ServerArgs) -> ServerArgs:
    """Start what must come before any device use (the compilation cache, the other nodes),
    refuse a device JAX does not run on, and settle the platform's attention backend, so
    server info reports what actually runs."""
    if not args.disable_compilation_cache:
        enable_compilation_cache(args.compilation_cache_dir)
    init_distributed(args.nnodes, args.node_rank, args.dist_init_addr)
    if args.device is not None:
        _check_device(args.device)
    return dataclasses.replace(args,
                               attention_backend=resolve_attention_backend(args.attention_backend))


def _check_device(device: str) -> None:
    platform = "gpu" if device == "cuda" else device
    if jax.default_backend() != platform:
        raise ValueError(f"--device {device} was asked for, but JAX runs on "
                         f"{jax.default_backend()} ({jax.devices()[0].device_kind}); install "
                         f"JAX for {device} or pass --device {jax.default_backend()}")
