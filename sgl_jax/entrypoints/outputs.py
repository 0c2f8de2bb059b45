"""Where a request's outputs go: the registry of output streams, the output thread that turns
the engine's tokens into text and chunks, and what a caller reads (streamed or whole, with its
meta_info).

The engine thread only hands each step's new tokens on (`deliver`, one queue put a step); the
output thread detokenizes them, watches for stop strings, and puts each caller's chunks, so
no text or per-token Python runs on the thread that keeps the device busy (as SGLang's and
vLLM's detokenizers run beside their schedulers). A stop string is found here, a step or two
after its tokens were sampled: the output thread cuts the output where the string ends and
asks the engine to end the request (`end`), which may have sampled a few tokens past it
meanwhile; those are never shown. The request's last chunk goes out when the engine's finish
comes back, so its meta_info holds everything the engine knows of it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sgl_jax.entrypoints.output_stream import OutputStream
from sgl_jax.scheduler.req import Req

logger = logging.getLogger(__name__)

_STOP = object()
# One step's outputs as the engine hands them on: (request, new token ids, finished).
StepOutputs = list[tuple[Req, list[int], bool]]


@dataclass
class _Target:
    """Where a request's chunks go, and how far the output thread has read it."""

    stream: OutputStream  # its call's
    index: int  # its index in the call
    streaming: bool  # a chunk per step (else one when it finishes)
    read: int = 0  # output tokens the output thread has detokenized
    released: int = 0  # of those, the ones a caller sees (up to a stop string)


class OutputRouter:
    def __init__(self, abort: Callable[[str], None],
                 end: Callable[[str, dict[str, Any]], None] | None = None):
        self._abort = abort  # stops a request the caller walked away from
        self._end = end or (lambda rid, reason: None)  # ends a request at a stop string
        self._targets: dict[str, _Target] = {}  # by rid, until its last chunk is put
        # Optional observer of request progress (the HTTP server's Prometheus metrics),
        # called on the output thread with each request, its count of new tokens a caller
        # sees and whether it finished.
        self.observer: Callable[[Req, int, bool], None] | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sgl-jax-outputs", daemon=True)
        self._thread.start()

    def register(self, reqs: list[Req], loop: asyncio.AbstractEventLoop | None,
                 stream: bool) -> OutputStream:
        """One output stream for the requests of a call, in place before the engine thread
        sees them; chunks carry the request's index in the call. A call that does not stream
        gets one chunk per request, when it finishes."""
        output_stream = OutputStream(loop)
        for index, req in enumerate(reqs):
            self._targets[req.rid] = _Target(output_stream, index, stream)
        return output_stream

    @property
    def pending(self) -> int:
        """Requests whose last chunk has not been put yet."""
        return len(self._targets)

    def deliver(self, outputs: StepOutputs) -> None:
        """Engine thread: hand a step's new tokens to the output thread."""
        self._inbox.put(outputs)

    def close(self) -> None:
        """Process what was delivered, then stop the output thread."""
        self._inbox.put(_STOP)
        self._thread.join()

    # ------------------------------------------------------------------ the output thread

    def _run(self) -> None:
        while (outputs := self._inbox.get()) is not _STOP:
            for req, token_ids, finished in outputs:
                try:
                    self._route(req, token_ids, finished)
                except Exception:  # one request's text must not stop everyone's
                    logger.exception("output of request %s failed", req.rid)

    def _route(self, req: Req, token_ids: list[int], finished: bool) -> None:
        """Turn a request's new tokens into text; end it at a stop string; put its chunk
        where its caller waits."""
        target = self._targets.get(req.rid)
        if target is None:
            return
        detokenizer, before = req.detokenizer, target.released
        stopped = detokenizer.stopped
        text = detokenizer.push(token_ids)  # nothing once a stop string matched
        target.read += len(token_ids)
        if detokenizer.stopped and not stopped and not finished:
            self._end(req.rid, stop_reason(req))
        if finished:
            text += detokenizer.flush()
        target.released = released_count(req, target.read)
        new = target.released - before
        if self.observer is not None:
            self.observer(req, new, finished)
        if not (target.streaming or finished):
            return
        if finished:
            del self._targets[req.rid]
        chunk = {"index": target.index, "text": text, "finished": finished,
                 "output_ids": req.output_ids[before: before + new]}
        if req.return_logprob:
            chunk["output_token_logprobs"] = list(zip(
                req.output_logprobs[before: before + new], chunk["output_ids"], strict=True))
            chunk["output_top_logprobs"] = top_pairs(
                req.output_top_logprobs[before: before + new])
        target.stream.put(chunk)

    # ------------------------------------------------------------------ a caller's side

    def wait(self, reqs: list[Req], output_stream: OutputStream, single: bool
             ) -> dict[str, Any] | list[dict[str, Any]]:
        finished = 0
        while finished < len(reqs):
            finished += output_stream.get()["finished"]
        return final_outputs(reqs, single)

    async def await_all(self, reqs: list[Req], output_stream: OutputStream, single: bool
                        ) -> dict[str, Any] | list[dict[str, Any]]:
        finished = 0
        while finished < len(reqs):
            finished += (await output_stream.aget())["finished"]
        return final_outputs(reqs, single)

    def stream(self, reqs: list[Req], output_stream: OutputStream
               ) -> Iterator[dict[str, Any]]:
        unfinished = len(reqs)
        try:
            while unfinished:
                chunk = output_stream.get()
                unfinished -= chunk["finished"]
                yield chunk_output(reqs[chunk["index"]], chunk)
        finally:
            self._abort_unfinished(reqs)  # the consumer stopped early: free the KV pages

    async def astream(self, reqs: list[Req], output_stream: OutputStream
                      ) -> AsyncIterator[dict[str, Any]]:
        unfinished = len(reqs)
        try:
            while unfinished:
                chunk = await output_stream.aget()
                unfinished -= chunk["finished"]
                yield chunk_output(reqs[chunk["index"]], chunk)
        finally:
            self._abort_unfinished(reqs)

    def _abort_unfinished(self, reqs: list[Req]) -> None:
        for req in reqs:
            if req.rid in self._targets:
                self._abort(req.rid)


