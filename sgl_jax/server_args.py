"""ServerArgs: every user-facing setting, validated once; subsystems read the parts they need."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sgl_jax.model_executor.forward_batch import EXTEND_Q_BLOCK
from sgl_jax.models.loader import DTYPE_CHOICES


@dataclass(frozen=True)
class ServerArgs:
    # Model
    model_path: str | None = None
    tokenizer_path: str | None = None  # default: model_path
    revision: str | None = None
    dtype: str = "auto"
    context_length: int | None = None  # default: the model's max_position_embeddings
    # KV cache
    page_size: int = 16
    max_total_tokens: int | None = None  # KV pool size in tokens; default from memory
    mem_fraction_static: float | None = None  # of device memory for weights + KV pool
    disable_radix_cache: bool = False
    # Scheduling
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048  # new tokens in one extend batch
    chunked_prefill_size: int = 2048  # new tokens of one request per batch; -1 = no limit
    precompile_token_paddings: tuple[int, ...] | None = None  # default: powers of two
    precompile_bs_paddings: tuple[int, ...] | None = None  # default: powers of two
    skip_server_warmup: bool = False
    attention_backend: str = "native"
    # Misc
    random_seed: int | None = None
    decode_log_interval: int = 40

    def __post_init__(self) -> None:
        for name in ("precompile_token_paddings", "precompile_bs_paddings"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(sorted(value)))
        self._validate()

    def _validate(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose from {DTYPE_CHOICES}")
        positive = ("page_size", "max_running_requests", "max_prefill_tokens",
                    "decode_log_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"chunked_prefill_size must be >= 1 or -1, got "
                             f"{self.chunked_prefill_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must hold at least "
                             f"two pages of page_size {self.page_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got "
                             f"{self.mem_fraction_static}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        for name in ("precompile_token_paddings", "precompile_bs_paddings"):
            value = getattr(self, name)
            if value is not None and (not value or min(value) < 1):
                raise ValueError(f"{name} must be a non-empty list of sizes >= 1, got {value}")
        tokens = self.precompile_token_paddings or ()
        if any(t % EXTEND_Q_BLOCK for t in tokens):
            raise ValueError(f"precompile_token_paddings must be multiples of {EXTEND_Q_BLOCK} "
                             f"(prefill chunks start on {EXTEND_Q_BLOCK}-token blocks), "
                             f"got {tokens}")

    @property
    def chunk_size(self) -> int:
        """New tokens of one request in one extend batch."""
        if self.chunked_prefill_size == -1:
            return self.max_prefill_tokens
        return min(self.chunked_prefill_size, self.max_prefill_tokens)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
