"""Every program an Engine compiles, lowered for TPU and for CUDA on any host.

`record_engine_programs` starts an Engine (tiny checkpoints, a bucket or two) with `jax.jit`
replaced by a recorder, and runs the warm-up an accelerator runs (`runtime.warmup.warm_up`
for a platform other than the CPU, every program at once rather than the larger buckets in
the background: every batch bucket, every round shape, the grammar-masked programs, the
catch-up). While it runs, each call of a jitted function records the function,
its `jax.jit` options and its arguments as `jax.ShapeDtypeStruct`s (shardings included), and
returns zeros of the program's output shapes instead of running it: nothing is compiled for
the CPU, and the warm-up goes on with results of the right shapes. A donated state array
(the KV cache, the slots' state) comes back with the sharding it went in with, as the
engine's steady state has it; any other output is whole on every device of the mesh (the
runners constrain them so). `lower_program` then traces each recorded program afresh for
`platform` ("tpu" or "cuda") with the `fa` backend's kernel of that platform (Mosaic for
TPU, Triton for CUDA, never interpret mode: `flash.platform_kernel` follows the lowering
platform) and lowers it. Jitted functions made before the Engine starts (module-level ones:
the kernels' wrappers) are traced inside the programs that call them; one called on its own
at start-up (the zeroed KV pages' allocation) is not recorded.

With N CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, set before JAX
starts) the same runs at --tp-size N: JAX lowers a program whose arguments are sharded over
a mesh of CPU devices for another platform (the mesh's device ids only go into the module's
sharding annotations), so the sharded programs lower as they are. Run this module for that:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m sgl_jax.testing.lowering \\
        --cases '{"eagle3": {"model_path": M, "engine": {"tp_size": 4, ...}}}' --out r.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import re
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax.model_executor.programs import abstract

PLATFORMS = ("tpu", "cuda")
# What the `fa` kernel of each platform lowers to (a Pallas kernel in interpret mode lowers
# to plain loops instead, without it).
KERNEL_CALLS = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
# Engine settings of the recorded runs: what an accelerator serves with (bfloat16, the Pallas
# kernels) and its warm-up.
ACCELERATOR_SETTINGS = dict(dtype="bfloat16", attention_backend="fa", skip_server_warmup=False,
                            disable_compilation_cache=True)

_real_jit = jax.jit


@dataclasses.dataclass
class Program:
    """One program the engine compiles: a jitted function and abstract arguments."""

    name: str  # the function's name, its bound options and its place among its namesakes
    function: str  # the function's qualified name, e.g. "SpecRunner._round_impl"
    fun: Callable
    jit_options: dict[str, Any]  # jax.jit's keyword arguments
    args: tuple  # ShapeDtypeStructs where the engine passed arrays
    kwargs: dict[str, Any]  # static arguments as passed

    def trace(self) -> jax.stages.Traced:
        return _real_jit(self.fun, **self.jit_options).trace(*self.args, **self.kwargs)


class _Recorder:
    """Stands in for `jax.jit` while an Engine starts: the jitted functions it makes run as
    usual, except inside `recording()`, where a call records a Program and returns zeros."""

    def __init__(self) -> None:
        self.active = False
        self.programs: dict[Any, Program] = {}

    def jit(self, fun=None, /, **options):
        if fun is None:
            return functools.partial(self.jit, **options)
        return _RecordingJit(self, fun, options)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def record(self, fun: Callable, options: dict, args: tuple, kwargs: dict) -> None:
        abstract_args = abstract(args)
        key = (id(fun), _hashable(options), _signature(abstract_args), _hashable(kwargs))
        if key not in self.programs:
            function, name = _name(fun)
            count = sum(p.name.split(" #")[0] == name for p in self.programs.values())
            self.programs[key] = Program(f"{name} #{count}", function, fun, options, abstract_args,
                                         kwargs)


class _RecordingJit:
    def __init__(self, recorder: _Recorder, fun: Callable, options: dict):
        self._recorder, self._fun, self._options = recorder, fun, options
        self._jitted = _real_jit(fun, **options)
        functools.update_wrapper(self, fun, updated=())

    def __call__(self, *args, **kwargs):
        if not self._recorder.active:
            return self._jitted(*args, **kwargs)
        self._recorder.record(self._fun, self._options, args, kwargs)
        return _zeros_like_outputs(self._jitted.eval_shape(*args, **kwargs), args,
                                   self._donated(args))

    def lower(self, *args, **kwargs):
        if not self._recorder.active:
            return self._jitted.lower(*args, **kwargs)
        self._recorder.record(self._fun, self._options, args, kwargs)
        outputs = self._jitted.eval_shape(*args, **kwargs)
        donated = self._donated(args)
        return _FakeLowered(lambda *a: _zeros_like_outputs(outputs, args, donated),
                            (jax.tree.map(_sharding, args), {}))

    def _donated(self, args: tuple) -> list:
        numbers = self._options.get("donate_argnums") or ()
        numbers = (numbers,) if isinstance(numbers, int) else tuple(numbers)
        return [args[i] for i in numbers if i < len(args)]

    def __getattr__(self, name: str):
        return getattr(self._jitted, name)


@dataclasses.dataclass
class _FakeLowered:
    run: Callable
    # As a compiled program's: the arguments' shardings (None: a host array, placed anywhere).
    input_shardings: tuple

    def compile(self):
        return _FakeCompiled(self.run, self.input_shardings)


@dataclasses.dataclass(frozen=True)
class _FakeCompiled:
    run: Callable
    input_shardings: tuple

    def __call__(self, *args):
        return self.run(*args)


def _signature(tree, *, shardings: bool = True) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return (str(treedef), tuple(
        (leaf.shape, str(leaf.dtype), str(leaf.sharding) if shardings else None) if isinstance(
            leaf, jax.ShapeDtypeStruct) else _hashable(leaf) for leaf in leaves))


def _hashable(x) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


def _name(fun: Callable) -> tuple[str, str]:
    """The function's qualified name, and with the options bound to it."""
    keywords = {}
    while isinstance(fun, functools.partial):
        keywords = {**fun.keywords, **keywords}
        fun = fun.func
    function = getattr(fun, "__qualname__", repr(fun))
    shown = ", ".join(f"{k}={v}" for k, v in keywords.items() if not callable(v))
    return function, f"{function}({shown})"


