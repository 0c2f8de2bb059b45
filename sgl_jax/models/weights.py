"""How a checkpoint tensor maps into a model's parameter pytree."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSpec:
    path: tuple[str | int, ...]  # where the tensor goes in the parameter pytree
    shape: tuple[int, ...]  # its shape in the checkpoint (PyTorch layout, [out, in])
    # Rows (first axis) of a fused parameter this tensor fills, e.g. k_proj inside the fused
    # q|k|v matrix; None when the tensor is the whole parameter.
    rows: tuple[int, int] | None = None
    integer: bool = False  # an index table (e.g. an EAGLE3 draft's d2t), loaded as int32
