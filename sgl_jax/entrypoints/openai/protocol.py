"""OpenAI request schemas, with SGLang's extensions. Every field is declared: an unknown one is
refused by pydantic, and a known field this server does not implement is refused by name unless
it is left at a value that means "unused", never silently dropped."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from sgl_jax.grammar import ANY_JSON_OBJECT
from sgl_jax.model_executor.model_runner import MAX_TOP_LOGPROBS
from sgl_jax.sampling_fields import REQUEST_PARAMS, TOP_K_OFF
from sgl_jax.sampling_params import MAX_LOGIT_BIAS

# The model name SGLang's schemas default to; its clients send it.
DEFAULT_MODEL = "default"

# Fields this server knows but does not implement: field -> the values that leave it unused,
# which are accepted (and dropped); any other value is a 400 naming the field.
Unused = dict[str, tuple[Any, ...]]

_OPENAI_CHAT_UNIMPLEMENTED: Unused = {
    "functions": (None, []),  # deprecated by OpenAI for tools
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
}
_OPENAI_COMPLETION_UNIMPLEMENTED: Unused = {"suffix": (None, ""), "best_of": (None, 1)}

# SGLang's request fields this server accepts only at their defaults, one list per endpoint.
# SGLang's router forwards several of them (return_hidden_states, log_metrics, ...) with their
# default values on every request; the fields SGLang has that we implement are declared on
# the schemas instead.
_SGLANG_OPENAI_COMMON: Unused = {  # in both of SGLang's OpenAI-style schemas
    "return_hidden_states": (False,), "return_routed_experts": (False,),
    "routed_experts_start_len": (0,), "return_cached_tokens_details": (False,),
    "return_token_ids": (False,), "stop_regex": (None,), "lora_path": (None,),
    "session_id": (None,), "session_params": (None,), "custom_params": (None,),
    "custom_logit_processor": (None,), "images_config": (None,), "bootstrap_host": (None,),
    "bootstrap_port": (None,), "bootstrap_room": (None,), "routed_dp_rank": (None,),
    "disagg_prefill_dp_rank": (None,), "data_parallel_rank": (None,), "rid": (None,),
    "extra_key": (None,), "cache_salt": (None,), "ngram_corpus_id": (None,),
    "priority": (None,),
}
SGLANG_CHAT_DEFAULT_ONLY: Unused = {
    **_SGLANG_OPENAI_COMMON, "return_prompt_token_ids": (False,), "return_meta_info": (False,),
    "task": (None,), "max_dynamic_patch": (None,), "min_dynamic_patch": (None,),
    "use_audio_in_video": (False,), "input_ids": (None,),
    "reasoning": (None,),  # read by SGLang as another spelling of reasoning_effort
}
SGLANG_COMPLETION_DEFAULT_ONLY: Unused = {**_SGLANG_OPENAI_COMMON, "custom_labels": (None,)}
SGLANG_GENERATE_DEFAULT_ONLY: Unused = {
    "rid": (None,), "session_id": (None,), "input_embeds": (None,), "image_data": (None,),
    "video_data": (None,), "audio_data": (None,), "mm_hashes": (None,),
    "mm_content_hashes": (None,), "use_audio_in_video": (False,), "video_config": (None,),
    "logprob_start_len": (None, -1), "token_ids_logprob": (None,),
    "return_sampling_mask": (None, False), "return_flat_raw_top_logprobs": (False,),
    "return_flat_raw_top_logprobs_b64": (False,), "log_metrics": (True,),
    "return_hidden_states": (False,), "return_routed_experts": (False,),
    "routed_experts_start_len": (0,), "return_indexer_topk": (False,), "modalities": (None,),
    "session_params": (None,), "lora_path": (None,), "lora_id": (None,),
    "custom_logit_processor": (None,), "positional_embed_overrides": (None,),
    "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,),
    "bootstrap_pair_key": (None,), "decode_tp_size": (None,), "routed_dp_rank": (None,),
    "data_parallel_rank": (None,), "disagg_prefill_dp_rank": (None,),
    "kv_router_hint": (None,), "routing_key": (None,), "conversation_id": (None,),
    "http_worker_ipc": (None,), "background": (False,), "require_reasoning": (False,),
    "max_thinking_tokens": (None,), "priority": (None,), "extra_key": (None,),
    "no_logs": (False,), "custom_labels": (None,), "return_bytes": (False,),
    "return_entropy": (False,), "return_prompt_token_ids": (False,),
    "external_trace_header": (None,), "received_time": (None,),
    "need_wait_for_mm_inputs": (None,), "num_items_assigned": (None,),
    "encoder_urls": (None,), "max_dynamic_patch": (None,), "min_dynamic_patch": (None,),
    "image_max_dynamic_patch": (None,), "video_max_dynamic_patch": (None,),
    "images_config": (None,), "multi_item_delimiter_indices": (None,), "cache_salt": (None,),
}
# Keys of /generate's sampling_params (SGLang's SamplingParams).
SGLANG_SAMPLING_DEFAULT_ONLY: Unused = {
    "stop_regex": (None,), "structural_tag": (None,), "custom_params": (None,),
    "stream_interval": (None,),
}


class FieldError(ValueError):
    """A problem that a check across fields found, naming the field the error is about (its
    path would otherwise be the request's root)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class UnsupportedFieldError(FieldError):
    def __init__(self, field: str, message: str | None = None):
        super().__init__(field, message or f"'{field}' is not supported by this server")


def drop_unused(data: Any, unused: Unused) -> Any:
    """`data` without the fields of `unused` that hold an unused value; any other value of
    one of them raises UnsupportedFieldError."""
    if not isinstance(data, dict) or not unused.keys() & data.keys():
        return data
    for field in unused.keys() & data.keys():
        if not any(_same_json(data[field], value) for value in unused[field]):
            allowed = " or ".join(json.dumps(value) for value in unused[field])
            raise UnsupportedFieldError(field, f"'{field}' is not supported by this server; "
                                               f"leave it out or send {allowed}")
    return {key: value for key, value in data.items() if key not in unused}


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: false is not 0, and 1 is not true."""
    return type(a) is type(b) and a == b


class StrictSchema(BaseModel):
    # Strict: a string is not a number and a number is not a string (JSON types as sent).
    model_config = ConfigDict(extra="forbid", strict=True)
    # Known fields this schema accepts only while unused (see `Unused`).
    unused_fields: ClassVar[Unused] = {}
    # Fields whose null means their default (SGLang declares them optional, defaulting to null).
    null_means_default: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _accept_unused(cls, data: Any) -> Any:
        data = drop_unused(data, cls.unused_fields)
        if isinstance(data, dict) and cls.null_means_default:
            data = {k: v for k, v in data.items()
                    if not (v is None and k in cls.null_means_default)}
        return data


class StreamOptions(StrictSchema):
    unused_fields = {"continuous_usage_stats": (False,)}  # SGLang's: usage in every chunk

    include_usage: bool = False


class TextPart(StrictSchema):
    type: Literal["text"]
    text: str


class FunctionCall(StrictSchema):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object (as a string)")
        return arguments


class ToolCallMessage(StrictSchema):
    """A call an assistant turn made, sent back in the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        """Arguments as a dict: chat templates (Qwen's, Llama's) write them with `tojson`."""
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(StrictSchema):
    # "developer" is OpenAI's newer name for the system role; "tool" carries a call's result.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only on an assistant turn with calls
    tool_calls: list[ToolCallMessage] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this answers
    name: str | None = None  # the participant's name, for templates that show it
    reasoning_content: str | None = None  # an assistant turn's reasoning (SGLang's field)

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

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs a tool_call_id, and only it has one")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (it may be null only on an assistant "
                             "message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        optional = {"tool_call_id": self.tool_call_id, "name": self.name,
                    "reasoning_content": self.reasoning_content}
        message.update({key: value for key, value in optional.items() if value is not None})
        return message


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(StrictSchema):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # required and named calls follow the schema, strict or not


