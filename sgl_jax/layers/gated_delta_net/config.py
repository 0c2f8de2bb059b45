"""The shapes of a Gated DeltaNet layer (`GdnConfig`) and of its per-sequence state."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Params = dict[str, Any]


@dataclass(frozen=True)
class GdnConfig:
    """The shapes of one Gated DeltaNet layer; hashable so jitted functions can close over it."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_key_heads})"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {self.conv_kernel}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> GdnConfig:
        """From a Qwen3-Next `config.json`."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r}: the conv supports only silu")
        return cls(
            hidden_size=hf["hidden_size"],
            num_key_heads=hf["linear_num_key_heads"],
            num_value_heads=hf["linear_num_value_heads"],
            key_head_dim=hf["linear_key_head_dim"],
            value_head_dim=hf["linear_value_head_dim"],
            conv_kernel=hf.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        )

    @property
    def ratio(self) -> int:
        """Value heads per key head."""
        return self.num_value_heads // self.num_key_heads

    @property
    def group_channels(self) -> int:
        """Conv channels per key head: q, k and its r value heads."""
        return 2 * self.key_head_dim + self.ratio * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return self.num_key_heads * self.group_channels

    @property
    def group_rows(self) -> int:
        """Rows of w_in per key head: q | k | v | z | b | a."""
        return self.group_channels + self.ratio * (self.value_head_dim + 2)


class GdnState(NamedTuple):
    """The cache of one layer; leading batch (and node) axes as the caller stacks them."""

    conv: jax.Array  # [..., K-1, conv_dim]: the last K-1 conv inputs, oldest first, in x.dtype
    ssm: jax.Array  # f32[..., Hv, dk, dv]


def state_shapes(config: GdnConfig, dtype: Any) -> GdnState:
    """One request's state in one layer, as ShapeDtypeStructs (conv window in the activation
    dtype, S in float32)."""
    return GdnState(
        conv=jax.ShapeDtypeStruct((config.conv_kernel - 1, config.conv_dim), jnp.dtype(dtype)),
        ssm=jax.ShapeDtypeStruct(
            (config.num_value_heads, config.key_head_dim, config.value_head_dim), jnp.float32
        ),
    )


def state_bytes(config: GdnConfig, dtype: Any) -> int:
    """Bytes of one request's state in one layer."""
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in state_shapes(config, dtype))


def zero_state(config: GdnConfig, batch: int, dtype: Any) -> GdnState:
    """A fresh state for `batch` sequences: GdnState [batch, ...] of zeros."""
    return GdnState(*(jnp.zeros((batch, *s.shape), s.dtype) for s in state_shapes(config, dtype)))
