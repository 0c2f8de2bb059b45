"""ServerArgs: every user-facing setting, validated once; subsystems read the parts they need."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_jax.models.loader import DTYPE_CHOICES

DEFAULT_MAX_TOTAL_TOKENS = 16384


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None  # default: model_path
    revision: str | None = None
    dtype: str = "auto"
    page_size: int = 16
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS  # size of the KV pool, in tokens
    context_length: int | None = None  # default: the model's max_position_embeddings
    attention_backend: str = "native"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose from {DTYPE_CHOICES}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens < 2 * self.page_size:
            raise ValueError(
                f"max_total_tokens ({self.max_total_tokens}) must hold at least two pages of "
                f"page_size {self.page_size}"
            )
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size
