"""The checkpoint's tensors of a linear-attention block and where they go in the layer's
parameters."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sgl_jax.layers.gated_delta_net.config import GdnConfig
from sgl_jax.layers.weights import FusedPart, WeightSpec


def linear_attn_specs(
    config: GdnConfig, prefix: str, path: tuple[str | int, ...]
) -> dict[str, WeightSpec]:
    """The tensors of the linear-attention block of the decoder layer named `prefix`
    (e.g. "model.layers.0."), placed under `path` in the parameter pytree."""
    h, nk, nv, r = config.hidden_size, config.num_key_heads, config.num_value_heads, config.ratio
    dk, dv, k = config.key_head_dim, config.value_head_dim, config.conv_kernel
    rows, qkvz = config.group_rows, 2 * dk + 2 * r * dv
    w_in = (nk, rows, h)
    name = prefix + "linear_attn."
    return {
        name + "in_proj_qkvz.weight": WeightSpec(
            (*path, "w_in"), (nk * qkvz, h),
            FusedPart(w_in, (nk, qkvz, h), (slice(None), slice(0, qkvz))),
        ),
        name + "in_proj_ba.weight": WeightSpec(
            (*path, "w_in"), (nk * 2 * r, h),
            FusedPart(w_in, (nk, 2 * r, h), (slice(None), slice(qkvz, rows))),
        ),
        name + "conv1d.weight": WeightSpec(
            (*path, "conv_w"), (config.conv_dim, 1, k),
            ConvChannels(
                param_shape=(nk, config.group_channels, k), view=(config.conv_dim, k),
                index=(), key_head_dim=dk,
            ),
        ),
        name + "dt_bias": WeightSpec((*path, "dt_bias"), (nv,)),
        name + "A_log": WeightSpec((*path, "a_log"), (nv,)),
        name + "norm.weight": WeightSpec((*path, "norm"), (dv,)),
        name + "out_proj.weight": WeightSpec((*path, "w_out"), (h, nv * dv)),
    }


@dataclass(frozen=True)
class ConvChannels(FusedPart):
    """conv1d.weight, whose channels are q | k | v each over all heads, regrouped into
    conv_w [nk, Cg, K] with each key head's q | k | v channels together (`view` is the
    checkpoint's [conv_dim, K]; `index` is unused)."""

    key_head_dim: int = 0  # a default only because the base class's last fields have one

    def write(self, param: np.ndarray, tensor: np.ndarray) -> None:
        nk, dk = self.param_shape[0], self.key_head_dim
        flat = tensor.reshape(self.view)
        q, k, v = flat[: nk * dk], flat[nk * dk : 2 * nk * dk], flat[2 * nk * dk :]
        param[...] = np.concatenate([x.reshape(nk, -1, flat.shape[-1]) for x in (q, k, v)], 1)

    def read(self, param: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        dk, taps = self.key_head_dim, param.shape[-1]
        parts = (param[:, :dk], param[:, dk : 2 * dk], param[:, 2 * dk :])
        return np.concatenate([x.reshape(-1, taps) for x in parts]).reshape(shape)
