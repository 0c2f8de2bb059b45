"""Tool-call formats: whole-text parsing against hand-written answers, streaming (every split
point, one character at a time, random chunkings) equal to the whole-text result, what the
formats write back into prompts parsing to the same calls, and grammars that accept exactly
calls to the forced tools with valid arguments."""

import json
import random

import pytest

from sgl_jax.grammar import GrammarCompiler
from sgl_jax.server_args import TOOL_CALL_PARSERS
from sgl_jax.testing.tokenizer import ENDOFTEXT_ID, write_tiny_tokenizer
from sgl_jax.tokenizer.tool_calls import ToolCall, tool_call_format

NAMES = ("get_weather", "get_time")
PARIS = ToolCall("get_weather", '{"city": "Paris", "unit": "C"}')
ROME = ToolCall("get_weather", '{"city": "Rome", "unit": "F"}')
TIME = ToolCall("get_time", "{}")
PARIS_JSON = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
ROME_JSON = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}'

QWEN25_CASES = [  # (output, content, calls)
    (f"<tool_call>\n{PARIS_JSON}\n</tool_call>", "", [PARIS]),
    (f"Let me check.\n<tool_call>\n{PARIS_JSON}\n</tool_call>", "Let me check.", [PARIS]),
    (f"<tool_call>\n{PARIS_JSON}\n</tool_call>\n<tool_call>\n{ROME_JSON}\n</tool_call>", "",
     [PARIS, ROME]),
    ('<tool_call>{"name":"get_weather","arguments":{"unit":"C","city":"Paris"}}</tool_call>'
     "\n\nDone.", "Done.", [ToolCall("get_weather", '{"unit": "C", "city": "Paris"}')]),
    (f"Checking.\n{PARIS_JSON.join(['<tool_call>', '</tool_call>'])} \n\nDone.\n",
     "Checking. \n\nDone.\n", [PARIS]),
    (f"Two:\n<tool_call>{PARIS_JSON}</tool_call>\n<tool_call>{ROME_JSON}</tool_call>\n",
     "Two:", [PARIS, ROME]),
    ('<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [TIME]),
    ('<tool_call>\n{"name": "get_time", "parameters": {}}\n</tool_call>', "", [TIME]),
    (f"<tool_call>\n{PARIS_JSON}\n</tool_call><tool_call>[1]</tool_call>",
     "<tool_call>[1]</tool_call>", [PARIS]),
    # Never closed: a call if its JSON is whole (the model stopped early).
    (f"<tool_call>\n{PARIS_JSON}\n", "", [PARIS]),
]
QWEN25_CONTENT = [  # outputs that are all content, as written
    "The weather is sunny, 20 °C.  ",
    "a < b and <tool_c",
    "x \n<tool_call>\n{not json}\n</tool_call>\ny",  # the whitespace around stays too
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # a function not offered
    '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>',
    'Sure <tool_call>\n{"name": "get_weather", "argu',  # cut off
    "",
]

LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', "", [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', "",
     [PARIS]),
    ('\n {"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
     '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}};', "", [PARIS, ROME]),
    ('{"name": "get_time", "parameters": {}}\n{"name": "get_time"}', "", [TIME, TIME]),
    ('{"name": "get_time", "parameters": {}}; and then text {"a": 1}', 'and then text {"a": 1}',
     [TIME]),
]
LLAMA3_CONTENT = [
    "The weather is sunny.",
    '  {"answer": 42} and more',
    '{"name": "get_weather", "parameters": {"city": "Pa',
    '{"name": "get_weather", "parameters": {"city": "Paris" "unit": "C"}}',
    "<|python_tag|>print(1)",
    "<|pyth",
    "  ",
    "",
]

CASES = [("qwen25", *case) for case in QWEN25_CASES] + [
    ("qwen25", text, text, []) for text in QWEN25_CONTENT] + [
    ("llama3", *case) for case in LLAMA3_CASES] + [
    ("llama3", text, text, []) for text in LLAMA3_CONTENT]


def parse(name: str, text: str, max_calls=None):
    return tool_call_format(name).parser(NAMES, max_calls).parse(text)