class Tool(StrictSchema):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictSchema):
    name: str


class NamedToolChoice(StrictSchema):
    type: Literal["function"]
    function: NamedFunction


# Tagged by JSON type, so an error names what was wrong with the form that was sent.
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[NamedToolChoice, Tag("dict")],
    Discriminator(lambda value: "dict" if isinstance(value, dict | NamedToolChoice) else "str"),
]


Stop = str | Annotated[list[str], Field(max_length=16)] | None


class JsonSchemaFormat(StrictSchema):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(StrictSchema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # An extension several hosted OpenAI-compatible APIs accept (instructor's JSON_SCHEMA mode
    # sends it): json_object constrained to this schema.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format needs json_schema exactly when its type is "
                             "'json_schema'")
        if self.schema_ is not None and self.type != "json_object":
            raise ValueError("response_format.schema goes with type 'json_object' only (for "
                             "'json_schema', put it in json_schema.schema)")
        return self

    def grammar(self) -> dict[str, str]:
        """The engine's grammar field for this format ({} for plain text)."""
        if self.type == "json_object":
            return {"json_schema": ANY_JSON_OBJECT if self.schema_ is None
                    else json.dumps(self.schema_)}
        if self.type == "json_schema":
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        return {}


class _SamplingFields(StrictSchema):
    """Fields shared by chat and text completions (OpenAI's, then SGLang/vLLM extensions)."""

    model: str = DEFAULT_MODEL  # optional, as in SGLang
    # null or left out (as with top_k, min_p, repetition_penalty): the server's default
    # (its --sampling-defaults: the model's generation config, else OpenAI's)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None  # recorded in the request log
    # Extensions
    top_k: int | None = Field(None, ge=TOP_K_OFF)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the stop string that ended the output in its text
    # Structured outputs: OpenAI's response_format, or SGLang's regex and ebnf (one of them).
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Speculative decoding for this request (our extension; SamplingParams has the meaning).
    speculative: bool = True
    speculative_num_steps: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> _SamplingFields:
        if self.top_k == 0:
            raise ValueError(f"top_k must be {TOP_K_OFF} (off) or >= 1")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if len(self._grammars()) > 1:
            raise ValueError(f"pass at most one of {self._grammar_fields}")
        return self

    _grammar_fields: ClassVar[str] = "response_format (json_object or json_schema), regex and ebnf"

    def _grammars(self) -> list[tuple[str, str]]:
        """(engine grammar field, text) for each grammar the request names."""
        chosen = [] if self.response_format is None else [*self.response_format.grammar().items()]
        return chosen + [(k, v) for k, v in (("regex", self.regex), ("ebnf", self.ebnf))
                         if v is not None]

    def grammar(self) -> dict[str, str]:
        """The engine's grammar field the request names, if any."""
        return dict(self._grammars())

    def sampling_params(self, max_new_tokens: int,
                        defaults: Mapping[str, Any]) -> dict[str, Any]:
        """The engine's sampling parameters, `defaults` (the server's, for fields of
        MODEL_DEFAULT_FIELDS) where the request sets none; the engine's own defaults where
        neither does. The parameters that set a sampling row (REQUEST_PARAMS) have the same
        names here; an OpenAI seed of any size maps to 32 bits."""
        chosen = {name: getattr(self, name) for name in REQUEST_PARAMS}
        if self.seed is not None:
            chosen["seed"] = self.seed % 2**32
        return {
            **defaults, **{name: value for name, value in chosen.items() if value is not None},
            "max_new_tokens": max_new_tokens, "min_new_tokens": self.min_tokens,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos, "n": self.n,
            "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim,
            "logit_bias": self.logit_bias, **self.grammar(),
            "speculative": self.speculative, "speculative_num_steps": self.speculative_num_steps,
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    unused_fields = {**_OPENAI_CHAT_UNIMPLEMENTED, **SGLANG_CHAT_DEFAULT_ONLY}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    # Default: "auto" with tools, "none" without.
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # with --reasoning-parser: split out reasoning_content
    stream_reasoning: bool = True  # false: a stream sends the reasoning in one delta, once whole
    continue_final_message: bool = False  # extend the last (assistant) message, no new turn

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("pass max_tokens or max_completion_tokens, not both")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise FieldError("continue_final_message", "continue_final_message needs an "
                                                       "assistant message last")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise FieldError("tools", f"function names must be unique; "
                                      f"{', '.join(repeated)} appear more than once")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise FieldError("tool_choice", "tool_choice other than 'none' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names {choice.function.name!r}, "
                                            f"which is not among the tools {names}")
        if self.forced_tools and self.grammar():
            raise FieldError("tool_choice", "tool_choice 'required' or a named function is "
                                            "enforced with a grammar, so it cannot be "
                                            "combined with response_format, regex or ebnf")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    @property
    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the model is told about, as OpenAI tool dicts: none with tool_choice
        'none', so it answers in prose as asked."""
        if self.tool_choice == "none":
            return []
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    @property
    def forced_tools(self) -> list[dict[str, Any]]:
        """The tools one of which the output must call: all of them with tool_choice
        'required', the named one with a named choice; none otherwise."""
        if self.tool_choice == "required":
            return self.offered_tools
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            return [t for t in self.offered_tools if t["function"]["name"] == name]
        return []

    @property
    def max_tool_calls(self) -> int | None:
        """At most one call when parallel calls are off or a function is named."""
        named = isinstance(self.tool_choice, NamedToolChoice)
        return None if self.parallel_tool_calls and not named else 1


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    unused_fields = {**_OPENAI_COMPLETION_UNIMPLEMENTED, **SGLANG_COMPLETION_DEFAULT_ONLY}

    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # each choice's text starts with its prompt
    json_schema: str | None = None  # SGLang's: the output is JSON valid against this schema

    _grammar_fields = "response_format (json_object or json_schema), json_schema, regex and ebnf"

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.prompt == "" or self.prompt == [""]:
            raise ValueError("prompt must not be empty")
        if self.echo and self.logprobs is not None:
            # OpenAI's answer would carry the prompt's logprobs, which are not computed here.
            raise UnsupportedFieldError("echo", "echo together with logprobs is not supported "
                                                "by this server")
        return self

    def _grammars(self) -> list[tuple[str, str]]:
        named = [("json_schema", self.json_schema)] if self.json_schema is not None else []
        return super()._grammars() + named
