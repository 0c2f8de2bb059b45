"""The demo server as the README starts it (no tool or parser flag), plain and with its EAGLE3
head, driven by the client libraries people point at OpenAI-compatible servers: the official
openai client, instructor, LangChain and LiteLLM. Each case checks the library's own parsed
result: a validated pydantic object, or a tool call naming the right function whose arguments
validate against its schema."""

import os
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from sgl_jax.testing.server import DEMO_FLAGS, DEMO_SPEC_FLAGS, launch_server, openai_client

pytestmark = pytest.mark.slow

MAX_TOKENS = 160
CITY_PROMPT = "Describe Paris, the capital of France, with its population in millions."
WEATHER_PROMPT = "What is the weather like in Paris today?"


class City(BaseModel):
    name: str
    country: str
    population_millions: float


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=30)
    unit: Literal["C", "F"]


@pytest.fixture(scope="module", params=["plain", "spec"])
def server(request):
    """One demo server at a time: the plain model, then the same with its EAGLE3 head."""
    from sgl_jax.demo import demo_draft_path, demo_model_path

    try:
        demo_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"demo model not installed: {e}")
    flags = list(DEMO_FLAGS)
    if request.param == "spec":
        flags += [*DEMO_SPEC_FLAGS, "--speculative-draft-model-path", str(demo_draft_path())]
    with launch_server(flags) as running:
        yield running


@pytest.fixture(scope="module")
def model(server) -> str:
    """The served model name, as a client would discover it."""
    models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert len(models) == 1
    return models[0]["id"]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------- openai


def test_openai_parse_gives_a_city(server, model):
    completion = openai_client(server).chat.completions.parse(
        model=model, messages=user(CITY_PROMPT), response_format=City, temperature=0,
        max_tokens=MAX_TOKENS)
    message = completion.choices[0].message
    assert message.refusal is None
    assert isinstance(message.parsed, City), message.content


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "GetWeather"}}],
    ids=["required", "named"])
def test_openai_tool_choice_gives_a_valid_call(server, model, tool_choice):
    completion = openai_client(server).chat.completions.parse(
        model=model, messages=user(WEATHER_PROMPT),
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice=tool_choice,
        parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    GetWeather.model_validate_json(call.function.arguments)


def test_openai_stream_with_usage(server, model):
    stream = openai_client(server).chat.completions.create(
        model=model, messages=user("Say hello in five words."), temperature=0,
        max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


# ---------------------------------------------------------------------- instructor


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_gives_a_city(server, model, mode):
    import instructor

    client = instructor.from_openai(openai_client(server), mode=instructor.Mode[mode])
    city = client.chat.completions.create(
        model=model, messages=user(CITY_PROMPT), response_model=City, temperature=0,
        max_tokens=MAX_TOKENS, max_retries=1)
    assert isinstance(city, City)


# ---------------------------------------------------------------------- LangChain


def chat_model(server, model):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="none", model=model,
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_gives_a_city(server, model, method):
    structured = chat_model(server, model).with_structured_output(City, method=method,
                                                                  include_raw=True)
    result = structured.invoke(CITY_PROMPT)
    assert isinstance(result["parsed"], City), result["raw"]


def test_langchain_bound_tool_gives_a_valid_call(server, model):
    bound = chat_model(server, model).bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke(WEATHER_PROMPT)
    assert message.tool_calls, message
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
    assert call["args"].keys() <= GetWeather.model_fields.keys()  # the schema closes objects


def test_langchain_stream_concatenates_to_text(server, model):
    chunks = list(chat_model(server, model).stream("Say hello in five words."))
    assert len(chunks) > 1
    assert "".join(chunk.text for chunk in chunks).strip()


# ---------------------------------------------------------------------- LiteLLM


def litellm_completion(server, model, **fields):
    # The bundled model price list, instead of fetching it from the internet at import.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm.completion(model=f"openai/{model}", api_base=f"{server.base_url}/v1",
                              api_key="none", temperature=0, max_tokens=MAX_TOKENS,
                              num_retries=0, **fields)


def test_litellm_required_tool_gives_a_valid_call(server, model):
    response = litellm_completion(
        server, model, messages=user(WEATHER_PROMPT),
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
        parallel_tool_calls=False)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "GetWeather"
    GetWeather.model_validate_json(call.function.arguments)


def test_litellm_response_format_gives_a_city(server, model):
    response = litellm_completion(server, model, messages=user(CITY_PROMPT),
                                  response_format=City)
    City.model_validate_json(response.choices[0].message.content)
