"""Structured outputs over HTTP with the official openai client, on the demo model, plain and
with its EAGLE3 head: ten JSON schemas of increasing difficulty give output that parses and
validates with `jsonschema`, regexes match, json_object and regex streams equal the whole
answers, the speculative server's greedy constrained answers equal the plain server's (on
the nested half of the schemas), and a bad schema or regex is a 400 that names it."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from sgl_jax.testing.server import demo_servers, openai_client

pytestmark = pytest.mark.slow


def text(max_length):
    return {"type": "string", "maxLength": max_length}


def strict_object(properties, required=None):
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [  # (name, request, schema), simplest first
    ("answer", "What is the capital of France? Answer in JSON.",
     strict_object({"answer": text(40)})),
    ("account", "Describe a user account as JSON.",
     strict_object({"name": text(20), "active": {"type": "boolean"},
                    "logins": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("shirt", "Pick a shirt colour and size, as JSON.",
     strict_object({"color": {"enum": ["red", "green", "blue"]},
                    "size": {"enum": ["S", "M", "L", "XL"]}})),
    ("weather", "Give today's weather in Paris as JSON.",
     strict_object({"temperature": {"type": "integer", "minimum": -50, "maximum": 60},
                    "unit": {"enum": ["C", "F"]}, "sunny": {"type": "boolean"}})),
    ("tags", "List some tags for a blog post about cooking, as JSON.",
     strict_object({"tags": {"type": "array", "items": text(12), "minItems": 2,
                             "maxItems": 4}})),
    ("person", "Describe a person and their address as JSON.",
     strict_object({"person": strict_object({
         "name": text(20),
         "address": strict_object({"city": text(20),
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})})),
    ("cart", "Write a shopping cart as JSON.",
     strict_object({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                              "items": strict_object({
                                  "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                  "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}})),
    ("movie", "Tell me about a movie, as JSON.",
     strict_object({"title": text(30),
                    "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                    "rating": {"type": "integer", "minimum": 0, "maximum": 10}},
                   required=["title", "year"])),
    ("record", "Write a record with an id, as JSON.",
     strict_object({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                     {"type": "string", "pattern": "^ID[0-9]{3}$"}]},
                    "kind": {"const": "record"}})),
    ("order", "Write an online order as JSON.",
     strict_object({
         "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
         "customer": strict_object({
             "name": text(20),
             "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}}),
         "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": strict_object({
             "product": text(15), "price": {"type": "integer", "minimum": 0, "maximum": 1000},
             "qty": {"type": "integer", "minimum": 1, "maximum": 5}})},
         "status": {"enum": ["new", "paid", "shipped"]}})),
]
REGEXES = [("What is today's date?", r"\d{4}-\d{2}-\d{2}"),
           ("What is the phone number of a pizza shop?", r"\(\d{3}\) \d{3}-\d{4}")]


@pytest.fixture(scope="module")
def servers():
    with demo_servers() as both:
        yield both


def client(server) -> openai.OpenAI:
    return openai_client(server)


def ask(server, question: str, *, complete: bool = True, **extra) -> str:
    """The greedy answer; `complete`: it must end by itself (the grammar or EOS)."""
    reply = client(server).chat.completions.create(
        model="demo", messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=200, **extra)
    assert not complete or reply.choices[0].finish_reason == "stop", reply
    return reply.choices[0].message.content


def schema_format(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def schema_answers(server, schemas) -> list[str]:
    with ThreadPoolExecutor(len(schemas)) as pool:
        return list(pool.map(lambda s: ask(server, s[1], response_format=schema_format(
            s[0], s[2])), schemas))


def test_every_schema_validates_and_speculation_answers_the_same(servers):
    answers = schema_answers(servers["plain"], SCHEMAS)
    for answer, (_, _, schema) in zip(answers, SCHEMAS, strict=True):
        jsonschema.validate(json.loads(answer), schema)
    # the nested half (objects in objects, arrays of objects, patterns, anyOf): every
    # grammar construct the simpler half has, inside more of them
    assert schema_answers(servers["spec"], SCHEMAS[5:]) == answers[5:]


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_regexes_match(servers, kind):
    for question, regex in REGEXES:
        assert re.fullmatch(regex, ask(servers[kind], question, extra_body={"regex": regex}))


def test_streams_equal_whole_answers(servers):
    server = servers["spec"]
    question = "Describe a cat as JSON."
    for extra in ({"response_format": {"type": "json_object"}},
                  {"extra_body": {"regex": REGEXES[1][1]}}):
        whole = ask(server, question, complete=False, **extra)
        stream = client(server).chat.completions.create(
            model="demo", messages=[{"role": "user", "content": question}],
            temperature=0, max_tokens=200, stream=True, **extra)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == whole
        assert whole.startswith("{") if "response_format" in extra else re.fullmatch(
            REGEXES[1][1], whole)


def test_json_object_is_an_object(servers):
    answer = ask(servers["plain"], "Give the name and age of a person as a JSON object.",
                 response_format={"type": "json_object"})
    assert isinstance(json.loads(answer), dict)


def test_completions_and_generate_take_grammars(servers):
    server = servers["plain"]
    reply = client(server).completions.create(model="demo", prompt="The date today is ",
                                              max_tokens=20, temperature=0,
                                              extra_body={"regex": REGEXES[0][1]})
    assert re.fullmatch(REGEXES[0][1], reply.choices[0].text)
    out = generate(server, "A user as JSON: ", max_new_tokens=100,
                   json_schema=json.dumps(SCHEMAS[1][2]))
    jsonschema.validate(json.loads(out["text"]), SCHEMAS[1][2])


def generate(server, prompt: str, **params) -> dict:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12, **params}}
    return httpx.post(f"{server.base_url}/generate", json=body, timeout=120).json()


def test_logit_bias_moves_the_answer_plain_and_speculative(servers):
    first = generate(servers["plain"], "Say hi.")["output_ids"][0]
    bias = {str(first): -100}
    biased = generate(servers["plain"], "Say hi.", logit_bias=bias)
    assert biased["output_ids"][0] != first
    for kind in ("plain", "spec"):
        reply = client(servers[kind]).completions.create(
            model="demo", prompt="Say hi.", max_tokens=12, temperature=0, logit_bias=bias)
        assert reply.choices[0].text == biased["text"]


@pytest.mark.parametrize("extra, message", [
    ({"response_format": schema_format("bad", {"type": "nonsense"})}, "invalid json_schema"),
    ({"extra_body": {"regex": "(unclosed"}}, "invalid regex"),
    ({"extra_body": {"regex": "a", "ebnf": 'root ::= "a"'}}, "at most one of"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
])
def test_bad_grammars_are_400s_that_name_them(servers, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        ask(servers["plain"], "Hello", **extra)
    assert httpx.get(f"{servers['plain'].base_url}/health").status_code == 200
