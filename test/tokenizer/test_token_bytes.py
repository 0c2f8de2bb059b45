"""Token bytes concatenate to the text's UTF-8, even where a token holds part of a character."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sgl_jax.testing.tokenizer import IM_END, write_tiny_tokenizer
from sgl_jax.tokenizer.token_bytes import TokenBytes, vocabulary_kind

REPLACEMENT = "\ufffd".encode()
TEXT = "héllo 😀 日本"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 style: "▁" for spaces, <0xNN> pieces for bytes outside the vocabulary."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", *"helo"]
    model = models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                       byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                           decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def test_byte_level_tokens_give_their_own_bytes(byte_level):
    ids = byte_level(TEXT + IM_END, add_special_tokens=False).input_ids
    token_bytes = TokenBytes(byte_level)
    assert vocabulary_kind(byte_level) == "byte_level"
    assert b"".join(token_bytes(i) for i in ids) == (TEXT + IM_END).encode()
    # The case decoding alone gets wrong: a token that is only part of a character.
    partial = [i for i in ids if byte_level.decode([i]).endswith("\ufffd")]
    assert partial and all(REPLACEMENT not in token_bytes(i) for i in partial)


def test_sentencepiece_byte_pieces_give_the_byte_they_name():
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    token_bytes = TokenBytes(tokenizer)
    assert vocabulary_kind(tokenizer) == "sentencepiece"
    assert tokenizer.convert_ids_to_tokens(ids[-1]).startswith("<0x")
    assert b"".join(token_bytes(i) for i in ids) == f" {TEXT}".encode()  # "▁" is a space
