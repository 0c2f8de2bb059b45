"""Tokenizers come from transformers (AutoTokenizer, or for a converted GGUF the class it
was built with), so chat templates are the model's own."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str | Path, *, revision: str | None = None,
                   trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A GGUF file's converted tokenizer (models/gguf.py builds transformers' generic fast
    tokenizer) loads as that class directly: AutoTokenizer would first load the model's
    config class, whose module imports torch, about 4 s of a server's start on a CPU."""
    from sgl_jax.models.gguf import is_metadata_dir

    try:
        if is_metadata_dir(path):
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(path), revision=revision,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"could not load a tokenizer from {str(path)!r}: {exc}") from exc
