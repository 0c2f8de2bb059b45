"""Chat templates: the tokenizer's own, a Jinja file, or a built-in one picked by name.

Rendering goes through transformers' `apply_chat_template`, so a template behaves exactly as
it does for the model's authors; `--chat-template` only chooses which template text is used.
Tools, past calls and tool results that a template cannot show are written into the messages
in the tool-call parser's format (see `ChatTemplate._with_tools`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from sgl_jax.tokenizer.tool_calls import (
    DEFAULT_FORMAT,
    ToolCallFormat,
    detect_tool_format,
    tool_call_format,
)

# Tool results as one user turn of <tool_response> blocks and past calls as <tool_call> blocks
# after the turn's text, the way Qwen2.5's template writes them (the `qwen25` parser's format).
_CHATML_MESSAGES = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{{- ('\\n' if message['content'] or not loop.first else '') + '<tool_call>\\n'"
    " + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    # ChatML (Qwen2 / Qwen2.5 style), without a default system prompt.
    "chatml": _CHATML_MESSAGES
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    # Qwen3 with thinking always off: the generation prompt carries an empty reasoning block,
    # which is what Qwen3's own template emits for enable_thinking=False.
    "qwen3-instruct-no-thinking": _CHATML_MESSAGES
    + "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}",
    # Llama 3 / 3.1 instruct headers, without a dated system prompt. As in Llama 3.1's own
    # template, tool results are `ipython` turns and a turn with calls is only its JSON calls
    # (the `llama3` parser's format).
    "llama-3-instruct": "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + ('ipython' if message['role'] == 'tool' else message['role'])"
    " + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- ('; ' if not loop.first else '') + {'name': call['function']['name'],"
    " 'parameters': call['function']['arguments']} | tojson }}"
    "{%- endfor %}"
    "{%- else %}"
    "{{- message['content'] | trim }}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}",
}


# Arguments of apply_chat_template itself, which template variables must not override.
_RESERVED_KWARGS = frozenset({"conversation", "messages", "chat_template", "tokenize",
                              "add_generation_prompt", "tools", "documents", "return_dict",
                              "continue_final_message", "tokenizer_kwargs"})


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template rejected them)."""


def resolve_chat_template(spec: str | None) -> str | None:
    """Template text for `--chat-template`: a built-in name or a file; None keeps the
    tokenizer's own."""
    if spec is None:
        return None
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    path = Path(spec)
    if path.is_file():
        return path.read_text()
    names = ", ".join(sorted(BUILTIN_TEMPLATES))
    raise ValueError(f"chat template {spec!r} is neither a file nor a built-in name ({names})")


@dataclass(frozen=True)
class ToolFormatChoice:
    """How a server shows tools to its model and reads the calls it writes."""

    format: ToolCallFormat
    source: str  # "--tool-call-parser", "chat template" or "built-in"
    in_template: bool  # the chat template shows the tools (else the system message does)

    def info(self) -> dict[str, Any]:
        return {"tool_call_format": self.format.name, "tool_call_format_source": self.source,
                "tools_shown_by": "chat template" if self.in_template else "system message"}


class ChatTemplate:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str | None = None):
        self.tokenizer = tokenizer
        self.template = template if template is not None else tokenizer.chat_template
        text = self.template or ""
        # What the template can show of tool calling; the rest is written into the messages.
        self.renders_tools = re.search(r"\btools\b", text) is not None
        self.renders_tool_calls = "tool_calls" in text
        self.tool_format = detect_tool_format(text)  # the call format it teaches, if any

    def choose_tool_format(self, parser: str | None) -> ToolFormatChoice:
        """The format calls are read in: `parser` (a --tool-call-parser value) if given, else
        the one the template teaches, else the built-in one (DEFAULT_FORMAT), described to
        the model in the system message. The template shows the tools itself only where it
        can and its format is the one read (or unknown, with a parser the user chose)."""
        if parser is not None:
            chosen = tool_call_format(parser)
            return ToolFormatChoice(chosen, "--tool-call-parser", self.renders_tools
                                    and self.tool_format in (None, chosen))
        if self.tool_format is not None:
            return ToolFormatChoice(self.tool_format, "chat template", self.renders_tools)
        return ToolFormatChoice(DEFAULT_FORMAT, "built-in", False)

    @property
    def available(self) -> bool:
        return bool(self.template)

    def check(self) -> None:
        """Render a one-turn conversation, so a broken template fails at start-up."""
        if self.available:
            self.render([{"role": "user", "content": "Hello"}])

    def render(self, messages: list[dict[str, Any]], *,
               tools: list[dict[str, Any]] | None = None,
               tool_format: ToolFormatChoice | None = None, add_generation_prompt: bool = True,
               template_kwargs: dict[str, Any] | None = None,
               continue_final_message: bool = False) -> str:
        """The prompt text for `messages`: {"role", "content"} with string content, plus
        "tool_calls" (arguments as dicts) on assistant turns and "tool_call_id" on tool
        turns. `tools` (OpenAI tool dicts) are offered to the model; `tool_format` (default:
        choose_tool_format without a parser) is how calls are written where the template
        cannot write them itself. `continue_final_message`: the prompt ends inside the last
        message (no end of turn, no new turn), so the output extends it."""
        reserved = _RESERVED_KWARGS & set(template_kwargs or {})
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(reserved)}")
        if not self.available:
            raise ChatTemplateError("this model's tokenizer has no chat template; start the "
                                    "server with --chat-template, or use /v1/completions")
        messages, tools = self._with_tools(messages, tools,
                                           tool_format or self.choose_tool_format(None))
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(template_kwargs or {}),
            )
        except (TemplateError, ValueError) as exc:  # the template refused these messages
            raise ChatTemplateError(f"the chat template could not render these messages: "
                                    f"{exc}") from exc

    def encode(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of the rendered prompt; the template supplies any BOS itself."""
        text = self.render(messages, **kwargs)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    tool_format: ToolFormatChoice
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages and tools in a form this template renders. A template that never mentions
        tools would silently drop them, and a small model (the demo's SmolLM2 has such a
        template) only calls tools it is told about in the format the parser reads: so the
        tools and that format go into the system message instead."""
        if not self.renders_tool_calls:
            messages = _write_tool_turns(messages, tool_format.format)
        if tools and not tool_format.in_template:
            return _with_system_text(messages, tool_format.format.instructions(tools)), None
        return messages, tools or None


def _write_tool_turns(messages: list[dict[str, Any]],
                      tool_format: ToolCallFormat) -> list[dict[str, Any]]:
    """For a template that knows nothing of tool calls: past calls become assistant text in
    `tool_format`, and tool results a user turn of <tool_response> blocks (as Qwen's template
    writes them), consecutive results sharing one turn."""
    written: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if index and messages[index - 1]["role"] == "tool":
                written[-1] = {**written[-1], "content": f"{written[-1]['content']}\n{response}"}
            else:
                written.append({"role": "user", "content": response})
        elif message.get("tool_calls"):
            calls = [(c["function"]["name"], c["function"]["arguments"])
                     for c in message["tool_calls"]]
            written.append({"role": message["role"],
                            "content": tool_format.write_turn(message["content"], calls)})
        else:
            written.append(message)
    return written


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` at the end of the system message, or as one if there is none."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
