"""OpenAIServing pieces that need no running engine: logprob bytes, and tool calls (request
validation errors in OpenAI's shape, the grammar that forces calls, responses and streams
over a stand-in engine that replays given outputs)."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from sgl_jax.entrypoints.openai.errors import APIError, from_validation_error
from sgl_jax.entrypoints.openai.protocol import ChatCompletionRequest
from sgl_jax.entrypoints.openai.serving import OpenAIServing
from sgl_jax.grammar import GrammarCompiler
from sgl_jax.sampling_params import SamplingParams, model_sampling_defaults
from sgl_jax.server_args import ServerArgs
from sgl_jax.testing.tokenizer import ENDOFTEXT_ID, write_tiny_tokenizer
from sgl_jax.tokenizer.chat_template import ChatTemplate


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_chat_logprobs_bytes_are_the_tokens_own_bytes(tokenizer):
    engine = SimpleNamespace(tokenizer=tokenizer, context_length=64, model_sampling_defaults={})
    serving = OpenAIServing(engine, ServerArgs().http, chat_template=ChatTemplate(tokenizer))
    ids = tokenizer("日本 😀", add_special_tokens=False).input_ids
    meta = {"output_token_logprobs": [(-0.5, i) for i in ids],
            "output_top_logprobs": [[(-0.5, i)] for i in ids]}
    content = serving.chat_logprobs(meta)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == "日本 😀".encode()
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]


# ---------------------------------------------------------------------- tool calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = '{"city": "Paris", "unit": "C"}'
PARIS_BLOCK = f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>'
CALLED = [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": PARIS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "20 C"}]}]


def request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps(
        {"model": "default", "messages": USER, **body}))


def test_sampling_defaults_come_after_the_request_and_before_the_engines():
    model = model_sampling_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 0,
                                     "repetition_penalty": 3.0, "max_new_tokens": 5})
    # transformers' top_k 0 is off; a penalty the engine refuses (and max_new_tokens,
    # not a sampling default here) is left out
    assert model == {"temperature": 0.6, "top_p": 0.95, "top_k": -1}
    chosen = request(top_p=None, min_p=0.1).sampling_params(16, model)
    assert {k: chosen[k] for k in ("temperature", "top_p", "top_k", "min_p")} == {
        "temperature": 0.6, "top_p": 0.95, "top_k": -1, "min_p": 0.1}
    # --sampling-defaults openai: no server defaults, the engine's own apply
    engine_defaults = SamplingParams.from_dict(request().sampling_params(16, {}))
    assert (engine_defaults.temperature, engine_defaults.top_p) == (1.0, 1.0)
    assert ServerArgs.from_cli(["--sampling-defaults", "openai"]).sampling_defaults == "openai"


BAD_TOOL_REQUESTS = [  # (body changes, param, words)
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name", "required"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'required'"),
    ({"tools": [WEATHER, CLOCK, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools.0.function.name", "pattern"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "get_weather"}},
      "regex": "a+"}, "tool_choice", "cannot be combined"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "valid boolean"),
    ({"messages": [{"role": "tool", "content": "20 C"}]}, "messages.0", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages.0",
     "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0", "content is required"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": CALLED[0]["tool_calls"]}]},
     "messages.0", "only assistant"),
    ({"messages": [*USER, {**CALLED[0], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "JSON object"),
]


@pytest.mark.parametrize("change, param, words", BAD_TOOL_REQUESTS)
def test_bad_tool_requests_are_400s_that_name_the_field(change, param, words):
    with pytest.raises(ValidationError) as info:
        request(**change)
    error = from_validation_error(info.value)
    assert error.status == 400 and error.param == param and words in error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_deprecated_functions_are_refused_by_name():
    for field, value in (("functions", [WEATHER["function"]]), ("function_call", "auto")):
        with pytest.raises(ValidationError) as info:
            request(**{field: value})
        error = from_validation_error(info.value)
        assert (error.param, error.code) == (field, "unsupported_parameter")


def test_tool_choice_defaults_and_what_is_forced():
    assert request(tools=[WEATHER]).tool_choice is None
    assert request(tools=[WEATHER]).offered_tools == [WEATHER]
    assert request(tools=[WEATHER]).forced_tools == []
    assert request(tools=[WEATHER], tool_choice="none").offered_tools == []
    assert request(tools=[], tool_choice="none").offered_tools == []
    assert request(tools=[WEATHER, CLOCK], tool_choice="required").forced_tools == [WEATHER, CLOCK]
    named = request(tools=[WEATHER, CLOCK],
                    tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.forced_tools == [CLOCK] and named.max_tool_calls == 1
    assert request(tools=[WEATHER], parallel_tool_calls=False).max_tool_calls == 1
    assert request(tools=[WEATHER]).max_tool_calls is None


class ReplayEngine:
    """Stands in for the Engine: replays `outputs` (one per choice) whole or in 3-character
    chunks, compiling any grammar as the real one does, and records each call's arguments."""

    def __init__(self, tokenizer, outputs: list[str], finish: str = "stop"):
        self.tokenizer = tokenizer
        self.context_length = self.max_request_tokens = 4096
        self.model_sampling_defaults = {}
        self.outputs, self.finish = outputs, finish
        self.calls: list[dict] = []
        self._grammars = GrammarCompiler(tokenizer, 512, [ENDOFTEXT_ID])

    async def async_generate(self, **kwargs):
        self.calls.append(kwargs)
        if "ebnf" in kwargs["sampling_params"]:
            self._grammars.matcher("ebnf", kwargs["sampling_params"]["ebnf"])
        meta = {"finish_reason": {"type": self.finish}, "prompt_tokens": 5,
                "completion_tokens": 7, "cached_tokens": 0}
        if not kwargs["stream"]:
            outs = [{"text": text, "meta_info": meta} for text in self.outputs]
            return outs if len(outs) > 1 else outs[0]
        return self._chunks(meta)

    async def _chunks(self, meta):
        for index, text in enumerate(self.outputs):
            pieces = [text[i:i + 3] for i in range(0, len(text), 3)] or [""]
            for n, piece in enumerate(pieces):
                yield {"index": index, "text": piece,
                       "meta_info": meta if n == len(pieces) - 1 else {}}


