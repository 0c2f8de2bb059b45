"""Tensor parallelism over a JAX device mesh, on one host or several (see docs/parallel.md)."""

from sgl_jax.parallel.mesh import (
           DP_AXIS,
           TP_AXIS,
           init_distributed,
           make_mesh,
           shutdown_distributed,
)
from sgl_jax.parallel.sharding import TensorParallel, bytes_per_device

__all__ = ["DP_AXIS", "TP_AXIS", "TensorParallel", "bytes_per_device", "init_distributed",
           "make_mesh", "shutdown_distributed"]
