"""The offline Python API: `sgl_jax.Engine(model_path=..., **server_args)`.

The engine loop owns the device in its own thread; `generate` (blocking or streaming) and
`async_generate` (awaitable or async-iterable) submit requests to it, so an HTTP server and
offline callers can share one engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from sgl_jax.cache import enable_compilation_cache
from sgl_jax.demo import DEMO_MODEL_NAME, demo_draft_path, demo_model_path
from sgl_jax.entrypoints.output_stream import OutputStream
from sgl_jax.grammar import GrammarCompiler
from sgl_jax.layers.attention import resolve_attention_backend
from sgl_jax.mem_cache.kv_cache import kv_bytes_per_token, kv_cache_dtype, kv_pool_pages
from sgl_jax.mem_cache.page_allocator import PageAllocator
from sgl_jax.mem_cache.radix_cache import RadixCache
from sgl_jax.mem_cache.state_pool import state_bytes_per_slot
from sgl_jax.mem_cache.state_slots import StateSlotAllocator
from sgl_jax.model_executor.forward_batch import Buckets, default_token_paddings, powers_of_two
from sgl_jax.model_executor.model_runner import MAX_SUPPRESSED_IDS, MAX_TOP_LOGPROBS, ModelRunner
from sgl_jax.models.loader import load_model
from sgl_jax.parallel import (
    TensorParallel,
    bytes_per_device,
    init_distributed,
    shutdown_distributed,
)
from sgl_jax.parallel.multihost import (
    Mirrored,
    StepReceiver,
    StepSender,
    channel_address,
    follow,
)
from sgl_jax.sampling_params import SamplingParams, model_sampling_defaults
from sgl_jax.scheduler.cache_manager import CacheManager
from sgl_jax.scheduler.decoding import PlainDecoding
from sgl_jax.scheduler.engine_loop import EngineLoop
from sgl_jax.scheduler.prefill_manager import PrefillLimits
from sgl_jax.scheduler.req import Req
from sgl_jax.scheduler.scheduler import Scheduler
from sgl_jax.scheduler.slot_table import SlotTable
from sgl_jax.server_args import ServerArgs
from sgl_jax.speculative.decoder import SpecDecoder
from sgl_jax.speculative.setup import load_draft, make_proposer, make_spec_runner
from sgl_jax.speculative.spec_runner import SpecRunner
from sgl_jax.tokenizer import load_tokenizer
from sgl_jax.tokenizer.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
Params = dict[str, Any] | list[dict[str, Any]] | None
_SEED_STRIDE = 0x9E3779B1  # spreads the n samples of one seeded request over distinct seeds


class Engine:
    """Loads a model once and serves generation requests from any thread or event loop."""

    def __init__(self, model_path: str | None = None, **server_args: Any):
        """`model_path` (or `model`, as SGLang's examples spell it): a local directory, a
        Hugging Face id or a .gguf file; None serves the built-in demo model."""
        if "model" in server_args:
            if model_path is not None:
                raise TypeError("give the model as model_path or as model, not both")
            model_path = server_args.pop("model")
        if model_path is None:
            model_path = str(demo_model_path())
            server_args["served_model_name"] = (server_args.get("served_model_name")
                                                or DEMO_MODEL_NAME)
            logger.info("No model path given: serving the built-in demo model %s from %s",
                        DEMO_MODEL_NAME, model_path)
            if (str(server_args.get("speculative_algorithm") or "").upper() == "EAGLE3"
                    and not server_args.get("speculative_draft_model_path")):
                server_args["speculative_draft_model_path"] = str(demo_draft_path())
                logger.info("No draft given: using the demo model's trained EAGLE3 head")
        args = ServerArgs(model_path=model_path, **server_args)
        if args.dp_size > 1:
            raise ValueError(f"dp_size {args.dp_size}: an Engine is one replica; "
                             "`python -m sgl_jax.launch_server --dp-size N` starts N behind a "
                             "router")
        if not args.disable_compilation_cache:
            enable_compilation_cache(args.compilation_cache_dir)
        init_distributed(args.nnodes, args.node_rank, args.dist_init_addr)  # before any device use
        _check_available(args)
        # Settle the platform default once, so server info reports what actually runs.
        self.server_args = args = dataclasses.replace(
            args, attention_backend=resolve_attention_backend(args.attention_backend))
        self.model = load_model(model_path, dtype=args.dtype, revision=args.revision,
                                tp=TensorParallel.of_size(args.tp_size),
                                quantization=args.quantization)
        self.tokenizer = load_tokenizer(args.tokenizer_path or self.model.model_dir,
                                        trust_remote_code=args.trust_remote_code)
        self.context_length = args.context_length or self.model.config.max_position_embeddings
        generation_config = self._generation_config()
        self.eos_ids = self._collect_eos_ids(generation_config)
        # What the model's generation config recommends, for the OpenAI endpoints (the
        # Engine's own calls keep SamplingParams' defaults, as SGLang's do).
        self.model_sampling_defaults = model_sampling_defaults(generation_config)
        self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size,
                                         self.eos_ids)
        self._rng = np.random.default_rng(args.random_seed)
        self._rng_lock = threading.Lock()  # requests are made on callers' threads
        self._request_ids = itertools.count()
        self.started_at = time.time()
        # rid -> (its call's output stream, its index in the call, whether it streams)
        self._streams: dict[str, tuple[OutputStream, int, bool]] = {}
        # Optional observer of request progress (the HTTP server's Prometheus metrics); called
        # on the engine thread.
        self.output_observer: Callable[[Req, int], None] | None = None
        self._build_runtime()
        if self._loop is None:  # a follower rank, done following
            return
        logger.info("Engine ready: %s on %d x %s (tensor parallel), attention backend %s",
                    self.model.config.architecture, args.tp_size, jax.devices()[0].device_kind,
                    args.attention_backend)

    # ------------------------------------------------------------------ start-up

    def _build_runtime(self) -> None:
        args, config = self.server_args, self.model.config
        buckets = self._buckets()
        draft = load_draft(args, self.model) if args.speculative else None
        tp, dtype = self.model.tp, self.model.dtype
        kv_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)  # the pages' (target and draft)
        params = {id(x): x for x in jax.tree.leaves((self.model.params, draft and draft.params))}
        # Hybrid models: one recurrent-state slot per running request plus the null slot, its
        # bytes taken from the memory budget before any KV page is counted.
        num_state_slots = buckets.max_seqs + 1 if config.is_hybrid else 0
        state_bytes = num_state_slots * sum(state_bytes_per_slot(c, dtype, tp)
                                            for c in (config, draft and draft.cache_config) if c)
        num_pages = kv_pool_pages(
            page_size=args.page_size,
            bytes_per_token=sum(kv_bytes_per_token(c, kv_dtype, tp)
                                for c in (config, draft and draft.cache_config) if c),
            max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static or _default_mem_fraction(),
            param_bytes=bytes_per_device(params.values()),  # shared arrays counted once
            max_useful_tokens=buckets.max_seqs * self.context_length,
            state_bytes=state_bytes,
        )
        self._allocator = PageAllocator(num_pages)
        self._state_slots = StateSlotAllocator(num_state_slots) if num_state_slots else None
        logger.info("KV pool: %d pages of %d tokens in %s; buckets: tokens %s, batch sizes %s",
                    num_pages - 1, args.page_size, kv_dtype.name, buckets.token_paddings,
                    buckets.bs_paddings)
        if num_state_slots:
            logger.info("Recurrent-state pool: %d slots of %.2f MiB per device (%.2f GiB)",
                        num_state_slots - 1, state_bytes / num_state_slots / 2**20,
                        state_bytes / 2**30)
        self._runner = ModelRunner(
            self.model, num_pages=num_pages, page_size=args.page_size, buckets=buckets,
            attention_backend=args.attention_backend, num_request_slots=buckets.max_seqs,
            num_state_slots=num_state_slots, kv_dtype=kv_dtype,
        )
        self._spec = make_spec_runner(args, self._runner, draft) if args.speculative else None
        # Kept apart from the runners, which shutdown() lets go of.
        self._lookahead = self._spec.lookahead if self._spec else 0
        self.speculative = self._spec is not None
        if not args.skip_server_warmup:  # every rank compiles the same buckets
            self._warmup()
        self._sender: StepSender | None = None
        if args.node_rank > 0:
            self._follow_rank0()
            return
        runner, spec = self._mirror_to_followers()
        radix = None
        if config.is_hybrid and not args.disable_radix_cache:
            logger.info("Radix prefix cache off: %s keeps a recurrent state per request in its "
                        "linear-attention layers, which cannot be rebuilt from cached KV pages",
                        config.architecture)
        elif not args.disable_radix_cache:
            radix = RadixCache(self._allocator, args.page_size)
        cache = CacheManager(self._allocator, radix, args.page_size,
                             last_slot_needs_next_token=bool(
                                 self._spec and self._spec.drafter.pairs_next_token),
                             states=self._state_slots)
        limits = PrefillLimits(
            max_prefill_tokens=min(args.max_prefill_tokens, buckets.max_tokens),
            chunk_size=min(args.chunk_size, buckets.max_tokens),
            max_running_requests=buckets.max_seqs,
            completion_lookahead=self._lookahead,
            prompt_ends_in_prefill=self._spec is not None,
        )
        slot_table = SlotTable(buckets.max_seqs, buckets.pages_per_seq, config.vocab_size)
        decoding = PlainDecoding(runner, slot_table) if spec is None else SpecDecoder(
            spec, runner, slot_table, adaptive=args.speculative.adaptive,
            proposer=make_proposer(args, self._spec))
        scheduler = Scheduler(runner, cache, limits, slot_table, decoding,
                              on_output=self._deliver,
                              decode_log_interval=args.decode_log_interval,
                              overlap=not args.disable_overlap_schedule)
        self._loop: EngineLoop | None = EngineLoop(scheduler, self._on_crash)

    def _warmup(self, platform: str | None = None) -> None:
        """Compile the step programs before serving. XLA:CPU maps every compiled kernel into
        the process apart, a few hundred mappings a program, and a process may have 65530:
        there a speculative server warms only its smallest batch bucket and leaves the
        programs few batches need to their first use (each larger bucket is compiled and
        timed when a batch first needs it). Elsewhere every program is compiled now.
        `platform`: whose warm-up to run (default: JAX's backend; the lowering checks ask
        for an accelerator's on this host)."""
        if self._spec is None:
            self._runner.warmup()
        elif (platform or jax.default_backend()) == "cpu":
            self._spec.warmup(self._runner.buckets.bs_paddings[:1], rare_programs=False)
        else:
            self._spec.warmup()

    def _mirror_to_followers(self) -> tuple[ModelRunner, SpecRunner | None]:
        """With several nodes, rank 0's scheduler calls go to every rank (see multihost)."""
        args = self.server_args
        if args.nnodes == 1:
            return self._runner, self._spec
        self._sender = StepSender(channel_address(args.dist_init_addr), args.nnodes - 1)
        runner = Mirrored(self._runner, "runner", _RUNNER_STEPS, self._sender)
        spec = self._spec and Mirrored(self._spec, "spec", _SPEC_STEPS, self._sender)
        return runner, spec

    def _follow_rank0(self) -> None:
        """Ranks > 0 take no requests: they replay rank 0's steps until it shuts down."""
        args = self.server_args
        logger.info("Rank %d of %d: following rank 0 at %s", args.node_rank, args.nnodes,
                    args.dist_init_addr)
        receiver = StepReceiver(channel_address(args.dist_init_addr))
        try:
            steps = follow(receiver, {"runner": self._runner, "spec": self._spec})
        finally:
            receiver.close()
        logger.info("Rank %d: rank 0 stopped after %d steps", args.node_rank, steps)
        shutdown_distributed()
        self._loop = None
        self._release_device_state()

    def _buckets(self) -> Buckets:
        args = self.server_args
        tokens = args.precompile_token_paddings or default_token_paddings(args.max_prefill_tokens)
        seqs = args.precompile_bs_paddings or powers_of_two(1, args.max_running_requests)
        seqs = tuple(s for s in seqs if s <= args.max_running_requests) or seqs[:1]
        return Buckets(tokens, seqs, self.context_length, args.page_size)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: InputIds = None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """One prompt gives a dict (a list of n dicts when n > 1), a batch gives a list.
        With stream=True it yields chunks with the new text and ids of one output each,
        tagged with the output's `index` (prompt-major, as in the list)."""
        reqs, single = self._make_requests(prompt, sampling_params, input_ids, return_logprob,
                                           top_logprobs_num)
        output_stream = self._register(reqs, loop=None, stream=stream)
        self._require_loop().call(_add_all(reqs))
        if stream:
            return self._stream_chunks(reqs, output_stream)
        finished = 0
        while finished < len(reqs):
            finished += output_stream.get()["finished"]
        return self._final_outputs(reqs, single)

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: InputIds = None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """As generate, awaited; with stream=True the result is an async iterator of chunks.
        Tokenizing and compiling grammars run on a worker thread, off the event loop."""
        reqs, single = await asyncio.to_thread(self._make_requests, prompt, sampling_params,
                                               input_ids, return_logprob, top_logprobs_num)
        output_stream = self._register(reqs, loop=asyncio.get_running_loop(), stream=stream)
        await asyncio.wrap_future(self._require_loop().submit(_add_all(reqs)))
        if stream:
            return self._astream_chunks(reqs, output_stream)
        finished = 0
        while finished < len(reqs):
            finished += (await output_stream.aget())["finished"]
        return self._final_outputs(reqs, single)

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + generated tokens one request can have: the context length, or the
        KV pool if that is smaller."""
        pool = self._allocator.capacity * self.server_args.page_size - self._lookahead
        return min(self.context_length, pool)

    def abort(self, rid: str) -> None:
        self._require_loop().submit(lambda scheduler: scheduler.abort(rid))

    def flush_cache(self) -> bool:
        """Drop every cached prefix (and the recent responses NGRAM drafts from); refused
        (False) while requests are running."""
        def flush(scheduler: Scheduler) -> bool:
            scheduler.settle_if_idle()
            if scheduler.has_work:
                return False
            scheduler.cache.flush()
            scheduler.decoding.flush()
            return True
        return self._require_loop().call(flush)

    def get_server_info(self) -> dict[str, Any]:
        def info(scheduler: Scheduler) -> dict[str, Any]:
            cache = scheduler.cache
            return {
                **self.server_args.to_dict(),
                "dtype": np.dtype(self.model.dtype).name,  # what `auto` resolved to
                # int8 / fp8 (quantized here, or an FP8 checkpoint's), else the dtype's name
                "weights_format": self.model.weights.name or np.dtype(self.model.dtype).name,
                "context_length": self.context_length,
                "max_total_num_tokens": cache.allocator.capacity * self.server_args.page_size,
                "num_running_reqs": len(scheduler.running),
                "num_queued_reqs": len(scheduler.prefill.waiting),
                "token_usage": cache.used_pages / cache.allocator.capacity,
                "kv_pages_in_use": cache.used_pages,
                "kv_pages_cached": cache.radix.evictable_pages if cache.radix else 0,
                "kv_pages_total": cache.allocator.capacity,
                "kv_pages_dtype": scheduler.runner.kv_dtype.name,  # what kv_cache_dtype means
                **_state_slot_info(cache.states),
                "cache_hit_rate": cache.cache_hit_tokens / max(cache.cache_query_tokens, 1),
                "num_retractions": scheduler.decode.num_retractions,
                "num_compilations": scheduler.runner.num_compilations,
                **scheduler.decoding.server_info(),
                "version": __import__("sgl_jax").__version__,
            }
        return self._require_loop().call(info)

    def shutdown(self) -> None:
        """Abort what is still running, stop the engine thread, release the device memory."""
        if self._loop is None:
            return
        self._loop.call(lambda scheduler: [scheduler.abort(rid, "engine shut down")
                                           for rid in list(self._streams)])
        self._loop.stop()
        self._loop = None
        if self._sender is not None:
            self._sender.close()
            shutdown_distributed()
        self._release_device_state()

    def _release_device_state(self) -> None:
        """Let go of the runners: the KV cache, the parameters' last users and every compiled
        program. XLA:CPU maps each compiled kernel's code into the process apart (about three
        memory mappings a kernel, a few hundred a program), and the kernel allows a process
        65530 mappings: an Engine kept after shutdown must not keep its programs, or a second
        Engine built in the same process would crash while it compiles. The runners sit in
        reference cycles (their jitted functions close over them): collect them now rather
        than at some later cyclic collection."""
        self._runner = self._spec = None
        gc.collect()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ requests

    def _make_requests(self, prompt, sampling_params, input_ids, return_logprob,
                       top_logprobs_num) -> tuple[list[Req], bool]:
        self._require_loop()
        token_batch, single = self._token_batch(prompt, input_ids)
        params = self._params_batch(sampling_params, len(token_batch))
        if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {top_logprobs_num}")
        reqs = []
        for ids, p in zip(token_batch, params, strict=True):
            self._check_request(ids, p)
            if p.seed is not None:
                base_seed = p.seed
            else:
                with self._rng_lock:
                    base_seed = int(self._rng.integers(2**32))
            for i in range(p.n):
                seed = (base_seed + i * _SEED_STRIDE) % 2**32
                req = self._new_req(ids, p, seed, return_logprob, top_logprobs_num)
                req.grammar = p.grammar and self._grammars.constraint(*p.grammar)
                reqs.append(req)
        return reqs, single

    def _new_req(self, ids, params, seed, return_logprob, top_logprobs_num) -> Req:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_ids=ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop_strings=params.stop, include_stop_string=params.no_stop_trim,
        )
        return Req(
            rid=str(next(self._request_ids)), prompt_ids=list(ids), params=params, seed=seed,
            eos_ids=self.eos_ids, context_len=self.context_length, detokenizer=detokenizer,
            return_logprob=return_logprob or top_logprobs_num > 0,
            top_logprobs_num=top_logprobs_num,
        )

    def _token_batch(self, prompt: Prompt, input_ids: InputIds) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            return [self.tokenizer(t).input_ids for t in texts], single
        single = bool(input_ids) and all(isinstance(t, (int, np.integer)) for t in input_ids)
        return ([list(input_ids)] if single else [list(ids) for ids in input_ids]), single

    def _params_batch(self, sampling_params: Params, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {n} prompts; pass one "
                    "dict for all or one per prompt"
                )
            return [SamplingParams.from_dict(p) for p in sampling_params]
        return [SamplingParams.from_dict(sampling_params)] * n

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        bad += [t for t in params.stop_token_ids if t >= vocab]
        bad += [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if self.speculative and params.uses_penalties:
            raise ValueError("frequency_penalty, presence_penalty and repetition_penalty are "
                             "not supported with speculative decoding; leave them at their "
                             "defaults or start the server without --speculative-algorithm")
        total = len(ids) + params.max_new_tokens
        if total > self.context_length:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                f"{total} exceeds the context length ({self.context_length})"
            )
        pool = self._allocator.capacity * self.server_args.page_size - self._lookahead
        if total > pool:
            raise ValueError(f"prompt + max_new_tokens = {total} tokens exceeds the KV pool "
                             f"({pool} tokens); raise max_total_tokens or mem_fraction_static")
        stop_ids = (frozenset() if params.ignore_eos else self.eos_ids) | set(params.stop_token_ids)
        if params.min_new_tokens and len(stop_ids) > MAX_SUPPRESSED_IDS:
            raise ValueError(f"min_new_tokens supports at most {MAX_SUPPRESSED_IDS} EOS + stop "
                             f"token ids, got {len(stop_ids)}")

    def _register(self, reqs: list[Req], loop: asyncio.AbstractEventLoop | None,
                  stream: bool) -> OutputStream:
        """One output stream for the requests of a call, in place before the engine thread
        sees them; chunks carry the request's index in the call. A call that does not stream
        gets one chunk per request, when it finishes."""
        output_stream = OutputStream(loop)
        for index, req in enumerate(reqs):
            self._streams[req.rid] = (output_stream, index, stream)
        return output_stream

    # ------------------------------------------------------------------ outputs

    def _deliver(self, req: Req, text: str, token_ids: list[int]) -> None:
        """Engine thread: route a request's new output to whoever waits for it."""
        if self.output_observer is not None:
            self.output_observer(req, len(token_ids))
        target = self._streams.get(req.rid)
        if target is None:
            return
        output_stream, index, streaming = target
        if not (streaming or req.finished):
            return
        if req.finished:
            del self._streams[req.rid]
        chunk = {"index": index, "text": text, "output_ids": token_ids,
                 "finished": req.finished}
        if req.return_logprob:  # sliced here: the engine thread keeps appending to req
            new = len(token_ids)
            chunk["output_token_logprobs"] = list(zip(req.output_logprobs[-new:] if new else [],
                                                      token_ids, strict=True))
            chunk["output_top_logprobs"] = _top_pairs(req.output_top_logprobs[-new:]
                                                      if new else [])
        output_stream.put(chunk)

    def _stream_chunks(self, reqs: list[Req], output_stream: OutputStream
                       ) -> Iterator[dict[str, Any]]:
        unfinished = len(reqs)
        try:
            while unfinished:
                chunk = output_stream.get()
                unfinished -= chunk["finished"]
                yield self._chunk_output(reqs[chunk["index"]], chunk)
        finally:
            self._abort_unfinished(reqs)  # the consumer stopped early: free the KV pages

    async def _astream_chunks(self, reqs: list[Req], output_stream: OutputStream
                              ) -> AsyncIterator[dict[str, Any]]:
        unfinished = len(reqs)
        try:
            while unfinished:
                chunk = await output_stream.aget()
                unfinished -= chunk["finished"]
                yield self._chunk_output(reqs[chunk["index"]], chunk)
        finally:
            self._abort_unfinished(reqs)

    def _abort_unfinished(self, reqs: list[Req]) -> None:
        for req in reqs:
            if req.rid in self._streams and self._loop is not None:
                self.abort(req.rid)

    def _chunk_output(self, req: Req, chunk: dict[str, Any]) -> dict[str, Any]:
        meta = self._meta_info(req) if chunk["finished"] else {"id": req.rid}
        if req.return_logprob:
            meta["output_token_logprobs"] = chunk["output_token_logprobs"]
            meta["output_top_logprobs"] = chunk["output_top_logprobs"]
        return {"index": chunk["index"], "text": chunk["text"],
                "output_ids": chunk["output_ids"], "meta_info": meta}

    def _final_outputs(self, reqs: list[Req], single: bool
                       ) -> dict[str, Any] | list[dict[str, Any]]:
        outputs = [{"text": req.detokenizer.text, "output_ids": list(req.output_ids),
                    "meta_info": self._meta_info(req)} for req in reqs]
        return outputs[0] if single and len(outputs) == 1 else outputs

    def _meta_info(self, req: Req) -> dict[str, Any]:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finish_reason,
            "e2e_latency": (req.finished_at or req.created_at) - req.created_at,
        }
        if req.spec_stats is not None:
            meta["spec_verify_ct"] = req.spec_stats.rounds
            meta["spec_accept_length"] = req.spec_stats.accept_length
            meta["spec_accepted_per_position"] = list(req.spec_stats.accepted_per_position)
        if req.return_logprob:
            meta["output_token_logprobs"] = list(zip(req.output_logprobs, req.output_ids,
                                                     strict=True))
            meta["output_top_logprobs"] = _top_pairs(req.output_top_logprobs)
        return meta

    # ------------------------------------------------------------------ misc

    def _require_loop(self) -> EngineLoop:
        if self._loop is None and self.server_args.node_rank > 0:
            raise RuntimeError(f"this engine is rank {self.server_args.node_rank} of "
                               f"{self.server_args.nnodes}: it only replays rank 0's steps, "
                               "and rank 0 has stopped; send requests to rank 0")
        if self._loop is None:
            raise RuntimeError("the engine has been shut down")
        return self._loop

    def _on_crash(self, exc: BaseException) -> None:
        """Engine thread: a step raised; fail every request instead of hanging its caller."""
        scheduler = self._loop.scheduler
        for req in list(scheduler.running) + list(scheduler.prefill.waiting):
            scheduler.abort(req.rid, f"internal error: {exc!r}")

    def _generation_config(self) -> dict[str, Any]:
        path = Path(self.model.model_dir) / "generation_config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def _collect_eos_ids(self, generation_config: dict[str, Any]) -> frozenset[int]:
        """EOS ids from config.json, generation_config.json and the tokenizer, together."""
        ids = set(self.model.config.eos_token_ids)
        eos = generation_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)


