"""Where a request's outputs go: the registry of output streams, the chunks a caller reads
(streamed or whole) and the meta_info they carry.

`deliver` runs on the engine thread (the scheduler's output callback); everything else on the
caller's thread or event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from sgl_jax.entrypoints.output_stream import OutputStream
from sgl_jax.scheduler.req import Req


class OutputRouter:
    def __init__(self, abort: Callable[[str], None]):
        self._abort = abort  # stops a request the caller walked away from
        # rid -> (its call's output stream, its index in the call, whether it streams)
        self._streams: dict[str, tuple[OutputStream, int, bool]] = {}
        # Optional observer of request progress (the HTTP server's Prometheus metrics),
        # called on the engine thread with each request and its count of new tokens.
        self.observer: Callable[[Req, int], None] | None = None

    def register(self, reqs: list[Req], loop: asyncio.AbstractEventLoop | None,
                 stream: bool) -> OutputStream:
        """One output stream for the requests of a call, in place before the engine thread
        sees them; chunks carry the request's index in the call. A call that does not stream
        gets one chunk per request, when it finishes."""
        output_stream = OutputStream(loop)
        for index, req in enumerate(reqs):
            self._streams[req.rid] = (output_stream, index, stream)
        return output_stream

    def deliver(self, req: Req, text: str, token_ids: list[int]) -> None:
        """Engine thread: route a request's new output to whoever waits for it."""
        if self.observer is not None:
            self.observer(req, len(token_ids))
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
            chunk["output_top_logprobs"] = top_pairs(req.output_top_logprobs[-new:]
                                                     if new else [])
        output_stream.put(chunk)

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
            if req.rid in self._streams:
                self._abort(req.rid)


def chunk_output(req: Req, chunk: dict[str, Any]) -> dict[str, Any]:
    meta = meta_info(req) if chunk["finished"] else {"id": req.rid}
    if req.return_logprob:
        meta["output_token_logprobs"] = chunk["output_token_logprobs"]
        meta["output_top_logprobs"] = chunk["output_top_logprobs"]
    return {"index": chunk["index"], "text": chunk["text"],
            "output_ids": chunk["output_ids"], "meta_info": meta}


def final_outputs(reqs: list[Req], single: bool) -> dict[str, Any] | list[dict[str, Any]]:
    outputs = [{"text": req.detokenizer.text, "output_ids": list(req.output_ids),
                "meta_info": meta_info(req)} for req in reqs]
    return outputs[0] if single and len(outputs) == 1 else outputs


def meta_info(req: Req) -> dict[str, Any]:
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish_reason,
        "e2e_latency": (req.finished_at or req.created_at) - req.created_at,
        **req.decoding_info,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = list(zip(req.output_logprobs, req.output_ids,
                                                 strict=True))
        meta["output_top_logprobs"] = top_pairs(req.output_top_logprobs)
    return meta


def top_pairs(tops: list[list[tuple[int, float]]]) -> list[list[tuple[float, int]]]:
    """(token, logprob) pairs as the (logprob, token) pairs of the output format."""
    return [[(lp, t) for t, lp in top] for top in tops]
