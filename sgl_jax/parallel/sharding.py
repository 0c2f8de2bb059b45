"""Tensor parallelism: the logical axes the layers name (`layers.weights.LOGICAL_AXES`) mapped
onto the mesh, and the few places where the model's arrays meet it. Which sizes a model can
be split by is the model's to say (`models.config.check_tensor_parallel`).

Megatron-style: q/k/v and gate/up are split by output (column-parallel), o and down by input
(row-parallel, so XLA adds one all-reduce after each), embedding and lm_head by vocabulary
rows; mixture-of-experts layers split each expert the same way and replicate the router.
Attention runs per device on its own heads (`shard_map`), with the KV cache split by KV
head. A model with fewer KV heads than devices gets one copy of a KV head per device: each
device's q heads read the copy it holds, so attention never communicates. Gated DeltaNet
layers likewise run per device on their own key heads, with the recurrent-state pool split
by them, and out_proj's partial outputs are summed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax.layers.attention import AttentionBackend
from sgl_jax.layers.gated_delta_net import GdnState
from sgl_jax.layers.quantization import QuantizedWeight
from sgl_jax.layers.weights import LOGICAL_AXES
from sgl_jax.parallel.mesh import DP_AXIS, TP_AXIS, make_mesh

# Logical axis -> mesh axis; axes not named here are replicated. Mixture-of-experts layers
# split every expert's intermediate features ("mlp") and keep the expert axis whole: each
# device holds 1/tp of every expert, routes every token itself (the router is replicated) and
# does the same amount of work whatever the routing; down's partial sums are all-reduced as in
# the dense MLP. (Mapping "experts" instead would hold whole experts per device.)
MESH_AXES = {"vocab": TP_AXIS, "kv_heads": TP_AXIS, "heads": TP_AXIS, "mlp": TP_AXIS,
             "experts": None, "linear_heads": TP_AXIS}
_HEADS = P(None, TP_AXIS, None)  # q/k/v and attention output [T, heads, hd]
_PAGES = P(None, TP_AXIS, None, None)  # KV pages [num_pages, kv_heads, page_size, hd]
# A linear layer's state pool: windows [S, K-1, conv_dim] (channels key-head-major) and
# delta-rule states [S, Hv, dk, dv], both split by key head.
_STATE = GdnState(conv=P(None, None, TP_AXIS), ssm=P(None, TP_AXIS, None, None))
_VOCAB_TABLES = ("embed", "lm_head")
_QKV = ("w_qkv", "b_qkv")


@dataclass(frozen=True)
class TensorParallel:
    mesh: Mesh

    @classmethod
    def of_size(cls, tp_size: int = 1, devices: list[jax.Device] | None = None,
                dp_size: int = 1) -> TensorParallel:
        return cls(make_mesh(tp_size, devices, dp_size))

    @property
    def size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    @property
    def dp_size(self) -> int:
        """Data-parallel groups (training only; serving meshes have one)."""
        return self.mesh.shape.get(DP_AXIS, 1)

    def batch_sharding(self) -> NamedSharding:
        """Arrays [B, ...] whose rows split over the data-parallel axis."""
        return NamedSharding(self.mesh, P(DP_AXIS if self.dp_size > 1 else None))

    def kv_heads(self, num_kv_heads: int) -> int:
        """KV heads in the cache: the model's, or one copy per device when it has fewer."""
        return max(num_kv_heads, self.size)

    # ------------------------------------------------------------------ parameters

    def shard_params(self, host: dict[tuple, np.ndarray], *, head_dim: int
                     ) -> dict[tuple, jax.Array]:
        """Host arrays (by pytree path) -> arrays on the mesh; each device receives only its
        own shard. `head_dim` locates k and v in a fused q|k|v copied once per device (a
        model with fewer KV heads than devices)."""
        out = {}
        for path, array in host.items():
            name = path[-1]
            array = jax.tree.map(lambda a, name=name: self._adapt(name, a, head_dim), array)
            specs = param_spec(name, array)
            out[path] = jax.device_put(
                array, jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs,
                                    is_leaf=lambda x: isinstance(x, P)))
        return out

    def _adapt(self, name: str, array: np.ndarray, head_dim: int) -> np.ndarray:
        if name in _QKV and array.shape[0] < self.size:
            return copy_kv_heads(array, self.size // array.shape[0], head_dim)
        if name in _VOCAB_TABLES and array.shape[0] % self.size:
            rows = -array.shape[0] % self.size  # never looked up, cut from the logits
            return np.concatenate([array, np.zeros((rows, *array.shape[1:]), array.dtype)])
        return array

    # ------------------------------------------------------------------ caches and state

    def kv_pages(self, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        """Zeroed pages [num_pages, kv_heads, page_size, hd], created already split."""
        return _zeros(shape, jnp.dtype(dtype), NamedSharding(self.mesh, _PAGES))

    def state_pool(self, shapes: GdnState) -> GdnState:
        """A zeroed recurrent-state pool (ShapeDtypeStructs with the slot axis first), created
        already split by key head."""
        return GdnState(*(_zeros(s.shape, jnp.dtype(s.dtype), NamedSharding(self.mesh, spec))
                          for s, spec in zip(shapes, _STATE, strict=True)))

    def put_replicated(self, tree: Any) -> Any:
        """Arrays -> the same values on every device of the mesh (through the host, which
        every process can do for its own devices)."""
        host = jax.tree.map(np.asarray, tree)
        return jax.device_put(host, NamedSharding(self.mesh, P()))

    def constrain_replicated(self, tree: Any) -> Any:
        """Inside a jitted step: whole on every device, e.g. results every process reads back
        on the host, or state whose sharding must not drift from one step to the next."""
        return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, P()))

    # ------------------------------------------------------------------ attention

    def attention(self, backend: AttentionBackend) -> AttentionBackend:
        """The backend run on each device over its own heads and its own KV cache shard."""
        def sharded(q, k, v, layer_kv, metadata, *, scale, sliding_window=None):
            pages = jax.tree.map(lambda _: _PAGES, layer_kv)  # the layer's view, split by head
            local = jax.shard_map(
                functools.partial(backend, scale=scale, sliding_window=sliding_window),
                mesh=self.mesh,
                in_specs=(_HEADS, _HEADS, _HEADS, pages, P()),
                out_specs=(_HEADS, pages), check_vma=False)
            return local(q, k, v, layer_kv, metadata)
        return sharded


    def linear_attention(self, layer: Callable) -> Callable:
        """A Gated DeltaNet layer `layer(params, x [T, H], pool, layout) -> (out, pool)` run on
        each device over its own key heads (their parameters and their share of the state
        pool); out_proj's partial outputs are summed across devices."""
        def sharded(params, x, pool, layout):
            specs = {name: param_spec(name, w) for name, w in params.items()}

            def local(params, x, pool, layout):
                out, pool = layer(params, x, pool, layout)
                return jax.lax.psum(out, TP_AXIS), pool
            return jax.shard_map(local, mesh=self.mesh, in_specs=(specs, P(), _STATE, P()),
                                 out_specs=(P(), _STATE), check_vma=False)(params, x, pool,
                                                                           layout)
        return sharded


