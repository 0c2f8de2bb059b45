"""Hand a request's output chunks from the engine thread to a waiting thread or event loop."""

from __future__ import annotations

import asyncio
import queue
from typing import Any


class OutputStream:
    """Chunks of one request: `put` runs on the engine thread; `get` blocks a caller thread,
    `aget` awaits in the event loop the stream was created in."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop
        self._sync: queue.Queue = queue.Queue()
        self._async: asyncio.Queue | None = asyncio.Queue() if loop is not None else None

    def put(self, chunk: dict[str, Any]) -> None:
        if self._async is not None:
            self._loop.call_soon_threadsafe(self._async.put_nowait, chunk)
        else:
            self._sync.put(chunk)

    def get(self) -> dict[str, Any]:
        return self._sync.get()

    async def aget(self) -> dict[str, Any]:
        return await self._async.get()