def serving(tokenizer, outputs, *, parser="qwen25", finish="stop", reasoning=None):
    engine = ReplayEngine(tokenizer, outputs, finish)
    args = ServerArgs(tool_call_parser=parser, reasoning_parser=reasoning)
    return OpenAIServing(engine, args.http, ChatTemplate(tokenizer)), engine


def chat(server, **body):
    async def run():
        result = await server.chat(request(**body))
        if isinstance(result, dict):
            return result
        return [json.loads(event.removeprefix("data: ")) async for event in result
                if event.strip() != "data: [DONE]"]
    return asyncio.run(run())


def test_without_a_parser_tools_take_the_built_in_format(tokenizer):
    """The tiny tokenizer's ChatML template teaches no call format: the server describes the
    tools and the built-in (qwen25) format in the system message, reads calls in it, and
    forces it for tool_choice 'required'."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    server, engine = serving(tokenizer, [call], parser=None)
    assert server.tools.info() == {"tool_call_format": "qwen25",
                                   "tool_call_format_source": "built-in",
                                   "tools_shown_by": "system message"}
    reply = chat(server, tools=[WEATHER])
    (made,) = reply["choices"][0]["message"]["tool_calls"]
    assert made["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert "<tools>" in tokenizer.decode(engine.calls[0]["input_ids"])
    chat(server, tools=[WEATHER], tool_choice="required")
    assert "<tool_call>" in engine.calls[1]["sampling_params"]["ebnf"]
    server, engine = serving(tokenizer, ["Sunny."], parser=None)
    reply = chat(server, tools=[WEATHER], tool_choice="none", messages=[*USER, *CALLED])
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}
    prompt = tokenizer.decode(engine.calls[0]["input_ids"])
    assert "get_weather" in prompt and "<tools>" not in prompt  # the past call, no offer


def test_a_call_in_the_answer_becomes_tool_calls(tokenizer):
    server, engine = serving(tokenizer, [f"Let me check.\n{PARIS_BLOCK}"])
    reply = chat(server, tools=[WEATHER])
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": PARIS}
    assert "ebnf" not in engine.calls[0]["sampling_params"]  # auto: the model decides
    prompt = tokenizer.decode(engine.calls[0]["input_ids"])
    assert json.dumps(WEATHER) in prompt and "<tool_call>" in prompt


def test_no_call_is_plain_content_and_a_cut_call_stays_content(tokenizer):
    server, _ = serving(tokenizer, ["It is sunny."])
    choice = chat(server, tools=[WEATHER])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"
    cut = PARIS_BLOCK[:30]
    server, _ = serving(tokenizer, [cut], finish="length")
    choice = chat(server, tools=[WEATHER])["choices"][0]
    assert choice["message"]["content"] == cut and choice["finish_reason"] == "length"


@pytest.mark.parametrize("choice, parallel, names", [
    ("required", True, ["get_weather", "get_time"]),
    ({"type": "function", "function": {"name": "get_time"}}, False, ["get_time"]),
])
def test_required_and_named_choices_send_a_grammar(tokenizer, choice, parallel, names):
    server, engine = serving(tokenizer, ['<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                                         "</tool_call>"])
    reply = chat(server, tools=[WEATHER, CLOCK], tool_choice=choice)
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    grammar = engine.calls[0]["sampling_params"]["ebnf"]
    assert grammar.startswith("start: call") and ('("\\n" call)*' in grammar) == parallel
    assert [n for n in ("get_weather", "get_time") if f'"const": "{n}"' in grammar] == names


def test_tool_parameters_that_cannot_compile_are_a_400_naming_tools(tokenizer):
    server, _ = serving(tokenizer, [""])
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    with pytest.raises(APIError) as info:
        chat(server, tools=[bad], tool_choice="required")
    assert (info.value.status, info.value.param) == (400, "tools")
    assert "cannot be enforced" in info.value.message


def accumulate(chunks) -> dict[int, dict]:
    """Each choice's streamed deltas added up the way OpenAI clients do."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            state = choices.setdefault(choice["index"], {"content": "", "calls": {}})
            delta = choice["delta"]
            state["content"] += delta.get("content") or ""
            state["reasoning"] = state.get("reasoning", "") + delta.get("reasoning_content", "")
            for piece in delta.get("tool_calls", []):
                call = state["calls"].setdefault(piece["index"], {"arguments": ""})
                if "id" in piece:
                    call.update(id=piece["id"], type=piece["type"],
                                name=piece["function"]["name"])
                call["arguments"] += piece["function"]["arguments"]
            state["finish"] = choice["finish_reason"] or state.get("finish")
    return choices