def stream(name: str, pieces: list[str], max_calls=None):
    parser = tool_call_format(name).parser(NAMES, max_calls)
    content, calls = "", []
    for piece in pieces:
        more_content, more_calls = parser.feed(piece)
        content, calls = content + more_content, calls + more_calls
    rest, last = parser.finish()
    return content + rest, calls + last


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_text(name, text, content, calls):
    assert parse(name, text) == (content, calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_every_chunking_streams_the_whole_result(name, text, content, calls):
    for cut in range(len(text) + 1):
        assert stream(name, [text[:cut], text[cut:]]) == (content, calls), cut
    assert stream(name, list(text)) == (content, calls)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert stream(name, pieces) == (content, calls), pieces


def test_content_streams_while_calls_wait_for_their_end():
    parser = tool_call_format("qwen25").parser(NAMES)
    assert parser.feed("Let me check") == ("Let me check", [])
    assert parser.feed(".\n<tool") == (".", [])  # the newline may belong to a block
    assert parser.feed('_call>\n{"name": "get_weather", ') == ("", [])
    assert parser.feed('"arguments": {"city": "Paris", "unit": "C"}}\n</tool_') == ("", [])
    assert parser.feed("call>\n") == ("", [PARIS])
    assert parser.finish() == ("", [])
    llama = tool_call_format("llama3").parser(NAMES)
    assert llama.feed("Sunny") == ("Sunny", [])
    llama = tool_call_format("llama3").parser(NAMES)
    assert llama.feed('{"name": "get_time", "parameters": {}}') == ("", [TIME])


@pytest.mark.parametrize("name", ["qwen25", "llama3"])
def test_calls_past_the_limit_are_dropped(name):
    fmt = tool_call_format(name)
    text = fmt.write_turn("", [("get_weather", {"city": "Paris", "unit": "C"}),
                               ("get_time", {})])
    assert parse(name, text, max_calls=1) == ("", [PARIS])
    assert parse(name, text) == ("", [PARIS, TIME])


@pytest.mark.parametrize("name", ["qwen25", "llama3"])
def test_written_turns_parse_back_to_their_calls(name):
    fmt = tool_call_format(name)
    calls = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]
    content = "Checking." if name == "qwen25" else ""  # llama3 has no room for text
    assert parse(name, fmt.write_turn(content, calls)) == (content, [PARIS, TIME])


def test_every_parser_name_is_a_format_and_aliases_match():
    assert {tool_call_format(n).name for n in TOOL_CALL_PARSERS} == {"qwen25", "llama3"}
    assert tool_call_format("hermes") is tool_call_format("qwen25")
    assert tool_call_format("llama3_json") is tool_call_format("llama3")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_call_format("mistral")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("name", ["qwen25", "llama3"])
def test_instructions_list_the_tools_and_the_call_shape(name):
    text = tool_call_format(name).instructions([WEATHER, CLOCK])
    assert json.dumps(WEATHER) in text and json.dumps(CLOCK) in text
    assert ('"arguments"' if name == "qwen25" else '"parameters"') in text


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    tokenizer = write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return tokenizer, GrammarCompiler(tokenizer, 512, [ENDOFTEXT_ID])


def accepts(compiler, grammar: str, text: str) -> bool:
    tokenizer, grammars = compiler
    matcher = grammars.matcher("ebnf", grammar)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("name", ["qwen25", "llama3"])
def test_grammars_accept_only_calls_to_the_forced_tools(compiler, name):
    fmt = tool_call_format(name)
    paris = ("get_weather", {"city": "Paris", "unit": "C"})
    one = fmt.grammar([WEATHER, CLOCK], parallel=False)
    assert accepts(compiler, one, fmt.write_turn("", [paris]))
    assert accepts(compiler, one, fmt.write_turn("", [("get_time", {})]))
    assert not accepts(compiler, one, fmt.write_turn("", [paris, paris]))
    assert not accepts(compiler, one, fmt.write_turn("", [("get_weather", {"city": "Paris"})]))
    assert not accepts(compiler, one, fmt.write_turn("", [("get_time", {"x": 1})]))
    assert not accepts(compiler, one, fmt.write_turn("", [("get_news", {})]))
    assert not accepts(compiler, one, "The weather is sunny.")
    many = fmt.grammar([WEATHER, CLOCK], parallel=True)
    assert accepts(compiler, many, fmt.write_turn("", [paris, ("get_time", {})]))
    named = fmt.grammar([CLOCK], parallel=False)
    assert not accepts(compiler, named, fmt.write_turn("", [paris]))


def test_empty_parameters_take_any_object_and_missing_ones_none(compiler):
    fmt = tool_call_format("qwen25")
    anything = {"type": "function", "function": {"name": "log", "parameters": {}}}
    grammar = fmt.grammar([anything, CLOCK], parallel=False)
    assert accepts(compiler, grammar, fmt.write_call("log", {"level": 3, "tags": ["a"]}))
    assert accepts(compiler, grammar, fmt.write_call("get_time", {}))
    assert not accepts(compiler, grammar, fmt.write_call("get_time", {"zone": "UTC"}))
