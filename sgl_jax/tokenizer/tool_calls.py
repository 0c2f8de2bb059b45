"""Tool calls in the text a model writes, in the formats `--tool-call-parser` names.

Each format has a parser (whole text, or streamed deltas), the instructions that teach it to a
model whose chat template knows nothing of tools, the way a past call is written back into a
prompt, and the grammar that forces calls when a request requires them.

- `qwen25` (vLLM's name: `hermes`): zero or more blocks
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; text outside them is content.
- `llama3` (vLLM's name: `llama3_json`): Llama 3.1's JSON tool calling. The output is
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several calls
  separated by `;`. An output that does not start with a call is content.

Both accept `arguments` or `parameters` as the arguments' key. Something shaped like a call
that is not one (malformed JSON, no name, a function the request did not offer, arguments that
are not an object) stays in the content as written, so nothing the model wrote is lost. A
call is returned once it is complete, with its arguments re-serialised by `json.dumps`:
deciding only on whole calls is what lets a malformed one fall back to content when streamed
too, so a stream always adds up to the whole-text result.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sgl_jax.grammar import JSON_STYLE
from sgl_jax.json_bounds import bounded_schema

_ALIASES = {"hermes": "qwen25", "llama3_json": "llama3"}
_ARGUMENT_KEYS = ("arguments", "parameters")
# OpenAI: a function without `parameters` takes no arguments.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object


def _as_call(value: Any, names: frozenset[str]) -> ToolCall | None:
    """The call `value` describes, if it is {"name": <an offered function>, "arguments": {...}}
    (a call without arguments has none)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in _ARGUMENT_KEYS if key in value), {})
    if value["name"] not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_call(text: str, names: frozenset[str]) -> ToolCall | None:
    try:
        return _as_call(json.loads(text), names)
    except (ValueError, RecursionError):
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---------------------------------------------------------------------- parsers


class ToolCallParser:
    """Feed text deltas in order: each call returns the content that is now certain and the
    calls completed by this delta; text that may still turn out to be a call is held back.
    `finish` releases the rest at the end of the output. Calls past `max_calls` are dropped
    (a request with parallel_tool_calls false gets at most one)."""

    def __init__(self, names: Iterable[str], max_calls: int | None = None):
        self._names = frozenset(names)
        self._max_calls = max_calls
        self._found = 0
        self._held = ""

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Split a whole output into (content, calls)."""
        content, calls = self.feed(text)
        rest, more = self.finish()
        return content + rest, calls + more

    def _keep(self, call: ToolCall, calls: list[ToolCall]) -> None:
        self._found += 1
        if self._max_calls is None or self._found <= self._max_calls:
            calls.append(call)


class TaggedCallParser(ToolCallParser):
    """`<tool_call>` blocks anywhere in the text. Whitespace around a block belongs to it: it
    goes when the block holds a call and stays when the block falls back to content; only
    between text before and text after a call is it kept, as their separator."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: Iterable[str], max_calls: int | None = None):
        super().__init__(names, max_calls)
        self._in_block = False
        self._gap = ""  # whitespace before the open block
        self._after_call = False  # at the whitespace that follows a call
        self._wrote_text = False  # some content came before

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._held += delta
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._step(content, calls):
            pass
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._in_block:  # never closed: a call if its JSON is complete, else content
            body, self._held = self._held, ""
            self._close_block(body, content, calls, closed=False)
        if not self._after_call:  # else only the blanks after the last call are left
            content.append(self._held)
        self._held = ""
        return "".join(content), calls

    def _step(self, content: list[str], calls: list[ToolCall]) -> bool:
        """Take the next decided piece of the held text; False when the rest must wait."""
        if self._in_block:
            end = self._held.find(self.CLOSE)
            if end < 0:
                return False
            body, self._held = self._held[:end], self._held[end + len(self.CLOSE):]
            self._close_block(body, content, calls, closed=True)
            return True
        if self._after_call:
            if self._held.isspace() or not self._held:
                return False  # what follows decides
            self._after_call = False
            if not self._wrote_text:
                self._held = self._held.lstrip()
        start = self._held.find(self.OPEN)
        if start >= 0:
            before = self._held[:start]
            text = before.rstrip()
            self._write(text, content)
            self._gap = before[len(text):]
            self._held = self._held[start + len(self.OPEN):]
            self._in_block = True
            return True
        # Hold back trailing whitespace and what may be the start of an open tag.
        undecided = _partial_suffix(self._held, self.OPEN)
        text = self._held[:len(self._held) - undecided].rstrip()
        self._write(text, content)
        self._held = self._held[len(text):]
        return False

    def _write(self, text: str, content: list[str]) -> None:
        content.append(text)
        self._wrote_text = self._wrote_text or bool(text)

    def _close_block(self, body: str, content: list[str], calls: list[ToolCall],
                     closed: bool) -> None:
        self._in_block = False
        call = _parse_call(body, self._names)
        if call is None:
            self._write(self._gap + self.OPEN + body + (self.CLOSE if closed else ""), content)
        else:
            self._keep(call, calls)
            self._after_call = True
        self._gap = ""


