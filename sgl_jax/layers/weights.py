"""The parameters the layers define: how a checkpoint tensor maps into a model's parameter
pytree, and the logical axes of every parameter (which `sgl_jax.parallel` maps onto a device
mesh). Here, below the models and the mesh, so that a layer can name its own tensors and
`parallel` can split them without importing a model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FusedPart:
    """Where a checkpoint tensor lands inside a fused parameter (e.g. k_proj inside q|k|v):
    reshaped to `view`, its axes reordered by `axes` when given (a transpose), then written
    at `index` of the parameter of shape `param_shape`."""

    param_shape: tuple[int, ...]
    view: tuple[int, ...]
    index: tuple[slice | int, ...]
    axes: tuple[int, ...] | None = None

    def write(self, param: np.ndarray, tensor: np.ndarray) -> None:
        view = tensor.reshape(self.view)
        param[self.index] = view if self.axes is None else view.transpose(self.axes)

    def read(self, param: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The checkpoint tensor of this part, shaped `shape`, back out of the parameter."""
        view = param[self.index]
        if self.axes is not None:
            view = view.transpose(np.argsort(self.axes))
        return view.reshape(shape)


@dataclass(frozen=True)
class WeightSpec:
    path: tuple[str | int, ...]  # where the tensor goes in the parameter pytree
    shape: tuple[int, ...]  # its shape in the checkpoint (PyTorch layout, [out, in])
    part: FusedPart | None = None  # None when the tensor is the whole parameter
    integer: bool = False  # an index table (e.g. an EAGLE3 draft's d2t), loaded as int32


def checkpoint_tensors(params: dict, specs: dict[str, WeightSpec]) -> dict[str, np.ndarray]:
    """The inverse of loading: each spec's tensor, by checkpoint name, out of a parameter
    pytree (host or device arrays; rows padded in for sharding are cut off)."""
    tensors = {}
    for name, spec in specs.items():
        param = params
        for key in spec.path:
            param = param[key]
        param = np.asarray(param)
        if spec.part is not None:
            tensors[name] = spec.part.read(param, spec.shape)
        else:
            tensors[name] = param[tuple(slice(0, n) for n in spec.shape)]
    return tensors


# Logical axes of each parameter, by its name in the pytree; names not listed are replicated.
# "vocab": rows of a token table; "kv_heads": groups of a fused q|k|v projection, one per KV
# head (its q heads, then its k and v); "heads": the q-head features an output projection
# reads; "mlp": the intermediate features (of the dense MLP, of every routed expert, of a
# shared expert); "experts": the expert index of a mixture-of-experts layer's expert stacks;
# "linear_heads": the key heads of a Gated DeltaNet layer (each with its q, k, value heads, z,
# b, a rows and conv channels; value heads numbered key-head-major, so dt_bias, A_log and
# out_proj's input features split the same way).
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", None),
    "lm_head": ("vocab", None),
    "w_qkv": ("kv_heads", None, None),
    "b_qkv": ("kv_heads", None),
    "w_o": (None, "heads"),
    "w_gate_up": ("mlp", None, None),
    "b_gate_up": ("mlp", None),
    "w_down": (None, "mlp"),
    "w_expert_gate_up": ("experts", "mlp", None, None),
    "w_expert_down": ("experts", None, "mlp"),
    "w_shared_gate_up": ("mlp", None, None),
    "w_shared_down": (None, "mlp"),
    "w_in": ("linear_heads", None, None),
    "conv_w": ("linear_heads", None, None),
    "dt_bias": ("linear_heads",),
    "a_log": ("linear_heads",),
    "w_out": (None, "linear_heads"),
}
