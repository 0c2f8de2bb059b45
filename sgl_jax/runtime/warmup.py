"""Building the step programs before serving, and leaving the rest to a background builder.

A server answers once it can run a prefill of its smallest token bucket and a batch of its
smallest batch bucket. With a background builder (`runner.builder`), the larger buckets are
built there while the server answers, smallest first: the scheduler admits only as many
requests, and puts only as many tokens in an extend batch, as built programs can take
(Decoding.batch_limit / prefill_limit), so no request waits for a compile. XLA:CPU maps every
compiled kernel into the process apart, a few hundred mappings a program, and a process may
have 65530: there a speculative server builds a larger batch bucket only once a batch needs
it. Without a builder (multi-host, where every rank must build the same programs in the same
order) every program is built now, except a CPU speculative server's larger batch buckets,
which are compiled when a batch first needs them.
"""

from __future__ import annotations

import functools

import jax

from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.model_executor.programs import BackgroundBuilder
from sgl_jax.speculative import spec_warmup
from sgl_jax.speculative.spec_runner import SpecRunner


def warm_up(runner: ModelRunner, spec: SpecRunner | None, platform: str | None = None) -> None:
    """`platform`: whose warm-up to run (default: JAX's backend; the lowering checks ask for
    an accelerator's on this host, sgl_jax.testing.lowering)."""
    cpu = (platform or jax.default_backend()) == "cpu"
    buckets, builder = runner.buckets, runner.builder
    first_size, first_tokens = buckets.bs_paddings[:1], buckets.token_paddings[:1]
    if builder is None:
        if spec is None:
            runner.warmup()
        elif cpu:
            spec_warmup.warm_up(spec, first_size, rare_programs=False)
        else:
            spec_warmup.warm_up(spec)
        return
    if spec is None:
        runner.warmup([buckets.decode_shape(first_size[0]),
                       buckets.extend_shape(first_tokens[0])])
        _queue(builder, "decode step", buckets.bs_paddings[1:],
               lambda size: runner.build_program(buckets.decode_shape(size)))
        _queue(builder, "extend step", buckets.token_paddings[1:],
               lambda tokens: runner.build_program(buckets.extend_shape(tokens)))
        return
    spec_warmup.warm_up(spec, first_size, rare_programs=not cpu, token_sizes=first_tokens)
    _queue(builder, "speculative prefill", buckets.token_paddings[1:],
           functools.partial(spec_warmup.build_prefill, spec))
    if not cpu:  # a CPU builds a larger batch bucket once a batch needs it
        for size in buckets.bs_paddings[1:]:
            spec_warmup.queue_bucket(spec, size)
        _queue(builder, "masked round", buckets.bs_paddings[1:],
               functools.partial(spec_warmup.build_masked, spec))


def _queue(builder: BackgroundBuilder, name: str, sizes, build) -> None:
    """Each bucket's build, under the job id and priority the scheduler's requests for it
    use (model_runner.ready_batch_limit)."""
    for index, size in enumerate(sizes, start=1):
        builder.submit((name, size), functools.partial(build, size), priority=index)