def resharded(programs: list[Program]) -> list[str]:
    """Programs recorded twice with the same shapes but other shardings: a state array whose
    sharding drifted from one call to the next (serving would compile each call anew)."""
    seen: dict[tuple, str] = {}
    drifted = []
    for p in programs:
        key = (p.name.split(" #")[0], _signature(p.args, shardings=False),
               _hashable(p.kwargs))
        if key in seen:
            drifted.append(f"{seen[key]} and {p.name}")
        seen.setdefault(key, p.name)
    return drifted


def _zeros_like_outputs(outputs, args: tuple, donated: list):
    """Arrays of zeros shaped as `outputs` (ShapeDtypeStructs): a donated input's sharding
    where one has the output's shape and dtype, else whole on the arguments' mesh. Inputs
    may be arrays or, for a program built ahead of its first call, ShapeDtypeStructs that
    carry their sharding."""
    by_type: dict[tuple, Any] = {}
    for leaf in jax.tree.leaves(donated):
        if _sharding(leaf) is not None:
            by_type.setdefault((leaf.shape, leaf.dtype), _sharding(leaf))
    mesh = next((_sharding(leaf).mesh for leaf in jax.tree.leaves(args)
                 if isinstance(_sharding(leaf), NamedSharding)), None)
    whole = NamedSharding(mesh, P()) if mesh is not None else None

    def zeros(out: jax.ShapeDtypeStruct) -> jax.Array:
        sharding = by_type.get((out.shape, out.dtype), whole)
        value = np.zeros(out.shape, out.dtype)
        return jax.device_put(value, sharding) if sharding is not None else jax.device_put(value)
    return jax.tree.map(zeros, outputs)


