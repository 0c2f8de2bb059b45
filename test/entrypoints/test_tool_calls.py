"""Tool calls over HTTP with the official openai client, on the demo model (whose chat template
knows nothing of tools, so the server describes them in the system message), plain and with
its EAGLE3 head: required and named choices give calls whose arguments validate against the
tool's parameters, streams add up to the same calls, the speculative server answers exactly as
the plain one, a conversation carrying past calls and their results completes, and `auto`
leaves the choice to the model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from sgl_jax.testing.server import demo_servers, openai_client

pytestmark = pytest.mark.slow


def function(name, description, properties):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False}}}


WEATHER = function("get_weather", "Get the current weather in a city",
                   {"city": {"type": "string", "maxLength": 30},
                    "unit": {"type": "string", "enum": ["C", "F"]}})
CLOCK = function("get_time", "Get the current time in a time zone",
                 {"timezone": {"type": "string", "maxLength": 30}})
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
FOLLOW_UP = [*QUESTION,
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
             {"role": "tool", "tool_call_id": "call_1",
              "content": '{"temperature": 21, "sky": "sunny"}'}]
REQUESTS = {  # name -> request fields
    "required": {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
    "named": {"tools": [WEATHER, CLOCK],
              "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    "auto": {"tools": [WEATHER, CLOCK]},
    "follow_up": {"tools": [WEATHER, CLOCK], "messages": FOLLOW_UP, "max_tokens": 30},
}


@pytest.fixture(scope="module")
def servers():
    with demo_servers() as both:  # no tool flag: the demo's template teaches no format
        yield both


def client(server) -> openai.OpenAI:
    return openai_client(server)


def ask(server, fields: dict, **extra):
    body = {"model": "demo", "messages": QUESTION, "temperature": 0, "max_tokens": 60,
            **fields, **extra}
    return client(server).chat.completions.create(**body)


def answers(server) -> dict[str, dict]:
    """Every request of REQUESTS at once, greedy: name -> (finish_reason, content, calls)."""
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        replies = dict(zip(REQUESTS, pool.map(lambda f: ask(server, f), REQUESTS.values()),
                           strict=True))
    return {name: summary(reply.choices[0]) for name, reply in replies.items()}


def summary(choice) -> dict:
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return {"finish": choice.finish_reason, "content": choice.message.content, "calls": calls}


@pytest.fixture(scope="module")
def plain_answers(servers):
    return answers(servers["plain"])


def assert_valid_calls(answer: dict, names: set[str]) -> None:
    assert answer["finish"] == "tool_calls" and answer["content"] is None, answer
    assert len(answer["calls"]) == 1
    for name, arguments in answer["calls"]:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_the_server_says_which_format_it_reads(servers):
    info = httpx.get(f"{servers['plain'].base_url}/get_server_info").json()
    assert (info["tool_call_format"], info["tool_call_format_source"]) == ("qwen25", "built-in")
    assert info["tools_shown_by"] == "system message"


def test_required_gives_a_call_with_valid_arguments(plain_answers):
    assert_valid_calls(plain_answers["required"], {"get_weather"})


def test_a_named_choice_calls_that_function(plain_answers):
    assert_valid_calls(plain_answers["named"], {"get_time"})


def test_auto_gives_content_or_valid_calls(plain_answers):
    answer = plain_answers["auto"]
    if answer["calls"]:
        for name, arguments in answer["calls"]:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    else:
        assert answer["content"] and answer["finish"] in ("stop", "length")


def test_a_conversation_with_calls_and_results_completes(plain_answers):
    answer = plain_answers["follow_up"]
    assert answer["finish"] in ("stop", "length", "tool_calls")
    assert answer["content"] or answer["calls"]


def test_speculation_answers_the_same(servers, plain_answers):
    assert answers(servers["spec"]) == plain_answers


@pytest.mark.parametrize("name", ["required", "named"])
def test_streams_give_the_same_calls(servers, plain_answers, name):
    stream = ask(servers["spec"], REQUESTS[name], stream=True)
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, ["", ""])
            if piece.id:
                assert piece.id.startswith("call_") and piece.type == "function"
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == ""
    assert [tuple(calls[i]) for i in sorted(calls)] == plain_answers[name]["calls"]
    assert finish == plain_answers[name]["finish"]


def test_tools_with_a_grammar_or_an_unknown_choice_are_400s(servers):
    with pytest.raises(openai.BadRequestError, match="cannot be combined") as info:
        ask(servers["plain"], REQUESTS["required"], response_format={"type": "json_object"})
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        ask(servers["plain"], {"tools": [WEATHER], "tool_choice": {
            "type": "function", "function": {"name": "get_time"}}})