class JsonCallParser(ToolCallParser):
    """An output made of JSON calls: `[<|python_tag|>] call (; call)*`. Whether the output is
    calls is decided by its first non-blank character; from the first thing that is not a
    call on, the rest is content (the whole output, if that is the first object)."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, names: Iterable[str], max_calls: int | None = None):
        super().__init__(names, max_calls)
        self._as_content = False
        self._decoder = json.JSONDecoder()

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._held += delta
        calls: list[ToolCall] = []
        if not self._as_content:
            self._take_calls(calls, final=False)
        return (self._release() if self._as_content else ""), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        if not self._as_content:
            self._take_calls(calls, final=True)
        return (self._release() if self._as_content else ""), calls

    def _release(self) -> str:
        content, self._held = self._held, ""
        return content

    def _take_calls(self, calls: list[ToolCall], final: bool) -> None:
        while True:
            rest = self._after_separator()
            if not rest:  # only blanks and separators so far
                if final and self._found:
                    self._held = ""
                elif final:
                    self._as_content = True
                return
            if not final and self._found == 0 and self.PYTHON_TAG.startswith(rest):
                return  # maybe the tag, in pieces
            if rest[0] != "{":
                self._to_content(rest)
                return
            try:
                value, end = self._decoder.raw_decode(self._held, len(self._held) - len(rest))
            except ValueError:  # not complete yet (or malformed: decided at the end)
                if final:
                    self._to_content(rest)
                return
            call = _as_call(value, self._names)
            if call is None:
                self._to_content(rest)
                return
            self._keep(call, calls)
            self._held = self._held[end:]

    def _after_separator(self) -> str:
        """The held text past what may precede a call: blanks, and the `;` after a call or
        the python tag before the first."""
        rest = self._held.lstrip()
        separator = ";" if self._found else self.PYTHON_TAG
        return rest.removeprefix(separator).lstrip()

    def _to_content(self, rest: str) -> None:
        """The rest of the output is content: all of it as written if no call came before."""
        self._as_content = True
        if self._found:
            self._held = rest


# ---------------------------------------------------------------------- formats


class ToolCallFormat:
    """One way of writing tool calls; `tools` are OpenAI tool dicts
    ({"type": "function", "function": {"name", "description", "parameters"}})."""

    name: str
    parser_class: type[ToolCallParser]
    arguments_key: str
    separator: str  # between calls, in prompts and grammars

    def parser(self, names: Iterable[str], max_calls: int | None = None) -> ToolCallParser:
        return self.parser_class(names, max_calls)

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system prompt describing the tools and how to call them."""
        raise NotImplementedError

    def write_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One call as the model writes it."""
        raise NotImplementedError

    def write_turn(self, content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """An assistant turn that made `calls`, as the model writes it."""
        return self.separator.join(self.write_call(name, args) for name, args in calls)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance) for one call, or one or more with `parallel`, each
        naming one of `tools` with arguments valid against that tool's parameters."""
        call = self._call_rule(json.dumps(_call_schema(tools, self.arguments_key)))
        more = f" ({json.dumps(self.separator)} call)*" if parallel else ""
        return f"start: call{more}\ncall: {call}\n"

    def _call_rule(self, schema: str) -> str:
        return f"%json {schema}"


