"""Local factories for tiny tokenizers and random HF checkpoints (tests, benchmarks, demo)."""

from sgl_jax.testing.checkpoints import (
    PRESETS,
    tiny_config,
    weight_shapes,
    write_noisy_copy,
    write_tiny_checkpoint,
)
from sgl_jax.testing.tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer

__all__ = [
    "PRESETS",
    "TINY_VOCAB_SIZE",
    "tiny_config",
    "weight_shapes",
    "write_noisy_copy",
    "write_tiny_checkpoint",
    "write_tiny_tokenizer",
]
