"""Compiling the step programs before serving.

XLA:CPU maps every compiled kernel into the process apart, a few hundred mappings a program,
and a process may have 65530: there a speculative server warms only its smallest batch
bucket and leaves the programs few batches need to their first use (each larger bucket is
compiled and timed when a batch first needs it). Elsewhere every program is compiled now.
"""

from __future__ import annotations

import jax

from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.speculative import spec_warmup
from sgl_jax.speculative.spec_runner import SpecRunner


def warm_up(runner: ModelRunner, spec: SpecRunner | None, platform: str | None = None) -> None:
    """`platform`: whose warm-up to run (default: JAX's backend; the lowering checks ask for
    an accelerator's on this host, sgl_jax.testing.lowering)."""
    if spec is None:
        runner.warmup()
    elif (platform or jax.default_backend()) == "cpu":
        spec_warmup.warm_up(spec, runner.buckets.bs_paddings[:1], rare_programs=False)
    else:
        spec_warmup.warm_up(spec)
