"""Grammar-constrained decoding with llguidance: JSON schemas, regular expressions and EBNF.

A constrained request holds a matcher on the host. Before each step that samples its next
token, the matcher writes the bitmask of the ids its grammar allows (a row of
`SamplingBatch.allowed`); the device sets every other logit to -inf before sampling; the token
drawn then advances the matcher. Grammars compile on the caller's thread, never the engine's,
and compiled grammars are cached: a request copies a cached matcher instead of compiling.
JSON output is bounded so that it always ends (sgl_jax.json_bounds).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from sgl_jax.json_bounds import START, NumberBounds, bounded_any_object, bounded_schema

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
ANY_OBJECT = {"type": "object"}
ANY_JSON_OBJECT = json.dumps(ANY_OBJECT)
CACHE_SIZE = 128  # compiled grammars kept
# JSON is written as Python's json.dumps writes it, one space after ',' and ':' and no other
# whitespace: free whitespace lets a small model pad forever (xgrammar's default is the same).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that does not compile; the message names the field and the problem."""


class Constraint:
    """One request's grammar: its llguidance matcher and, where the output is JSON, the
    bounds on its numbers, both advanced by each token the request commits."""

    def __init__(self, matcher: Any, numbers: NumberBounds | None):
        self.matcher = matcher
        self.numbers = numbers
        self.number_state = START

    def consume_token(self, token: int) -> bool:
        """Advance past a committed token; False if the grammar cannot take it."""
        if self.numbers is not None:
            # A token past a bound was masked out; should one be forced, follow it anyway.
            self.number_state = self.numbers.advance(self.number_state, token) or START
        return self.matcher.consume_token(token)

    def is_error(self) -> bool:
        return self.matcher.is_error()

    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def restrict(self, mask: np.ndarray, state: tuple | None = None) -> None:
        """Remove from `mask` (i32[W]) the tokens that would pass a JSON bound after the
        output so far (or at `state`, further down a draft path)."""
        if self.numbers is not None:
            self.numbers.restrict(self.number_state if state is None else state, mask)


class GrammarCompiler:
    """Compiles (kind, text) grammars against one tokenizer and hands out fresh matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._tokenizer = None  # llguidance's view of the vocabulary, built on first use
        self._numbers: NumberBounds | None = None  # the vocabulary's number tokens, likewise
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, kind: str, text: str) -> Constraint:
        """A fresh Constraint at the grammar's start; GrammarError if the grammar is invalid.
        JSON schemas, and Lark grammars that embed one (`%json`), get the number bounds."""
        matcher = self.matcher(kind, text)
        writes_json = kind == "json_schema" or kind == "ebnf" and "%json" in text
        return Constraint(matcher, self._number_bounds() if writes_json else None)

    def matcher(self, kind: str, text: str) -> Any:
        """A matcher at the grammar's start (an llguidance LLMatcher); GrammarError if the
        grammar is invalid."""
        key = (kind, text)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled.deep_copy()
        compiled = self._compile(kind, text)  # outside the lock: it may take a while
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, kind: str, text: str) -> Any:
        import llguidance

        grammar = _llguidance_grammar(kind, text)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._llguidance_tokenizer())
        if failed:
            raise GrammarError(f"invalid {kind}: {messages[0].strip()}")
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {kind}: {matcher.get_error()}")
        return matcher

    def _number_bounds(self) -> NumberBounds:
        tokenizer = self._llguidance_tokenizer()
        with self._lock:
            if self._numbers is None:
                self._numbers = NumberBounds(
                    [tokenizer.decode_bytes([i]) for i in range(self.vocab_size)])
            return self._numbers

    def _llguidance_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_ids)
            return self._tokenizer


def _llguidance_grammar(kind: str, text: str) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if not isinstance(text, str) or not text:
        raise GrammarError(f"{kind} must be a non-empty string")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError("json_schema must be a JSON object")
        schema = bounded_any_object() if schema == ANY_OBJECT else bounded_schema(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "ebnf":
        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
        except Exception as exc:  # the converter raises bare Exceptions on bad input
            raise GrammarError(f"invalid ebnf: {exc}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}; choose from {GRAMMAR_KINDS}")


_executor = None  # llguidance's thread pool for filling many masks at once


def fill_bitmasks(rows: list[tuple[Constraint, int]], out: np.ndarray) -> None:
    """For each (constraint, row), write the ids the constraint allows next into out[row]
    (out: i32[B, ceil(V / 32)], contiguous); the grammars fill their rows in parallel."""
    global _executor
    import llguidance
    import llguidance.numpy

    if _executor is None:
        _executor = llguidance.LLExecutor()
    llguidance.numpy.fill_next_token_bitmask_par(
        _executor, [(constraint.matcher, row) for constraint, row in rows], out)
    for constraint, row in rows:
        constraint.restrict(out[row])


def fill_tree_bitmasks(constraint: Constraint, tokens: np.ndarray, parents: np.ndarray,
                       out: np.ndarray) -> None:
    """For one draft tree (tokens, parents: i32[N], node 0 the root, whose token the
    constraint has consumed), write into out[i] (i32[N, W]) the ids the grammar allows after
    node i's path. The matcher is walked down each path and rolled back, so it ends where it
    started. A node whose path the grammar forbids gets every id: verification never reaches
    it (its token has no mass at a masked parent), and its row stays a finite distribution."""
    import llguidance.numpy

    matcher = constraint.matcher
    for node in range(len(tokens)):
        path = _path_tokens(tokens, parents, node)
        state = _number_state_after(constraint, path)
        if state is None or matcher.validate_tokens(path) < len(path):
            out[node] = -1
            continue
        matcher.consume_tokens(path)
        llguidance.numpy.fill_next_token_bitmask(matcher, out, node)
        matcher.rollback(len(path))
        constraint.restrict(out[node], state)


def _number_state_after(constraint: Constraint, path: list[int]) -> tuple | None:
    """The number bounds' state after `path` (None if the path passes a bound)."""
    state = constraint.number_state
    if constraint.numbers is not None:
        for token in path:
            state = constraint.numbers.advance(state, token)
            if state is None:
                return None
    return state


def _path_tokens(tokens: np.ndarray, parents: np.ndarray, node: int) -> list[int]:
    """The tokens from the root's child down to `node` (empty for the root)."""
    path = []
    while node > 0:
        path.append(int(tokens[node]))
        node = int(parents[node])
    return path[::-1]


def allow_eos_at_dead_ends(masks: np.ndarray, eos_ids: Iterable[int]) -> None:
    """Masks (one i32[W] row, or rows i32[N, W]) that allow no id belong to a grammar at a
    dead end: let EOS end the output there (the request then finishes with grammar_error)."""
    words = np.atleast_2d(masks)  # a view, so the bits land in `masks`
    for row in np.flatnonzero(~words.any(axis=1)):
        set_bits(words[row], eos_ids)


def set_bits(row: np.ndarray, ids: Iterable[int]) -> None:
    """Allow `ids` in a bitmask row (i32[ceil(V / 32)])."""
    words = row.view(np.uint32)
    for i in ids:
        words[i // 32] |= np.uint32(1 << (i % 32))
