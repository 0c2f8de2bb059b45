"""OpenAI request schemas. Every field is declared: an unknown one is refused by pydantic, and
an OpenAI field this server does not implement is refused by name, never silently dropped."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sgl_jax.grammar import ANY_JSON_OBJECT
from sgl_jax.model_executor.model_runner import MAX_TOP_LOGPROBS
from sgl_jax.sampling_params import MAX_LOGIT_BIAS

# OpenAI fields we know but do not implement, with the values that mean "not used".
_UNIMPLEMENTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


class UnsupportedFieldError(ValueError):
    def __init__(self, field: str):
        super().__init__(f"'{field}' is not supported by this server")
        self.field = field


def _refuse_unimplemented(data: Any) -> Any:
    if isinstance(data, dict):
        for field, unused in _UNIMPLEMENTED_FIELDS.items():
            if field in data and data[field] not in unused:
                raise UnsupportedFieldError(field)
    return data


class _Strict(BaseModel):
    # Strict: a string is not a number and a number is not a string (JSON types as sent).
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for the system role.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        parts = data.get("content") if isinstance(data, dict) else None
        for part in parts if isinstance(parts, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported; "
                                 "only 'text'")
        return data

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Stop = str | Annotated[list[str], Field(max_length=16)] | None


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format needs json_schema exactly when its type is "
                             "'json_schema'")
        return self

    def grammar(self) -> dict[str, str]:
        """The engine's grammar field for this format ({} for plain text)."""
        if self.type == "json_object":
            return {"json_schema": ANY_JSON_OBJECT}
        if self.type == "json_schema":
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        return {}


class _SamplingFields(_Strict):
    """Fields shared by chat and text completions (OpenAI's, then SGLang/vLLM extensions)."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None  # recorded in the request log
    # Extensions
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format, or SGLang's regex and ebnf (one of them).
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        return _refuse_unimplemented(data)

    @model_validator(mode="after")
    def _check(self) -> _SamplingFields:
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if len(self.grammar()) > 1:
            raise ValueError("pass at most one of response_format (json_object or "
                             "json_schema), regex and ebnf")
        return self

    def grammar(self) -> dict[str, str]:
        """The engine's grammar field(s) the request names."""
        chosen = {} if self.response_format is None else self.response_format.grammar()
        chosen.update({k: v for k, v in (("regex", self.regex), ("ebnf", self.ebnf))
                       if v is not None})
        return chosen

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The engine's sampling parameters; an OpenAI seed of any size maps to 32 bits."""
        return {
            "max_new_tokens": max_new_tokens, "min_new_tokens": self.min_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": None if self.seed is None else self.seed % 2**32,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos, "n": self.n,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": self.logit_bias, **self.grammar(),
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # with --reasoning-parser: split out reasoning_content

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("pass max_tokens or max_completion_tokens, not both")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.prompt == "" or self.prompt == [""]:
            raise ValueError("prompt must not be empty")
        return self
