"""Reasoning parsers: whole-text splitting against a regular-expression oracle, and streamed
splitting (any chunking) equal to the whole-text result."""

import random
import re

import pytest

from sgl_jax.tokenizer.reasoning import ReasoningParser

CASES = [
    "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.",
    "<think>short</think>answer",
    "  <think>leading blank</think>\n answer with </think> inside",
    "<think>never closed, generation stopped here",
    "no reasoning at all, just an answer",
    "an answer that mentions <think> later",
    "",
    "<thi",
    "reasoning without an opening tag</think>\n\nanswer",
]


def oracle(text: str, style: str) -> tuple[str, str]:
    """Direct rules: qwen3 needs an opening tag; deepseek-r1 starts inside the block."""
    body = text.lstrip()
    if body.startswith("<think>"):
        body = body[len("<think>"):]
    elif style == "qwen3":
        return "", text
    match = re.match(r"(?s)(.*?)</think>(.*)", body)
    if match is None:
        return body if body or style == "deepseek-r1" else "", "" if body else text
    return match.group(1), match.group(2).lstrip()


@pytest.mark.parametrize("style", ["qwen3", "deepseek-r1"])
@pytest.mark.parametrize("text", CASES)
def test_whole_text_matches_the_oracle(style, text):
    assert ReasoningParser(style).parse(text) == oracle(text, style)


@pytest.mark.parametrize("style", ["qwen3", "deepseek-r1"])
@pytest.mark.parametrize("text", CASES)
def test_any_chunking_streams_the_same_split(style, text):
    rng = random.Random(len(text))
    for _ in range(20):
        parser = ReasoningParser(style)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        reasoning, content = "", ""
        for piece in pieces:
            r, c = parser.feed(piece)
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert (reasoning + r, content + c) == oracle(text, style)


def test_partial_tags_are_held_back_until_decided():
    parser = ReasoningParser("qwen3")
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>step one</th") == ("step one", "")
    assert parser.feed("ink>\n\nDone") == ("", "Done")


def test_unknown_style():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("gpt-oss")
