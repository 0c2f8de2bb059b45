"""Split a reasoning model's `<think>...</think>` block from its answer, whole or streamed.

Styles (`--reasoning-parser`):
- `qwen3`: the output may open with `<think>`; everything up to `</think>` is reasoning. An
  output that does not open with the tag (thinking disabled) is all answer.
- `deepseek-r1`: the prompt already opened the block, so the output is reasoning from its first
  token until `</think>` (a leading `<think>` is tolerated).
A block that never closes (the generation stopped inside it) is all reasoning.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """Feed text deltas in order; each call returns the (reasoning, content) text that is now
    certain. Text that might be the start of a tag is held back until it is decided."""

    def __init__(self, style: str):
        if style not in ("qwen3", "deepseek-r1"):
            raise ValueError(f"unknown reasoning parser {style!r}")
        self._forced = style == "deepseek-r1"
        self._mode = "opening"  # opening -> reasoning -> content
        self._held = ""
        self._strip_answer_start = False

    def feed(self, delta: str) -> tuple[str, str]:
        self._held += delta
        if self._mode == "opening":
            self._open()
        if self._mode == "reasoning":
            return self._reason()
        if self._mode == "content":
            return "", self._answer()
        return "", ""

    @property
    def reasoning_ended(self) -> bool:
        """The output is past its reasoning (the block closed, or there was none)."""
        return self._mode == "content"

    def finish(self) -> tuple[str, str]:
        """Release whatever is held back at the end of the output."""
        held, self._held = self._held, ""
        if self._mode == "reasoning" or (self._mode == "opening" and self._forced):
            return held, ""
        return "", held

    def parse(self, text: str) -> tuple[str, str]:
        """Split a whole output: (reasoning, content)."""
        reasoning, content = self.feed(text)
        rest_reasoning, rest_content = self.finish()
        return reasoning + rest_reasoning, content + rest_content

    # ------------------------------------------------------------------ states

    def _open(self) -> None:
        head = self._held.lstrip()
        if head.startswith(THINK_START):
            self._held = head[len(THINK_START):]
            self._mode = "reasoning"
        elif THINK_START.startswith(head):
            return  # blank, or a prefix of the tag: wait for more
        else:
            self._mode = "reasoning" if self._forced else "content"

    def _reason(self) -> tuple[str, str]:
        end = self._held.find(THINK_END)
        if end < 0:
            keep = _partial_tag_suffix(self._held, THINK_END)
            reasoning = self._held[: len(self._held) - keep]
            self._held = self._held[len(reasoning):]
            return reasoning, ""
        reasoning, self._held = self._held[:end], self._held[end + len(THINK_END):]
        self._mode = "content"
        self._strip_answer_start = True
        return reasoning, self._answer()

    def _answer(self) -> str:
        if self._strip_answer_start:
            self._held = self._held.lstrip()
            if not self._held:
                return ""  # the answer has not begun yet: keep stripping
            self._strip_answer_start = False
        content, self._held = self._held, ""
        return content


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
