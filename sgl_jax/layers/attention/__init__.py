"""Attention backends: one interface (`AttentionBackend`), chosen by `--attention-backend`."""

import jax

from sgl_jax.layers.attention.flash import flash_attention
from sgl_jax.layers.attention.metadata import (
    AttentionBackend,
    AttentionMetadata,
    LayerKV,
    ModelCache,
)
from sgl_jax.layers.attention.native import native_attention

ATTENTION_BACKENDS: dict[str, AttentionBackend] = {"native": native_attention,
                                                   "fa": flash_attention}
# SGLang's GPU users pass `triton`; here that is the same Pallas backend as `fa`.
BACKEND_ALIASES = {"triton": "fa"}


def resolve_attention_backend(name: str | None, platform: str | None = None) -> str:
    """The backend a setting selects: the Pallas kernels by default on TPU and GPU, the jnp
    reference on CPU (where the kernels only run interpreted)."""
    if name is None:
        return "native" if (platform or jax.default_backend()) == "cpu" else "fa"
    name = BACKEND_ALIASES.get(name, name)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not available; choose from "
            f"{', '.join(sorted([*ATTENTION_BACKENDS, *BACKEND_ALIASES]))}"
        )
    return name


def get_attention_backend(name: str | None) -> AttentionBackend:
    return ATTENTION_BACKENDS[resolve_attention_backend(name)]


__all__ = ["AttentionBackend", "AttentionMetadata", "LayerKV", "ModelCache",
           "get_attention_backend", "resolve_attention_backend"]
