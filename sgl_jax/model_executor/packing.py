"""A step's host inputs cross to the device as two flat arrays, unpacked inside the step.

A compiled program copies each host (numpy) argument to the device on its own, a few
microseconds each on a CPU and more across PCIe, and a sampling step has about thirty
(the batch layout, every sampling parameter, slots). Packed, they are one int32 and one
float32 array: two copies. The layout (`Packing`: every leaf's place, shape and dtype) is
static and part of the compiled program's key, so unpacking is free slicing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_FLOAT_KINDS = "f"
_INT_DTYPES = ("int32", "uint32", "bool")


@dataclass(frozen=True)
class Leaf:
    floating: bool  # which of the two arrays holds it
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Packing:
    """Where each leaf of a pytree of host arrays lies in the packed pair."""

    treedef: Any  # jax's PyTreeDef (hashable)
    leaves: tuple[Leaf, ...]
    num_ints: int
    num_floats: int


def layout(tree: Any) -> Packing:
    """The Packing of a pytree of numpy arrays (int32, uint32, bool, float32; None leaves
    allowed): made once per compiled program."""
    arrays, treedef = jax.tree.flatten(tree)
    leaves, sizes = [], [0, 0]
    for array in map(np.asarray, arrays):
        floating = array.dtype.kind in _FLOAT_KINDS
        if not floating and array.dtype.name not in _INT_DTYPES:
            raise TypeError(f"cannot pack a {array.dtype} array")
        leaves.append(Leaf(floating, sizes[floating], array.shape, array.dtype.name))
        sizes[floating] += array.size
    return Packing(treedef, tuple(leaves), *sizes)


class Layouts:
    """The Packing of each program's host inputs by the program's key, laid out from its
    first inputs (every later call's must match, which `pack` checks)."""

    def __init__(self) -> None:
        self._by_key: dict[Any, Packing] = {}

    def pack(self, key: Any, tree: Any) -> tuple[tuple[np.ndarray, np.ndarray], Packing]:
        """(i32[num_ints], f32[num_floats]) of `tree`, and the key's Packing."""
        packing = self._by_key.get(key) or self._by_key.setdefault(key, layout(tree))
        return pack(tree, packing), packing

    def layout_of(self, key: Any) -> Packing:
        """The key's Packing, laid out by an earlier `pack`."""
        return self._by_key[key]


def pack(tree: Any, packing: Packing) -> tuple[np.ndarray, np.ndarray]:
    """A pytree laid out as `packing` says -> (i32[num_ints], f32[num_floats])."""
    arrays, treedef = jax.tree.flatten(tree)
    if treedef != packing.treedef:
        raise ValueError(f"inputs {treedef} do not match the program's {packing.treedef}")
    ints, floats = [], []
    for array, leaf in zip(arrays, packing.leaves, strict=True):
        (floats if leaf.floating else ints).append(np.ravel(array))
    ints, floats = _concatenate(ints, np.int32), _concatenate(floats, np.float32)
    if (ints.size, floats.size) != (packing.num_ints, packing.num_floats):
        raise ValueError("inputs do not match the program's array shapes")
    return ints, floats


def unpack(packing: Packing, ints: jax.Array, floats: jax.Array) -> Any:
    """Inside a jitted function: the pytree `pack` was given, as device arrays."""
    arrays = []
    for leaf in packing.leaves:
        flat = (floats if leaf.floating else ints)[leaf.offset: leaf.offset + leaf.size]
        arrays.append(_restore(flat.reshape(leaf.shape), leaf.dtype))
    return jax.tree.unflatten(packing.treedef, arrays)


def _restore(array: jax.Array, dtype: str) -> jax.Array:
    if dtype == "bool":
        return array != 0
    if dtype == "uint32":
        return jax.lax.bitcast_convert_type(array, jnp.uint32)
    return array.astype(dtype)


def _concatenate(parts: list[np.ndarray], dtype) -> np.ndarray:
    """One flat array; uint32 values keep their bits (bitcast back by unpack)."""
    if not parts:
        return np.zeros(0, dtype)
    return np.concatenate([p.view(np.int32) if p.dtype == np.uint32 else p for p in parts],
                          dtype=dtype, casting="unsafe")
