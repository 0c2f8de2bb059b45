"""Building the step programs before serving, and leaving the rest to a background builder.

A server answers once it can run its prefills and a batch of its smallest bucket. With a
background builder (`runner.builder`), the larger batch buckets are built there, smallest
first, while the server answers: the scheduler admits only as many requests as built
programs can take (Decoding.batch_limit), so no request waits for a compile. XLA:CPU maps
every compiled kernel into the process apart, a few hundred mappings a program, and a process
may have 65530: there a speculative server builds a larger bucket only once a batch needs
it. Without a builder (multi-host, where every rank must build the same programs in the same
order) every program is built now, except a CPU speculative server's larger buckets, which
are compiled when a batch first needs them.
"""

from __future__ import annotations

import functools

import jax

from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.speculative import spec_warmup
from sgl_jax.speculative.spec_runner import SpecRunner


def warm_up(runner: ModelRunner, spec: SpecRunner | None, platform: str | None = None) -> None:
    """`platform`: whose warm-up to run (default: JAX's backend; the lowering checks ask for
    an accelerator's on this host, sgl_jax.testing.lowering)."""
    cpu = (platform or jax.default_backend()) == "cpu"
    buckets, builder = runner.buckets, runner.builder
    smallest, larger = buckets.bs_paddings[0], buckets.bs_paddings[1:]
    if spec is None and builder is None:
        runner.warmup()
    elif spec is None:
        runner.warmup([s for s in buckets.all_shapes()
                       if s.q_block > 1 or s.num_tokens == smallest])
        for size in larger:
            builder.submit(("decode step", size), functools.partial(
                runner.build_program, buckets.decode_shape(size)), priority=size)
    elif cpu:
        spec_warmup.warm_up(spec, [smallest], rare_programs=False)
    elif builder is None:
        spec_warmup.warm_up(spec)
    else:
        spec_warmup.warm_up(spec, [smallest])
        for size in larger:
            builder.submit(("speculative bucket", size),
                           functools.partial(spec_warmup.build_bucket, spec, size), priority=size)
            builder.submit(("masked round", size),
                           functools.partial(spec_warmup.build_masked, spec, size), priority=size)
