"""The device mesh of `--tp-size`, and JAX's multi-controller start-up across hosts."""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh

logger = logging.getLogger(__name__)

TP_AXIS = "tp"
DP_AXIS = "dp"  # data parallel (training): batch rows split, parameters replicated


def make_mesh(tp_size: int, devices: list[jax.Device] | None = None, dp_size: int = 1
              ) -> Mesh:
    """A 1-D "tp" mesh over the first `tp_size` devices (all devices of all hosts by
    default), or with dp_size > 1 a 2-D ("dp", "tp") mesh over dp_size * tp_size devices,
    each dp row a tensor-parallel group of neighbouring devices.

    Across several processes the mesh must span every device: each process runs the same
    steps, and a device outside the mesh would have nothing to do."""
    devices = jax.devices() if devices is None else devices
    kind = f"{len(devices)} {devices[0].platform} device(s)" if devices else "no devices"
    needed = tp_size * dp_size
    what = f"--tp-size {tp_size}" + (f" x --dp-size {dp_size}" if dp_size > 1 else "")
    if needed > len(devices):
        raise ValueError(f"{what} needs {needed} devices, but JAX sees {kind}"
                         f"{_more_devices_hint(devices)}")
    if jax.process_count() > 1 and needed != len(devices):
        raise ValueError(f"{what} across {jax.process_count()} processes must use "
                         f"all {len(devices)} devices of the processes together")
    if dp_size == 1:
        return Mesh(np.array(devices[:tp_size]), (TP_AXIS,))
    return Mesh(np.array(devices[:needed]).reshape(dp_size, tp_size), (DP_AXIS, TP_AXIS))


def _more_devices_hint(devices: list[jax.Device]) -> str:
    if devices and devices[0].platform == "cpu":
        return ("; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N "
                "devices")
    return "; lower --tp-size, or add hosts with --nnodes"


def init_distributed(nnodes: int, node_rank: int, dist_init_addr: str | None) -> None:
    """Join the JAX processes of all nodes (rank 0 hosts the coordinator at dist_init_addr).

    Must run before anything else touches JAX's devices. CPU collectives between processes
    go through gloo; the setting does nothing on accelerators."""
    if nnodes == 1 or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=dist_init_addr, num_processes=nnodes,
                               process_id=node_rank)
    logger.info("Node %d of %d joined %s: %d devices in all, %d here", node_rank, nnodes,
                dist_init_addr, jax.device_count(), jax.local_device_count())


def shutdown_distributed() -> None:
    """Leave the group together: every rank waits here for the others, so rank 0 (which
    hosts the coordinator) does not exit while another rank still needs it."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()
