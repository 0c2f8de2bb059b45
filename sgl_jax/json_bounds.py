"""Bounds that make every JSON output end, whatever the model prefers to write.

A JSON grammar lets a number or a string grow forever, and a small model at temperature 0
takes that road (`"population": 1111111111...` until max_tokens). Two bounds close it:

- Strings: a string schema without `maxLength` gets `MAX_STRING_LENGTH`, and free values
  (`json_object`'s) are strings of at most that length too; the schema rewrite is exact,
  llguidance enforces it.
- Keys: an object schema that lists its properties takes no others unless it says so
  (`additionalProperties`), as OpenAI's strict mode and xgrammar (SGLang's and vLLM's
  default) read such schemas: a small model otherwise invents keys until max_tokens.
- Numbers: JSON schema has no keyword for a number's digits, so the host checks them. The
  integer part holds at most `MAX_INTEGER_DIGITS` (every int64), a number with a fraction at
  most `MAX_SIGNIFICANT_DIGITS` significant digits (float64's precision: its shortest repr
  never needs more) after at most `MAX_LEADING_ZEROS` zeros, and an exponent at most
  `MAX_EXPONENT_DIGITS` digits (float64 ends at 1e308). `NumberBounds` follows the output's
  bytes and removes the tokens that would pass a bound from a grammar's mask; a number at a
  bound can still end, so the mask never empties.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_STRING_LENGTH = 8192  # characters
MAX_INTEGER_DIGITS = 19
MAX_SIGNIFICANT_DIGITS = 17
MAX_LEADING_ZEROS = 20  # fraction zeros before the first significant digit
MAX_EXPONENT_DIGITS = 3

_FREE_VALUE = "sgl_jax_bounded_value"
# An object schema with one of these decides itself which other keys it takes.
_OPEN_OBJECT_KEYWORDS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}


def bounded_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with MAX_STRING_LENGTH on each string schema that has no maxLength, and each
    object schema that lists its properties closed to others unless it says otherwise."""
    if not isinstance(schema, dict):
        return schema
    bounded = {key: _bounded_part(key, value) for key, value in schema.items()}
    if "properties" in schema and not _OPEN_OBJECT_KEYWORDS & schema.keys():
        bounded["additionalProperties"] = False
    types = schema.get("type")
    if ("string" == types or isinstance(types, list) and "string" in types) and \
            "maxLength" not in schema and "enum" not in schema and "const" not in schema:
        bounded["maxLength"] = MAX_STRING_LENGTH
    return bounded


def _bounded_part(key: str, value: Any) -> Any:
    if key in ("enum", "const", "default", "examples", "required", "x-guidance"):
        return value  # values, not schemas
    if isinstance(value, dict):
        if key in ("properties", "patternProperties", "$defs", "definitions"):
            return {name: bounded_schema(sub) for name, sub in value.items()}
        return bounded_schema(value)
    if isinstance(value, list):
        return [bounded_schema(sub) for sub in value]
    return value


def bounded_any_object() -> dict[str, Any]:
    """Any JSON object, its strings at most MAX_STRING_LENGTH long (json_object's grammar)."""
    value = {"$ref": f"#/$defs/{_FREE_VALUE}"}
    return {"$defs": {_FREE_VALUE: {"anyOf": [
        {"type": "null"}, {"type": "boolean"}, {"type": "number"},
        {"type": "string", "maxLength": MAX_STRING_LENGTH},
        {"type": "array", "items": value},
        {"type": "object", "additionalProperties": value}]}},
        "type": "object", "additionalProperties": value}


# ---------------------------------------------------------------------- numbers

# Lexer states, as tuples so a tree walk can branch them for free:
#   (OUTSIDE, at_value)                        at_value: a value may start here
#   (IN_STRING, escaped)
#   (IN_NUMBER, part, integer_digits, significant, leading_zeros, exponent_digits)
OUTSIDE, IN_STRING, IN_NUMBER = 0, 1, 2
INTEGER, FRACTION, EXPONENT = 0, 1, 2
START = (OUTSIDE, True)
_DIGITS = frozenset(b"0123456789")


class NumberBounds:
    """Follows one output's bytes and bans the tokens that would carry a JSON number past
    its bounds. Token texts come from the vocabulary (`texts[id]`: bytes)."""

    def __init__(self, texts: Sequence[bytes]):
        self.texts = texts
        # Only a token with a digit or a point can pass a bound.
        self.number_tokens = np.array(
            [i for i, text in enumerate(texts) if _DIGITS & set(text) or b"." in text],
            np.int64)

    def advance(self, state: tuple, token: int) -> tuple | None:
        """The state after `token`, or None if the token passes a bound."""
        for byte in self.texts[token]:
            state = _step(state, byte)
            if state is None:
                return None
        return state

    def restrict(self, state: tuple, mask: np.ndarray) -> None:
        """Clear from `mask` (i32[ceil(V / 32)], a grammar's allowed ids) the tokens that
        would pass a bound, while the output is inside a number."""
        if state[0] != IN_NUMBER:
            return  # one token never holds enough digits to pass a bound from outside
        words = mask.view(np.uint32)
        ids = self.number_tokens
        allowed = ids[(words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1]
        for token in allowed:
            if self.advance(state, int(token)) is None:
                words[token >> 5] &= ~np.uint32(1 << (int(token) & 31))


def _step(state: tuple, byte: int) -> tuple | None:
    kind = state[0]
    if kind == IN_STRING:
        if state[1]:
            return (IN_STRING, False)
        return (OUTSIDE, False) if byte == 0x22 else (IN_STRING, byte == 0x5C)
    if kind == IN_NUMBER:
        continued = _number_step(state, byte)
        if continued is not False:
            return continued
        state = (OUTSIDE, False)  # the byte ends the number
    if byte == 0x22:
        return (IN_STRING, False)
    if byte in b" \t\r\n":
        return state
    if state[1] and (byte in _DIGITS or byte == 0x2D):
        start = (IN_NUMBER, INTEGER, 0, 0, 0, 0)
        return start if byte == 0x2D else _number_step(start, byte)
    return (OUTSIDE, byte in b":[,")


def _number_step(state: tuple, byte: int) -> tuple | None | bool:
    """The number's next state; None past a bound; False if the byte is not the number's."""
    _, part, integer, significant, zeros, exponent = state
    if byte in _DIGITS:
        if part == EXPONENT:
            if exponent == MAX_EXPONENT_DIGITS:
                return None
            return (IN_NUMBER, part, integer, significant, zeros, exponent + 1)
        counts = byte != 0x30 or significant > 0
        if part == INTEGER:
            if integer == MAX_INTEGER_DIGITS:
                return None
            return (IN_NUMBER, part, integer + 1, significant + counts, zeros, exponent)
        if not counts:
            return None if zeros == MAX_LEADING_ZEROS else (
                IN_NUMBER, part, integer, significant, zeros + 1, exponent)
        if significant >= MAX_SIGNIFICANT_DIGITS:
            return None
        return (IN_NUMBER, part, integer, significant + 1, zeros, exponent)
    if byte == 0x2E and part == INTEGER:  # '.': only where a fraction digit may follow
        if significant >= MAX_SIGNIFICANT_DIGITS:
            return None
        return (IN_NUMBER, FRACTION, integer, significant, zeros, exponent)
    if byte in b"eE" and part != EXPONENT:
        return (IN_NUMBER, EXPONENT, integer, significant, zeros, 0)
    if byte in b"+-" and part == EXPONENT and exponent == 0:
        return state
    return False