def _sharding(leaf: Any) -> Any:
    """The sharding of an array or of a ShapeDtypeStruct that names one, else None."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return leaf.sharding
    return None


def record_engine_programs(model_path: str, **engine_kwargs: Any) -> list[Program]:
    """The programs an Engine of these settings (over ACCELERATOR_SETTINGS) compiles at its
    warm-up on an accelerator, recorded on this host without compiling any."""
    from sgl_jax.entrypoints.engine import Engine
    from sgl_jax.runtime import warmup

    recorder = _Recorder()
    warm_up = warmup.warm_up

    def accelerator_warm_up(runner, spec) -> None:
        runner.builder = None  # every program now, none left to the background builder
        with recorder.recording():
            warm_up(runner, spec, platform="accelerator")

    settings = {**ACCELERATOR_SETTINGS, **engine_kwargs}
    with mock.patch.object(jax, "jit", recorder.jit), \
            mock.patch.object(warmup, "warm_up", accelerator_warm_up):
        engine = Engine(model_path=model_path, **settings)
    engine.shutdown()
    return list(recorder.programs.values())


@contextlib.contextmanager
def kernels_for(platform: str) -> Iterator[None]:
    """The `fa` backend traces `platform`'s Pallas kernel (the engine picks the kernel of
    the platform it runs on: on this host, the interpreted one)."""
    from sgl_jax.layers.attention import flash

    choose = flash.platform_kernel
    with mock.patch.object(flash, "platform_kernel", lambda _: choose(platform)):
        yield


def lower_program(program: Program, platform: str) -> str:
    """The program's StableHLO lowered for `platform`; raises where it does not lower. The
    kernel in the text is checked: a program that calls a Pallas kernel must call the
    platform's own."""
    jax.clear_caches()  # no trace made with the host's kernel is reused
    with kernels_for(platform):
        traced = program.trace()
        text = traced.lower(lowering_platforms=(platform,)).as_text()
    if "pallas_call" in str(traced.jaxpr) and KERNEL_CALLS[platform] not in text:
        raise AssertionError(f"{program.name} calls a Pallas kernel, but its {platform} "
                             f"lowering holds no {KERNEL_CALLS[platform]}")
    return text


@dataclasses.dataclass
class Outcome:
    program: str
    function: str
    platform: str
    seconds: float
    error: str | None  # None: it lowered
    partitions: int  # devices the lowered module runs on (its mhlo.num_partitions)
    kernel_calls: int  # calls of the platform's Pallas kernel in the lowered module


def lower_all(programs: list[Program], platforms=PLATFORMS) -> list[Outcome]:
    """Every program lowered for every platform; a failure is kept with its error."""
    outcomes = []
    for program in programs:
        for platform in platforms:
            start = time.perf_counter()
            text, error = "", None
            try:
                text = lower_program(program, platform)
            except Exception as e:  # noqa: BLE001 - every failure is reported, by program
                lines = traceback.format_exception(e)
                error = f"{type(e).__name__}: {str(e)[:2000]}\n{''.join(lines[-4:])[-2000:]}"
            partitions = re.search(r"mhlo\.num_partitions = (\d+)", text)
            outcomes.append(Outcome(program.name, program.function, platform,
                                    time.perf_counter() - start, error,
                                    int(partitions.group(1)) if partitions else 1,
                                    text.count(KERNEL_CALLS[platform])))
    return outcomes


def failures(outcomes: list[Outcome]) -> str:
    """One paragraph per program that did not lower (empty when all did)."""
    return "\n\n".join(f"{o.program} for {o.platform}:\n{o.error}" for o in outcomes
                        if o.error)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=json.loads, required=True,
                        help='a JSON object {name: {"model_path": ..., "engine": {Engine '
                             'keyword arguments}}}')
    parser.add_argument("--platforms", default=",".join(PLATFORMS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    results = {}
    for name, case in args.cases.items():
        programs = record_engine_programs(case["model_path"], **case.get("engine", {}))
        results[name] = {
            "outcomes": [dataclasses.asdict(o) for o in
                         lower_all(programs, tuple(args.platforms.split(",")))],
            "resharded": resharded(programs),
            "argument_dtypes": argument_dtypes(programs)}
    Path(args.out).write_text(json.dumps(results))


def argument_dtypes(programs: list[Program]) -> list[str]:
    """Every dtype among the programs' array arguments (parameters and pages included)."""
    return sorted({str(leaf.dtype) for p in programs for leaf in jax.tree.leaves(p.args)
                   if hasattr(leaf, "dtype")})


if __name__ == "__main__":
    main()