def test_streams_add_up_to_the_whole_answers_for_every_choice(tokenizer):
    outputs = [f"<think>Paris, so get_weather.</think>\n\n{PARIS_BLOCK}\n{PARIS_BLOCK}",
               "<think>No tool needed.</think>\n\nIt is sunny.",
               f"Checking.\n{PARIS_BLOCK}\nDone."]
    server, _ = serving(tokenizer, outputs, reasoning="qwen3")
    whole = chat(server, tools=[WEATHER], n=3)["choices"]
    streamed = accumulate(chat(server, tools=[WEATHER], n=3, stream=True))
    for choice in whole:
        state, message = streamed[choice["index"]], choice["message"]
        assert state["content"] == (message["content"] or "")
        assert state["reasoning"] == message["reasoning_content"]
        assert state["finish"] == choice["finish_reason"]
        calls = [{"name": c["name"], "arguments": c["arguments"]}
                 for _, c in sorted(state["calls"].items())]
        assert calls == [c["function"] for c in message.get("tool_calls", [])]
        assert all(c["id"].startswith("call_") for c in state["calls"].values())
    assert [c["finish_reason"] for c in whole] == ["tool_calls", "stop", "tool_calls"]
    assert whole[0]["message"]["content"] is None and len(whole[0]["message"]["tool_calls"]) == 2
    assert whole[2]["message"]["content"] == "Checking.\nDone."


def test_stream_reasoning_false_sends_the_reasoning_whole(tokenizer):
    """SGLang's stream_reasoning: false holds the reasoning back until its block closes."""
    outputs = ["<think>Paris is the capital, so say Paris.</think>\n\nParis.",
               "<think>Cut off while still thinking"]
    server, _ = serving(tokenizer, outputs, reasoning="qwen3")
    whole = chat(server, n=2)["choices"]
    chunks = chat(server, n=2, stream=True, stream_reasoning=False)
    for choice in whole:
        deltas = [c["choices"][0]["delta"] for c in chunks
                  if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
        assert reasoning == [choice["message"]["reasoning_content"]]
        assert "".join(d.get("content", "") for d in deltas) == choice["message"]["content"]
    streamed = accumulate(chat(server, n=2, stream=True))
    assert streamed[0]["reasoning"] == whole[0]["message"]["reasoning_content"]


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    server, _ = serving(tokenizer, [f"{PARIS_BLOCK}\n{PARIS_BLOCK}"])
    message = chat(server, tools=[WEATHER], parallel_tool_calls=False)["choices"][0]["message"]
    assert len(message["tool_calls"]) == 1 and message["content"] is None


def test_past_calls_reach_the_template_with_arguments_as_objects(tokenizer):
    server, engine = serving(tokenizer, ["It is 20 C in Paris."])
    reply = chat(server, tools=[WEATHER], messages=[*USER, *CALLED])
    assert reply["choices"][0]["message"]["content"] == "It is 20 C in Paris."
    prompt = tokenizer.decode(engine.calls[0]["input_ids"])
    assert (f"<|im_start|>assistant\n{PARIS_BLOCK}<|im_end|>\n<|im_start|>user\n"
            "<tool_response>\n20 C\n</tool_response><|im_end|>") in prompt


def test_json_object_with_a_schema_constrains_to_that_schema():
    """instructor's JSON_SCHEMA mode sends {"type": "json_object", "schema": ...}."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    sent = request(response_format={"type": "json_object", "schema": schema})
    assert json.loads(sent.sampling_params(16, {})["json_schema"]) == schema
    plain = request(response_format={"type": "json_object"})
    assert json.loads(plain.sampling_params(16, {})["json_schema"]) == {"type": "object"}
    for bad, param, words in [
        ({"type": "json_schema", "json_schema": {"name": "x"}, "schema": schema},
         "response_format", "json_object' only"),
        ({"type": "json_object", "schema": schema, "strict": True}, "response_format.strict",
         "unknown field"),
    ]:
        with pytest.raises(ValidationError) as info:
            request(response_format=bad)
        error = from_validation_error(info.value)
        assert error.param == param and words in error.message, error.message
