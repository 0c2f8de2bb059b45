"""JSON output always ends: numbers stop at their digit bounds and strings at their length
bound (sgl_jax.json_bounds), and no float64 or int64 as JSON writes it is ever cut."""

import json
import math

import numpy as np
import pytest

from sgl_jax.grammar import GrammarCompiler, fill_bitmasks
from sgl_jax.json_bounds import (
    MAX_STRING_LENGTH,
    START,
    NumberBounds,
    bounded_schema,
)
from sgl_jax.testing.tokenizer import ENDOFTEXT_ID, TINY_VOCAB_SIZE, write_tiny_tokenizer

BYTES = NumberBounds([bytes([i]) for i in range(256)])  # a vocabulary of single bytes


def follow(text: str):
    """The bounds' state after `text`, byte by byte; None where a bound stops it."""
    state = START
    for byte in text.encode():
        state = BYTES.advance(state, byte)
        if state is None:
            return None
    return state


def test_no_float64_or_int64_is_cut():
    rng = np.random.default_rng(0)
    floats = [5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 0.1, 1 / 3, -0.0,
              123456789012345678.0, 0.0001, 9007199254740993.0, math.pi * 1e-7]
    floats += list(rng.standard_normal(300) * 10.0 ** rng.integers(-320, 300, 300))
    ints = [2**63 - 1, -(2**63), 0, 10**18] + rng.integers(-(2**63), 2**63 - 1, 300).tolist()
    for value in floats + ints:
        text = json.dumps({"x": [value, {"y": value}]})
        assert follow(text) is not None, text


@pytest.mark.parametrize("allowed, stopped", [
    ("1" * 19, "1"),  # integer digits
    ("-" + "9" * 19, "9"),
    ("0." + "0" * 20, "0"),  # zeros before the first significant digit
    ("1." + "2" * 16, "2"),  # significant digits with a fraction
    ("0.000" + "3" * 17, "3"),
    ("1" * 17, "."),  # no room left for a fraction digit
    ("1.5e+308", "1"),  # exponent digits
    ("2E-12", "34"),
])
def test_each_bound_stops_its_number(allowed, stopped):
    assert follow(f'{{"n": [1, {allowed}') is not None
    assert follow(f'{{"n": [1, {allowed}{stopped}') is None


def test_digits_outside_numbers_are_not_counted():
    assert follow(json.dumps({"1" * 40: "2" * 60, "k": ["3" * 50, 4]})) is not None
    assert follow('{"s": "\\"' + "5" * 30 + '"}') is not None  # an escaped quote


def test_a_number_at_its_bound_can_still_end(tmp_path):
    tokenizer = write_tiny_tokenizer(tmp_path)
    grammars = GrammarCompiler(tokenizer, TINY_VOCAB_SIZE, [ENDOFTEXT_ID])
    schema = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}
    constraint = grammars.constraint("json_schema", json.dumps(schema))
    for token in tokenizer.encode('{"n": ' + "9" * 19, add_special_tokens=False):
        assert constraint.consume_token(token)
    mask = np.zeros((1, -(-TINY_VOCAB_SIZE // 32)), np.int32)
    fill_bitmasks([(constraint, 0)], mask)
    words = mask[0].view(np.uint32)
    allowed = {tokenizer.decode([i]) for i in range(TINY_VOCAB_SIZE)
               if words[i // 32] >> (i % 32) & 1}
    assert allowed and not any(ch.isdigit() or "." in ch for ch in allowed), allowed
    assert {"e", "}"} <= allowed


def test_strings_without_max_length_get_one():
    schema = {"type": "object", "$defs": {"t": {"type": ["string", "null"]}},
              "properties": {"enum": {"type": "string"},  # a property named like a keyword
                             "short": {"type": "string", "maxLength": 3},
                             "choice": {"type": "string", "enum": ["a", "b"]},
                             "list": {"type": "array", "items": {"type": "string"}},
                             "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
              "required": ["enum"]}
    bounded = bounded_schema(schema)
    props = bounded["properties"]
    assert props["enum"]["maxLength"] == props["list"]["items"]["maxLength"] == \
        props["either"]["anyOf"][0]["maxLength"] == bounded["$defs"]["t"]["maxLength"] == \
        MAX_STRING_LENGTH
    assert props["short"]["maxLength"] == 3 and "maxLength" not in props["choice"]
    assert "maxLength" not in props["either"]["anyOf"][1] and bounded["required"] == ["enum"]


@pytest.mark.parametrize("kind", ["schema", "json_object"])
def test_a_string_ends_at_the_length_bound(tmp_path, kind):
    tokenizer = write_tiny_tokenizer(tmp_path)
    grammars = GrammarCompiler(tokenizer, TINY_VOCAB_SIZE, [ENDOFTEXT_ID])
    schema = ({"type": "object", "properties": {"s": {"type": "string"}}} if kind == "schema"
              else {"type": "object"})

    def takes(length):
        constraint = grammars.constraint("json_schema", json.dumps(schema))
        ids = tokenizer.encode('{"s": "' + "ab" * (length // 2) + '"}', add_special_tokens=False)
        return constraint.matcher.validate_tokens(ids) == len(ids)

    assert takes(MAX_STRING_LENGTH) and not takes(MAX_STRING_LENGTH + 2)


def test_objects_that_list_their_properties_take_no_others():
    schema = {"type": "object", "properties": {
        "closed": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "patterned": {"type": "object", "patternProperties": {"^x": {}}, "properties": {}},
        "free": {"type": "object"}}}
    bounded = bounded_schema(schema)
    props = bounded["properties"]
    assert bounded["additionalProperties"] is False
    assert props["closed"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["patterned"]
    assert "additionalProperties" not in props["free"]
