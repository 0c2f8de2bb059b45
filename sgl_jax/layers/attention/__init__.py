"""Attention backends: one interface (`AttentionBackend`), chosen by `--attention-backend`."""

from sgl_jax.layers.attention.metadata import AttentionBackend, AttentionMetadata, LayerKV
from sgl_jax.layers.attention.native import native_attention

ATTENTION_BACKENDS: dict[str, AttentionBackend] = {"native": native_attention}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not available; choose from "
            f"{', '.join(sorted(ATTENTION_BACKENDS))}"
        )
    return ATTENTION_BACKENDS[name]


__all__ = ["AttentionBackend", "AttentionMetadata", "LayerKV", "get_attention_backend"]
