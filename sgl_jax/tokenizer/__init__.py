"""Tokenizers come from transformers' AutoTokenizer, so chat templates are the model's own."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path, *, revision: str | None = None,
                   trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(path), revision=revision,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"could not load a tokenizer from {str(path)!r}: {exc}") from exc
