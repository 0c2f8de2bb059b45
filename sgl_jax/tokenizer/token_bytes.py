"""Each vocabulary token's own bytes, for the `bytes` field of OpenAI chat logprobs.

Decoding one token that holds only part of a UTF-8 character (an emoji's first byte, say)
gives U+FFFD; OpenAI reports the token's raw bytes instead, so that the `bytes` of consecutive
tokens concatenate to the UTF-8 encoding of the text.
"""

from __future__ import annotations

import json
import re

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Byte-level BPE (GPT-2, Llama 3, Qwen) spells every byte as one printable character.
_BYTE_DECODER = {char: byte for byte, char in bytes_to_unicode().items()}
_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # byte-fallback pieces
_SENTENCEPIECE_SPACE = "\u2581"  # "▁"


class TokenBytes:
    """token id -> its bytes; cached, as every logprobs response looks tokens up."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self._tokenizer = tokenizer
        # Added and special tokens are stored as written, never in the byte alphabet.
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._kind = vocabulary_kind(tokenizer)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id past the tokenizer's vocabulary (model padding)
            return b""
        if self._kind == "byte_level" and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if self._kind == "sentencepiece":
            byte = _SENTENCEPIECE_BYTE.fullmatch(piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            return piece.replace(_SENTENCEPIECE_SPACE, " ").encode()
        return self._tokenizer.decode([token_id]).encode()


def vocabulary_kind(tokenizer: PreTrainedTokenizerBase) -> str:
    """'byte_level', 'sentencepiece' or 'other', read from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = backend.decoder if backend is not None else None
    if decoder is None:
        return "other"
    state = json.loads(decoder.__getstate__())
    types = {step["type"] for step in state.get("decoders", [state])}
    if "ByteLevel" in types:
        return "byte_level"
    if types & {"ByteFallback", "Metaspace"}:
        return "sentencepiece"
    return "other"