def param_spec(name: str, param: jax.Array | np.ndarray | QuantizedWeight
               ) -> P | QuantizedWeight:
    """A parameter's partition spec from its logical axes (names not listed: replicated).
    An 8-bit weight's scales split as its values do, except that one scale per row (a
    size-1 feature axis) is whole on every device."""
    axes = LOGICAL_AXES.get(name, (None,) * param.ndim)
    spec = P(*(MESH_AXES.get(a) for a in axes))
    if not isinstance(param, QuantizedWeight):
        return spec
    per_row = param.num_blocks == 1
    return replace(param, values=spec, scales=P(*spec[:-1], None if per_row else spec[-1]))


def split_in_features(name: str) -> bool:
    """Whether the parameter's input features (its last axis) are split across devices."""
    axes = LOGICAL_AXES.get(name)
    return bool(axes) and MESH_AXES.get(axes[-1]) is not None


def bytes_per_device(arrays: Iterable[jax.Array]) -> int:
    """What the arrays occupy on one device (the first of their mesh)."""
    return sum(x.addressable_shards[0].data.nbytes for x in arrays)


def copy_kv_heads(array: np.ndarray, copies: int, head_dim: int) -> np.ndarray:
    """w_qkv [G, W, ...] -> [G * copies, W', ...]: each group's q heads split `copies` ways,
    each part with its own copy of the group's k and v."""
    groups, width = array.shape[:2]
    q_width = width - 2 * head_dim
    q = array[:, :q_width].reshape(groups * copies, q_width // copies, *array.shape[2:])
    kv = np.repeat(array[:, q_width:], copies, axis=0)
    return np.concatenate([q, kv], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)