def _call_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """A JSON schema for one call object, the name first as the formats write it."""
    options = [{"type": "object",
                "properties": {"name": {"const": tool["function"]["name"]},
                               arguments_key: _arguments_schema(tool["function"])},
                "required": ["name", arguments_key], "additionalProperties": False}
               for tool in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"x-guidance": JSON_STYLE, **bounded_schema(schema)}


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    if "parameters" not in function:
        return NO_PARAMETERS
    return function["parameters"] or {"type": "object"}  # {}: any object


def _tool_lines(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


class Qwen25Format(ToolCallFormat):
    name = "qwen25"
    parser_class = TaggedCallParser
    arguments_key = "arguments"
    separator = "\n"

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call functions to help with the user's request. Their "
                "signatures are inside <tools></tools> tags, one JSON object per line:\n"
                f"<tools>\n{_tool_lines(tools)}\n</tools>\n\n"
                "To call a function, write a JSON object with its name and arguments inside "
                "<tool_call></tool_call> tags:\n<tool_call>\n"
                '{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
                "</tool_call>\nUse one pair of tags per call. When no function is needed, "
                "answer in plain text.")

    def write_call(self, name: str, arguments: dict[str, Any]) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{TaggedCallParser.OPEN}\n{call}\n{TaggedCallParser.CLOSE}"

    def write_turn(self, content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
        written = super().write_turn(content, calls)
        return f"{content}\n{written}" if content else written

    def _call_rule(self, schema: str) -> str:
        before = json.dumps(TaggedCallParser.OPEN + "\n")
        after = json.dumps("\n" + TaggedCallParser.CLOSE)
        return f"{before} %json {schema} {after}"


class Llama3Format(ToolCallFormat):
    """The format has no room for text beside calls: a turn with calls is the calls."""

    name = "llama3"
    parser_class = JsonCallParser
    arguments_key = "parameters"
    separator = "; "

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return ("You may call functions to help with the user's request. Their signatures "
                f"follow, one JSON object per line:\n{_tool_lines(tools)}\n\n"
                "To call a function, reply with only a JSON object of the form "
                '{"name": <function name>, "parameters": <arguments as a JSON object>}; '
                'separate several calls with "; ". When no function is needed, answer in '
                "plain text.")

    def write_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


_FORMATS = {f.name: f for f in (Qwen25Format(), Llama3Format())}
# The format of models whose chat template teaches none: the system message describes it.
DEFAULT_FORMAT = _FORMATS["qwen25"]


def detect_tool_format(template: str) -> ToolCallFormat | None:
    """The format a chat template teaches its model to write calls in, from what the template
    writes: `<tool_call>` blocks (Qwen2.5, Qwen3, Hermes), or Llama 3.1's JSON calls (its
    `<|python_tag|>`, or `ipython` tool turns beside a `parameters` key). None: neither."""
    if TaggedCallParser.OPEN in template:
        return _FORMATS["qwen25"]
    if JsonCallParser.PYTHON_TAG in template or ("ipython" in template
                                                 and "parameters" in template):
        return _FORMATS["llama3"]
    return None


def tool_call_format(name: str) -> ToolCallFormat:
    """The format a `--tool-call-parser` value names (SGLang's or vLLM's name)."""
    try:
        return _FORMATS[_ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from "
                         f"{', '.join([*_FORMATS, *_ALIASES])}") from None
