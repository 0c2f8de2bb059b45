"""How a checkpoint tensor maps into a model's parameter pytree."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSpec:
    path: tuple[str | int, ...]  # where the tensor goes in the parameter pytree
    shape: tuple[int, ...]  # its shape in the checkpoint (PyTorch layout, [out, in])
    transpose: bool = False  # PyTorch stores [out, in]; we keep [in, out] for x @ W