def released_count(req: Req, read: int | None = None) -> int:
    """Output tokens a caller sees of the first `read` (default: all, once the request
    finished): up to where a stop string ended."""
    read = len(req.output_ids) if read is None else read
    at_stop = req.detokenizer.num_tokens_at_stop
    return read if at_stop is None else min(at_stop, read)


def stop_reason(req: Req) -> dict[str, Any]:
    return {"type": "stop", "matched": req.detokenizer.matched_stop}


def final_finish_reason(req: Req) -> dict[str, Any] | None:
    """The reason a caller sees: a stop string the text reached before any rule the engine
    applied by token (which may have ended the request a few tokens later) wins."""
    if req.detokenizer.stopped:
        return stop_reason(req)
    return req.finish_reason


def chunk_output(req: Req, chunk: dict[str, Any]) -> dict[str, Any]:
    meta = meta_info(req) if chunk["finished"] else {"id": req.rid}
    if req.return_logprob:
        meta["output_token_logprobs"] = chunk["output_token_logprobs"]
        meta["output_top_logprobs"] = chunk["output_top_logprobs"]
    return {"index": chunk["index"], "text": chunk["text"],
            "output_ids": chunk["output_ids"], "meta_info": meta}


def final_outputs(reqs: list[Req], single: bool) -> dict[str, Any] | list[dict[str, Any]]:
    outputs = [{"text": req.detokenizer.text,
                "output_ids": req.output_ids[: released_count(req)],
                "meta_info": meta_info(req)} for req in reqs]
    return outputs[0] if single and len(outputs) == 1 else outputs


def meta_info(req: Req) -> dict[str, Any]:
    """A finished request's meta_info (after its last chunk)."""
    count = released_count(req)
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": count,
        "cached_tokens": req.cached_tokens,
        "finish_reason": final_finish_reason(req),
        "e2e_latency": (req.finished_at or req.created_at) - req.created_at,
        **req.decoding_info,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = list(zip(req.output_logprobs[:count],
                                                 req.output_ids[:count], strict=True))
        meta["output_top_logprobs"] = top_pairs(req.output_top_logprobs[:count])
    return meta


def top_pairs(tops: list[list[tuple[int, float]]]) -> list[list[tuple[float, int]]]:
    """(token, logprob) pairs as the (logprob, token) pairs of the output format."""
    return [[(lp, t) for t, lp in top] for top in tops]
