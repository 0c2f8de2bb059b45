"""The offline Python API: `sgl_jax.Engine(model_path=..., **server_args)`.

A facade over two parts: the runtime (sgl_jax/runtime/), which builds and owns what runs and
drives the scheduler on its own thread, and the front door (front_door.py), which turns
prompts into scheduler requests; outputs come back through outputs.py. `generate` (blocking
or streaming) and `async_generate` (awaitable or async-iterable) may be called from any
thread or event loop, so an HTTP server and offline callers can share one engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import jax

from sgl_jax.demo import with_demo_defaults
from sgl_jax.entrypoints.front_door import FrontDoor, InputIds, Params, Prompt, RequestLimits
from sgl_jax.entrypoints.outputs import OutputRouter
from sgl_jax.runtime.runtime import Runtime
from sgl_jax.runtime.usage import RuntimeUsage
from sgl_jax.server_args import ServerArgs

logger = logging.getLogger(__name__)
# How often drain() looks whether the running requests have finished.
DRAIN_POLL_S = 0.05

Output = dict[str, Any] | list[dict[str, Any]]


class Engine:
    """Loads a model once and serves generation requests from any thread or event loop."""

    def __init__(self, model_path: str | None = None, *, defer_background_builds: bool = False,
                 **server_args: Any):
        """`model_path` (or `model`, as SGLang's examples spell it): a local directory, a
        Hugging Face id or a .gguf file; None serves the built-in demo model. The larger
        buckets build in the background from the end of the constructor, or, with
        `defer_background_builds`, from start_background_builds() (the HTTP server calls it
        once its app is built: tracing holds the GIL against the rest of its start)."""
        if "model" in server_args:
            if model_path is not None:
                raise TypeError("give the model as model_path or as model, not both")
            model_path = server_args.pop("model")
        args = ServerArgs(**with_demo_defaults(model_path, server_args))
        if args.dp_size > 1:
            raise ValueError(f"dp_size {args.dp_size}: an Engine is one replica; "
                             "`python -m sgl_jax.launch_server --dp-size N` starts N behind a "
                             "router")
        self.outputs = OutputRouter(abort=self._abort_if_running, end=self._end_if_running)
        self.runtime = Runtime(args, on_output=self.outputs.deliver)
        self.server_args = args = self.runtime.args
        self.model = self.runtime.model
        self.context_length = self.runtime.context_length
        self.speculative = args.speculative is not None
        if not self.runtime.running:  # a follower rank, done following
            return
        self.front_door = FrontDoor(args, self.model.config, self.model.model_dir, RequestLimits(
            self.context_length, self.runtime.max_request_tokens, self.speculative))
        self.tokenizer = self.front_door.tokenizer
        self.model_sampling_defaults = self.front_door.model_sampling_defaults
        self.started_at = time.time()
        logger.info("Engine ready: %s on %d x %s (tensor parallel), attention backend %s",
                    self.model.config.architecture, args.tp_size, jax.devices()[0].device_kind,
                    args.attention_backend)
        if not defer_background_builds:
            self.start_background_builds()

    def start_background_builds(self) -> None:
        """Let the background builder start on the buckets not built yet."""
        self.runtime.start_background_builds()

    def generate(self, prompt: Prompt = None, sampling_params: Params = None,
                 input_ids: InputIds = None, stream: bool = False, return_logprob: bool = False,
                 top_logprobs_num: int = 0) -> Output | Iterator[dict[str, Any]]:
        """One prompt gives a dict (a list of n dicts when n > 1), a batch gives a list.
        With stream=True it yields chunks with the new text and ids of one output each,
        tagged with the output's `index` (prompt-major, as in the list)."""
        reqs, single = self._make_requests(prompt, sampling_params, input_ids, return_logprob,
                                           top_logprobs_num)
        output_stream = self.outputs.register(reqs, loop=None, stream=stream)
        self.runtime.add_requests(reqs).result()
        if stream:
            return self.outputs.stream(reqs, output_stream)
        return self.outputs.wait(reqs, output_stream, single)

    async def async_generate(self, prompt: Prompt = None, sampling_params: Params = None,
                             input_ids: InputIds = None, stream: bool = False,
                             return_logprob: bool = False, top_logprobs_num: int = 0
                             ) -> Output | AsyncIterator[dict[str, Any]]:
        """As generate, awaited; with stream=True the result is an async iterator of chunks.
        Tokenizing and compiling grammars run on a worker thread, off the event loop."""
        reqs, single = await asyncio.to_thread(self._make_requests, prompt, sampling_params,
                                               input_ids, return_logprob, top_logprobs_num)
        output_stream = self.outputs.register(reqs, loop=asyncio.get_running_loop(),
                                              stream=stream)
        await asyncio.wrap_future(self.runtime.add_requests(reqs))
        if stream:
            return self.outputs.astream(reqs, output_stream)
        return await self.outputs.await_all(reqs, output_stream, single)

    def _make_requests(self, *args: Any) -> tuple[list, bool]:
        self.runtime.ensure_admitting()  # a stopping engine refuses before tokenizing
        return self.front_door.make_requests(*args)

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + generated tokens one request can have: the context length, or the
        KV pool if that is smaller."""
        return self.runtime.max_request_tokens

    def abort(self, rid: str) -> None:
        self.runtime.abort(rid)

    def flush_cache(self) -> bool:
        """Drop every cached prefix (and the recent responses NGRAM drafts from); refused
        (False) while requests are running."""
        return self.runtime.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.runtime.server_info()

    def usage(self) -> RuntimeUsage:
        """Pages, state slots and requests in use now."""
        return self.runtime.usage()

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait until the background builder has built every program it was given (the larger
        batch buckets and round shapes), so timings that follow have no compile beside them.
        False if `timeout` s passed first; True at once where nothing builds in the background."""
        builder = self.runtime.builder
        return builder is None or builder.wait_idle(timeout)

    def drain(self, timeout_s: float) -> int:
        """Stop taking requests (new ones raise RuntimeError), give the running ones up to
        `timeout_s` to finish, then abort the rest: their callers get an abort ("the server is
        shutting down"; an HTTP stream, an error event). Returns how many were aborted."""
        self.runtime.stop_admitting("the server is shutting down: it takes no new requests")
        deadline = time.monotonic() + timeout_s
        while self.outputs.pending and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        left = self.outputs.pending
        if left and self.runtime.running:
            self.runtime.abort_all("the server is shutting down")
        return left

    def shutdown(self, abandon_builds: bool = False) -> None:
        """Abort what is still running, stop the engine thread, release the device memory;
        every caller gets its last chunk. A program compiling in the background is waited for
        (up to a minute) unless `abandon_builds` (a process about to exit)."""
        self.runtime.shutdown(abandon_builds)
        self.outputs.close()

    def _abort_if_running(self, rid: str) -> None:
        if self.runtime.running:
            self.runtime.abort(rid)

    def _end_if_running(self, rid: str, reason: dict[str, Any]) -> None:
        if self.runtime.running:
            self.runtime.end(rid, reason)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
