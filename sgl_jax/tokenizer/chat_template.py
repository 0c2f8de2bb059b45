"""Chat templates: the tokenizer's own, a Jinja file, or a built-in one picked by name.

Rendering goes through transformers' `apply_chat_template`, so a template behaves exactly as
it does for the model's authors; `--chat-template` only chooses which template text is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

_CHATML_MESSAGES = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
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
    # Llama 3 / 3.1 instruct headers, without tools or a dated system prompt.
    "llama-3-instruct": "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
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


class ChatTemplate:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str | None = None):
        self.tokenizer = tokenizer
        self.template = template if template is not None else tokenizer.chat_template

    @property
    def available(self) -> bool:
        return bool(self.template)

    def check(self) -> None:
        """Render a one-turn conversation, so a broken template fails at start-up."""
        if self.available:
            self.render([{"role": "user", "content": "Hello"}])

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for `messages` (each {"role", "content"} with string content)."""
        reserved = _RESERVED_KWARGS & set(template_kwargs or {})
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(reserved)}")
        if not self.available:
            raise ChatTemplateError("this model's tokenizer has no chat template; start the "
                                    "server with --chat-template, or use /v1/completions")
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **(template_kwargs or {}),
            )
        except (TemplateError, ValueError) as exc:  # the template refused these messages
            raise ChatTemplateError(f"the chat template could not render these messages: "
                                    f"{exc}") from exc

    def encode(self, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
        """Token ids of the rendered prompt; the template supplies any BOS itself."""
        text = self.render(messages, **kwargs)
        return self.tokenizer(text, add_special_tokens=False).input_ids
