"""Conversations -> EAGLE3 training examples: token ids and a loss mask on assistant tokens.

Records are ShareGPT (`{"conversations": [{"from", "value"}]}`) or OpenAI
(`{"messages": [{"role", "content"}]}`). Each conversation is rendered with the target
tokenizer's own chat template; assistant spans are found by rendering prefixes, so no
per-model patterns are needed.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sgl_jax.datasets import iter_sharegpt

# Role spellings seen in ShareGPT dumps and OpenAI records -> chat-template roles.
ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
}

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}


@dataclass(frozen=True)
class Example:
    input_ids: np.ndarray  # i32[T]
    loss_mask: np.ndarray  # bool[T]: True on assistant tokens (content and end-of-turn)


class SkippedRecord(ValueError):
    """A record that cannot become a training conversation; its message is the reason."""


class ChatTemplateError(ValueError):
    """The chat template does not render conversations as a sequence of prefixes."""


# --------------------------------------------------------------------------- records


def read_records(path: str | os.PathLike | None = None) -> Iterator[dict]:
    """Records of a JSON-list or JSONL file, streamed; None reads the installed ShareGPT."""
    if path is None or _starts_with_bracket(Path(path)):
        yield from iter_sharegpt(path)  # streams any JSON array, tolerating a cut-off tail
        return
    with open(path, encoding="utf-8") as f:
        yield from (json.loads(line) for line in f if line.strip())


def _starts_with_bracket(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        return f.read(4096).lstrip().startswith("[")


def record_messages(record: dict) -> list[Message]:
    """A ShareGPT or OpenAI record as chat messages; SkippedRecord says why it is unusable.

    Assistant turns before the first user turn are dropped (ShareGPT has conversations that
    open with a reply): nothing prompted them.
    """
    if "conversations" in record:
        turns = [(t.get("from"), t.get("value")) for t in record["conversations"]]
    elif "messages" in record:
        turns = [(t.get("role"), t.get("content")) for t in record["messages"]]
    else:
        raise SkippedRecord("neither 'conversations' nor 'messages'")
    messages = [_message(role, content) for role, content in turns]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    messages = [m for i, m in enumerate(messages) if i >= first_user or m["role"] == "system"]
    if not any(m["role"] == "assistant" for m in messages):
        raise SkippedRecord("no assistant turn after a user turn")
    return messages


def _message(role: object, content: object) -> Message:
    if role not in ROLES:
        raise SkippedRecord(f"unknown role {role!r}")
    if not isinstance(content, str):
        raise SkippedRecord(f"non-text content in a {role!r} turn")
    return {"role": ROLES[role], "content": content}


def iter_conversations(records: Iterable[dict], skipped: Counter[str]) -> Iterator[list[Message]]:
    """The usable conversations of `records`; each skipped record adds 1 to skipped[reason]."""
    for record in records:
        try:
            yield record_messages(record)
        except SkippedRecord as e:
            skipped[str(e)] += 1


# --------------------------------------------------------------------------- loss masks


def assistant_spans(tokenizer, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and each assistant turn's [start, end) character span.

    A span runs from the end of the generation prompt (the assistant header) to the end of
    the turn's render, trailing whitespace excluded: it covers the content and the
    end-of-turn token, which is what the model must learn to emit.
    """
    text = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _prefix_length(text, _render(tokenizer, messages[:i], add_generation_prompt=True))
        end = _prefix_length(text, _render(tokenizer, messages[: i + 1],
                                           add_generation_prompt=False).rstrip())
        if end < start:
            raise ChatTemplateError(
                "chat template: the assistant turn renders shorter than its generation prompt")
        spans.append((start, end))
    return text, spans


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _prefix_length(text: str, prefix: str) -> int:
    if not text.startswith(prefix):
        raise ChatTemplateError(
            "chat template renders a conversation prefix that is not a prefix of the whole "
            "conversation (e.g. it rewrites earlier turns, as templates that drop past "
            f"reasoning do), so assistant tokens cannot be located: {prefix[-80:]!r} "
            f"does not start {text[:len(prefix)][-80:]!r}")
    return len(prefix)


def build_example(tokenizer, messages: list[Message], max_length: int) -> Example:
    """Token ids of the templated conversation (at most max_length) and its loss mask.

    A token is in the loss when its first character lies inside an assistant span. The
    template renders special tokens itself, so the tokenizer adds none.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("loss masks need character offsets: load a fast tokenizer")
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoding["input_ids"], np.int32)[:max_length]  # i32[T]
    offsets = np.asarray(encoding["offset_mapping"], np.int64).reshape(-1, 2)[:max_length]
    starts, ends = offsets[:, 0], offsets[:, 1]  # i64[T] character offsets
    mask = np.zeros(len(ids), bool)  # bool[T]
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi) & (ends > starts)
    return Example(ids, mask)


def build_examples(tokenizer, records: Iterable[dict], max_length: int,
                   skipped: Counter[str]) -> Iterator[Example]:
    """Examples of the usable records; records with no assistant token left are skipped too."""
    for messages in iter_conversations(records, skipped):
        example = build_example(tokenizer, messages, max_length)
        if example.loss_mask.any():
            yield example
        else:
            skipped[f"no assistant token within max_length={max_length}"] += 1
