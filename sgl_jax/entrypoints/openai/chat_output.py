"""One chat choice's output in OpenAI's shapes: reasoning first (with --reasoning-parser),
then tool calls in the answer (when the request offered tools), as a whole message or as
stream deltas that add up to it."""

from __future__ import annotations

import uuid
from typing import Any

from sgl_jax.tokenizer.reasoning import ReasoningParser
from sgl_jax.tokenizer.tool_calls import ToolCall, ToolCallParser


class ChatOutput:
    """Splits one choice's text; a stream feeds its deltas in order to one instance."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None, *,
                 stream_reasoning: bool = True):
        self._reasoning = reasoning
        self._tools = tools
        self.num_calls = 0
        # stream_reasoning false: deltas hold the reasoning back until it is whole.
        self._stream_reasoning = stream_reasoning
        self._held_reasoning = ""

    def message(self, text: str) -> dict[str, Any]:
        """The whole output as a chat.completion message."""
        reasoning, content, calls = self._split(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self._reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [_call_dict(call) for call in calls]
        return message

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The next piece of output as a chat.completion.chunk delta ({} if nothing is
        certain yet). A call arrives in one piece: index, id, type, name and arguments."""
        first_index = self.num_calls
        reasoning, content, calls = self._split(text, final)
        if self._reasoning is not None and not self._stream_reasoning:
            reasoning = self._whole_reasoning(reasoning, final)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": first_index + i, **_call_dict(call)}
                                   for i, call in enumerate(calls)]
        return delta

    def finish_reason(self, reason: str) -> str:
        """An output that made calls and ended by itself finished to call tools."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    def _whole_reasoning(self, reasoning: str, final: bool) -> str:
        """All the reasoning once its block has closed (or the output ended), else ""."""
        self._held_reasoning += reasoning
        if not (final or self._reasoning.reasoning_ended):
            return ""
        whole, self._held_reasoning = self._held_reasoning, ""
        return whole

    def _split(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning, content, calls = "", text, []
        if self._reasoning is not None:
            reasoning, content = _feed(self._reasoning, text, final)
        if self._tools is not None:
            content, calls = _feed(self._tools, content, final)
            self.num_calls += len(calls)
        return reasoning, content, calls


def _feed(parser: ReasoningParser | ToolCallParser, text: str, final: bool) -> tuple[Any, Any]:
    first, second = parser.feed(text)
    if final:
        rest_first, rest_second = parser.finish()
        first, second = first + rest_first, second + rest_second
    return first, second


def _call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
