"""A model's parameters as the serving programs take them: in few arguments.

A compiled call costs the calling thread a few microseconds per array argument (JAX checks
each one's signature and layout and holds its buffer), the same for a norm's 576 floats as for
a projection; a decoder layer has two norm weights (four with q/k norms), so a 30-layer model
passes 60-120 of them every step. Stacking the small replicated vectors of each shape into one
array and slicing them back inside the program removes those arguments; the slices are copies
of a few kilobytes. The large weights stay separate: a slice of a stacked projection would be
copied each step too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


class ProgramParams:
    """`arrays`: the parameters to pass a program, ([large leaves], [stacked vectors]);
    `unstack(arrays)` inside the program gives back the model's parameter tree."""

    def __init__(self, params: dict[str, Any]):
        leaves, self._treedef = jax.tree.flatten(params)
        self._num_leaves = len(leaves)
        groups: dict[tuple, list[int]] = {}
        for index, leaf in enumerate(leaves):
            if _stackable(leaf):
                groups.setdefault((leaf.shape, leaf.dtype, leaf.sharding), []).append(index)
        self._groups = [indices for indices in groups.values() if len(indices) > 1]
        stacked = {index for indices in self._groups for index in indices}
        self._kept = [index for index in range(len(leaves)) if index not in stacked]
        self.arrays = ([leaves[index] for index in self._kept],
                       [_stack([leaves[index] for index in indices]) for indices in self._groups])

    def unstack(self, arrays: tuple[list, list]) -> dict[str, Any]:
        """The parameter tree from `arrays` (traced: each stacked vector sliced back out)."""
        kept, stacks = arrays
        leaves: list[Any] = [None] * self._num_leaves
        for index, leaf in zip(self._kept, kept, strict=True):
            leaves[index] = leaf
        for indices, stack in zip(self._groups, stacks, strict=True):
            for row, index in enumerate(indices):
                leaves[index] = stack[row]
        return jax.tree.unflatten(self._treedef, leaves)


def _stackable(leaf: Any) -> bool:
    """A vector every device holds whole: a norm's weight, not a sharded bias."""
    return isinstance(leaf, jax.Array) and leaf.ndim == 1 and leaf.sharding.is_fully_replicated


def _stack(vectors: list[jax.Array]) -> jax.Array:
    """[k, n] from k vectors of [n], replicated as they are (jit: also across hosts)."""
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=vectors[0].sharding)(*vectors)