def _top_pairs(tops: list[list[tuple[int, float]]]) -> list[list[tuple[float, int]]]:
    """(token, logprob) pairs as the (logprob, token) pairs of the output format."""
    return [[(lp, t) for t, lp in top] for top in tops]


def _add_all(reqs: list[Req]) -> Callable[[Scheduler], None]:
    def add_all(scheduler: Scheduler) -> None:
        for req in reqs:
            scheduler.add_request(req)
    return add_all


# What the scheduler calls on the device, and so what followers replay.
_RUNNER_STEPS = ("step", "launch", "reset_penalty_slot")
_SPEC_STEPS = ("prefill", "round", "catch_up", "draft_trees", "masked_verify", "time_bucket")

def _check_available(args: ServerArgs) -> None:
    """Refuse, before anything loads, settings whose feature this version does not have."""
    if args.device is not None:
        _check_device(args.device)


def _state_slot_info(states: StateSlotAllocator | None) -> dict[str, Any]:
    if states is None:
        return {}
    return {"state_slots_in_use": states.capacity - states.num_free,
            "state_slots_total": states.capacity}


def _check_device(device: str) -> None:
    platform = "gpu" if device == "cuda" else device
    if jax.default_backend() != platform:
        raise ValueError(f"--device {device} was asked for, but JAX runs on "
                         f"{jax.default_backend()} ({jax.devices()[0].device_kind}); install "
                         f"JAX for {device} or pass --device {jax.default_backend()}")


def _default_mem_fraction() -> float:
    # On a CPU the "device memory" is the host's RAM, shared with everything else.
    return 0.1 if jax.default_backend() == "cpu" else 0.8
