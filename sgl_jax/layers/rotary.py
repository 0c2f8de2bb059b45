"""Rotary position embeddings (the rotate-half convention of Hugging Face checkpoints)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only: frequencies between these wavelengths are smoothly interpolated.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, hf: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
        """From a `config.json` in either spelling: the hub's `rope_theta` + `rope_scaling`
        or the `rope_parameters` block that transformers >= 5 writes."""
        params = dict(hf.get("rope_parameters") or {})
        params.update(hf.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        theta = hf.get("rope_theta", params.get("rope_theta", default_theta))
        known = {f.name for f in dataclasses.fields(cls)} - {"theta", "rope_type"}
        extra = {k: v for k, v in params.items() if k in known}
        return cls(theta=float(theta), rope_type=rope_type, **extra)


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> np.ndarray:
    """f32[rotary_dim // 2]: the angle per position of each rotated pair."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / rope.theta**exponents
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    return inv_freq.astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    # Llama-3.1: long wavelengths are divided by `factor`, short ones kept, and the band
    # between the two cut-offs blends linearly in 1/wavelength.
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions: i32[T] -> (cos, sin): f32[T, rotary_dim]."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, heads, head_dim], cos/sin: f32[T, rotary_dim] -> [T, heads, head_dim].

    With rotary_dim < head_dim (partial rotary, Qwen3-Next) only the first rotary_dim
    features turn, in the rotate-half layout over those features (pairs i and
    i + rotary_dim / 2), and the rest pass through, as transformers does."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        turned = apply_rope(x[..., :rotary_dim], cos, sin)
        return jnp.concatenate([turned, x[..., rotary_dim:]], axis=-1)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
