"""The engine loop's host overhead: engine ms per decode step (and per speculative round)
beside the device-only time of the same programs and a synchronous floor.

For each batch size b, b random prompts generate greedily with `ignore_eos` through
`Engine.generate`. The engine's ms per step is the difference between a run of
`--short` + `--steps` new tokens and one of `--short`, over `--steps` (so prefill, start and
finish cancel out); a speculative round's is that difference over the rounds it took.
Beside it, the same two runs replayed: a third run of each records every call of the
engine's dispatch methods (the runner's `launch`; the speculative runner's `prefill` and
`round`) with its arguments, and

- device: the recorded calls dispatched again back to back, read once at the end: what
  the device needs for exactly the engine's steps (each request's own pages, its lengths
  and roots as the device kept them), with no host work between them;
- floor: the same calls in a Python loop that reads each one's results back before the
  next: the best a synchronous loop over the same programs can do.

The engine CPU column is the engine thread's CPU time per step over the same two runs (its
`time.thread_time`, so waits for the device are left out): the host work a step costs,
which is what a step takes wherever the device is faster than that, and which a busy
machine distorts less than the wall-clock columns.

The tiny model is a random Llama as transformers writes it (2 layers, hidden 64, vocab 512);
the demo model is SmolLM2-135M-Instruct (float32), plain, with its shipped EAGLE3 head, and
with NGRAM (whose drafting on the host is part of the engine's time and not the replay's).
`--model-path` puts another checkpoint in the demo's place (e.g. a random one of
Llama-3.1-8B's shape, `--draft-model-path` its EAGLE3 head, `--dtype bfloat16`).

Each plain row also counts the kernels of its compiled decode program (`kernel_count`: the
operations of the optimized HLO's entry and of the computations its control flow runs that
launch work on the device: fusions, library calls such as matrix products and the attention
kernel, copies), so a step's fixed launch cost can be read beside its time. Rows are written
to --json as each finishes.

    python benchmark/bench_host_overhead.py                      # tiny 1,32,128,256; demo 1,32
    python benchmark/bench_host_overhead.py --tiny-batch-sizes 1,128 --rows tiny
    python benchmark/bench_host_overhead.py --json /tmp/overhead.json
    python benchmark/bench_host_overhead.py --rows demo --model-path <8B-shaped checkpoint> \
        --dtype bfloat16 --demo-batch-sizes 1,32
    python benchmark/bench_host_overhead.py --rows demo,ngram --demo-batch-sizes 8 \
        --context 1024 --spec-shape 5,1,6          # a round's cost over long contexts

Prompts are 8 random tokens (NGRAM's: those repeated four times), or `--context` tokens in
every row (NGRAM's: a random phrase of a quarter of that, repeated four times), so plain
steps and drafted rounds can be priced over the same context. `--dataset code-edits` gives
the demo-model rows real requests instead: bench_speculative's code edits (a function to
output again with one change) through the chat template, the first `batch` that fit in
1000 tokens, so NGRAM drafts from the prompt as it would in service.

Every row also gives the tokens a step committed (the batch for a plain step, more for a
round that accepted drafts) and the engine thread's CPU per committed token: what a host
that the device waits for pays per token, speculation's rows against plain's.

    python benchmark/bench_host_overhead.py --rows demo,ngram --dataset code-edits \
        --demo-batch-sizes 8,32 --spec-shape 6,1,7 --steps 96
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

_HERE = Path(__file__).resolve().parent
try:
    import sgl_jax
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_HERE.parent))
    import sgl_jax
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))
from bench_one_batch import int_list, machine_info, random_prompts  # noqa: E402

TINY_LLAMA = dict(num_hidden_layers=2)  # the "llama" test preset: hidden 64, vocab 512
PROMPT_LEN = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-batch-sizes", type=int_list, default=[1, 32, 128, 256])
    parser.add_argument("--demo-batch-sizes", type=int_list, default=[1, 32])
    parser.add_argument("--rows", default="tiny,demo,spec,ngram",
                        help="which rows: tiny (decode), demo (decode), spec (demo rounds "
                             "with its EAGLE3 head), ngram (demo rounds drafted by NGRAM), "
                             "ngram-adaptive (demo steps of NGRAM's adaptive policy)")
    parser.add_argument("--steps", type=int, default=256, help="timed decode steps")
    parser.add_argument("--short", type=int, default=16,
                        help="new tokens of the run whose time is subtracted")
    parser.add_argument("--spec-shape", default="3,1,4",
                        help="num_steps,topk,num_draft_tokens of the speculative rows")
    parser.add_argument("--model-path", default=None,
                        help="the target of the demo, spec and ngram rows (default: the demo)")
    parser.add_argument("--draft-model-path", default=None,
                        help="the EAGLE3 head of the spec rows (default: the demo's)")
    parser.add_argument("--dtype", default="float32", help="of the demo, spec and ngram rows")
    parser.add_argument("--quantization", default=None, help="of the demo, spec and ngram rows")
    parser.add_argument("--context", type=int, default=None,
                        help="prompt tokens of every row (default: 8, NGRAM's 32)")
    parser.add_argument("--dataset", choices=("random", "code-edits"), default="random",
                        help="the demo-model rows' prompts (the tiny rows' stay random)")
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="time the synchronous engine loop instead (the rows say 'sync')")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- the engine


def make_engine(model_path: str | None, batches: list[int], dtype: str = "float32",
                context: int | None = None, **extra):
    """An engine whose only decode buckets are `batches` (start-up compiles little), whose
    prefill takes prompts of `context` tokens in chunks of at most 1024."""
    prefill_tokens = sorted({max(64, 16 * b, min(context or 0, 1024)) for b in batches})
    engine = sgl_jax.Engine(
        model_path, dtype=dtype, max_running_requests=max(batches),
        precompile_bs_paddings=tuple(sorted(batches)),
        precompile_token_paddings=tuple(prefill_tokens), max_prefill_tokens=prefill_tokens[-1],
        log_level="warning", decode_log_interval=10**9, **extra)
    engine.wait_for_programs()  # no timed step shares the host with a compile
    return engine


def engine_run_seconds(engine, prompts: list[list[int]], new_tokens: int
                       ) -> tuple[float, float]:
    """(wall seconds, the engine thread's CPU seconds) of one generate call."""
    engine.flush_cache()  # every run prefills the same way
    cpu = engine_thread_cpu(engine)
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
    seconds = time.perf_counter() - start
    return seconds, engine_thread_cpu(engine) - cpu


def engine_thread_cpu(engine) -> float:
    """CPU seconds the engine thread has used: its host work, waits excluded."""
    return engine.runtime.call(lambda scheduler: time.thread_time())


def scheduler_counters(engine) -> tuple[int]:
    """(decode steps or speculative rounds of the whole batch) the engine has run so far."""
    return engine.runtime.call(lambda scheduler: (scheduler.stats.num_decode_steps,))


def engine_and_replay_ms(engine, owner, dispatches: tuple[str, ...], prompts: list[list[int]],
                         short: int, steps: int) -> tuple[float, float, float, int, float]:
    """(engine, device, floor) ms per decode step or round, the steps or rounds counted, and
    the engine thread's CPU ms per step. Each is the difference between a run of `short` +
    `steps` new tokens and one of `short` over the steps between them: the engine's from its
    runs (the faster of two, and the least CPU of two), device and floor from replays of the
    calls of `owner`'s `dispatches` that a third run made."""
    engine_run_seconds(engine, prompts, short + steps)  # first runs of every program
    seconds, cpu, calls, counts = {}, {}, {}, {}
    for new in (short, short + steps):
        runs = [engine_run_seconds(engine, prompts, new) for _ in range(2)]
        seconds[new], cpu[new] = (min(times) for times in zip(*runs, strict=True))
        before = scheduler_counters(engine)[0]
        with recorded_dispatches(owner, dispatches) as calls[new]:
            engine_run_seconds(engine, prompts, new)
        counts[new] = scheduler_counters(engine)[0] - before
    taken = counts[short + steps] - counts[short]

    def per_step(run_seconds) -> float:
        return 1e3 * (run_seconds(short + steps) - run_seconds(short)) / taken

    def replay_ms(read_each: bool) -> float:
        return per_step(lambda new: min(replay_seconds(calls[new], read_each) for _ in range(2)))

    return (per_step(seconds.get), replay_ms(read_each=False), replay_ms(read_each=True), taken,
            per_step(cpu.get), len(prompts) * steps / taken)


# --------------------------------------------------------------------------- the replay


@contextlib.contextmanager
def recorded_dispatches(owner, names: tuple[str, ...]) -> Iterator[list[tuple]]:
    """Every call of `owner`'s methods `names` while open, in order, as (method, args,
    kwargs), the arguments deep-copied (the engine updates its host arrays in place between
    steps): a replay feeds the programs exactly what the engine fed them, each request's own
    scattered pages and the lengths and roots the device keeps per slot included. Set while
    the engine thread is idle, between runs."""
    calls = []

    def recorder(method):
        def record(*args, **kwargs):
            calls.append((method, copy.deepcopy(args), copy.deepcopy(kwargs)))
            return method(*args, **kwargs)
        return record

    for name in names:
        setattr(owner, name, recorder(getattr(owner, name)))
    try:
        yield calls
    finally:
        for name in names:
            delattr(owner, name)  # the class's method again


def replay_seconds(calls: list[tuple], read_each: bool) -> float:
    """Seconds to dispatch recorded calls again back to back, reading only the last one's
    results (the device's time: each program waits on the state the one before wrote), or
    each one's before the next (the floor: a synchronous loop over the same programs)."""
    start = time.perf_counter()
    for method, args, kwargs in calls:
        pending = method(*args, **kwargs)
        if read_each:
            pending.result()
    pending.result()
    return time.perf_counter() - start


# --------------------------------------------------------------------------- rows


def bench_plain(model_path: str | None, label: str, batches: list[int], args,
                **model_args) -> Iterator[dict]:
    """A row per batch size from one engine, with its decode program's kernel count."""
    real = label != "tiny"
    engine = make_engine(model_path, batches, context=engine_context(args, real),
                         disable_overlap_schedule=args.disable_overlap_schedule, **model_args)
    try:
        runner = engine.runtime.runner
        for batch in batches:
            prompts = row_prompts(engine, batch, args, real=real)
            timings = engine_and_replay_ms(engine, runner, ("launch",), prompts,
                                           args.short, args.steps)
            row = result_row(label, _kind("decode", args), batch, *timings)
            program = runner.sampling_programs.get(runner.buckets.decode_shape(batch))
            row["decode_kernels"] = None if program is None else kernel_count(program.as_text())
            yield row
    finally:
        engine.shutdown()


# Operations of a control-flow computation that launch nothing: they name, regroup or route
# buffers, or hold the control flow whose bodies are counted where they are defined.
NOT_KERNELS = frozenset({
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "call", "conditional",
    "while", "opt-barrier", "after-all", "partition-id", "replica-id", "add-dependency",
    "copy-done", "all-reduce-done", "all-gather-done", "collective-permute-done",
    "async-done", "async-update"})
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
# Where control flow names the computations it runs (a fusion's or a reduction's `calls` /
# `to_apply` are parts of one kernel, so they are not followed).
_CONTROL = {"while": ("body", "condition"), "call": ("to_apply",),
            "conditional": ("branch_computations", "true_computation", "false_computation")}


def kernel_count(hlo_text: str) -> int:
    """Device launches of an optimized HLO module: the instructions of ENTRY and of the
    computations its control flow runs (loop bodies, branches, called computations such as
    command buffers), less those in NOT_KERNELS. A loop body counts once."""
    computations: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif current is not None and _OPCODE.match(line):
            computations[current].append(line)
    count, seen, todo = 0, set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for line in computations[name]:
            opcode = _OPCODE.match(line).group(1)
            count += opcode not in NOT_KERNELS
            for field in _CONTROL.get(opcode, ()):
                found = re.search(rf"{field}=\{{?([^}},]+(?:,\s*[^}},]+)*)\}}?", line)
                todo += [n.strip().lstrip("%") for n in found.group(1).split(",")] if found else []
    return count


def bench_speculative(batches: list[int], args, algorithm: str = "EAGLE3") -> Iterator[dict]:
    """Rounds of the demo model with its EAGLE3 head, or with NGRAM: the host then also
    looks up every request's text each round (prompts that repeat a phrase, so lookups
    find matches), which the replay does not do. A row per batch size from one engine."""
    steps, topk, draft_tokens = (int(x) for x in args.spec_shape.split(","))
    draft = {} if algorithm == "NGRAM" or args.draft_model_path is None else {
        "speculative_draft_model_path": args.draft_model_path}
    engine = make_engine(args.model_path, batches, args.dtype, engine_context(args, True),
                         quantization=args.quantization,
                         disable_overlap_schedule=args.disable_overlap_schedule,
                         speculative_algorithm=algorithm, **draft,
                         speculative_num_steps=steps, speculative_eagle_topk=topk,
                         speculative_num_draft_tokens=draft_tokens,
                         speculative_adaptive=False)
    label = model_label(args) if algorithm == "EAGLE3" else f"{model_label(args)} {algorithm}"
    kind = _kind(f"round {args.spec_shape.replace(',', '/')}", args)
    try:
        for batch in batches:
            prompts = row_prompts(engine, batch, args, repeats=4 if algorithm == "NGRAM" else 1)
            yield result_row(label, kind, batch, *engine_and_replay_ms(
                engine, engine.runtime.spec_runner, ("prefill", "round"), prompts, args.short,
                args.steps))
    finally:
        engine.shutdown()


def bench_adaptive_ngram(batches: list[int], args) -> Iterator[dict]:
    """The demo model served by NGRAM under the adaptive policy (the default): a step is
    plain or a round, as the policy chooses, and the host looks up every request's text only
    for steps that may draft. Engine ms per step beside the plain row's say what serving with
    the speculative engine costs where drafting does not pay (on random text, most steps);
    the device and floor columns replay its plain steps alone."""
    engine = make_engine(args.model_path, batches, args.dtype, engine_context(args, True),
                         quantization=args.quantization,
                         disable_overlap_schedule=args.disable_overlap_schedule,
                         speculative_algorithm="NGRAM")
    try:
        for batch in batches:
            prompts = row_prompts(engine, batch, args, repeats=4)
            yield result_row(f"{model_label(args)} NGRAM", _kind("adaptive step", args), batch,
                             *engine_and_replay_ms(engine, engine.runtime.runner, ("launch",),
                                                   prompts, args.short, args.steps))
    finally:
        engine.shutdown()


CODE_EDIT_TOKENS = 1000  # the longest code-edit prompt taken (the demo's context is 2048)


def engine_context(args, real: bool) -> int | None:
    """The prompt tokens an engine's prefill buckets must take."""
    return 1024 if real and args.dataset == "code-edits" else args.context


def row_prompts(engine, batch: int, args, *, real: bool = True, repeats: int = 1
                ) -> list[list[int]]:
    """A row's prompts: code edits through the chat template (--dataset code-edits, real
    models), else bench_prompts."""
    if not real or args.dataset != "code-edits":
        return bench_prompts(batch, args.context, engine.model.config.vocab_size, repeats)
    from bench_speculative import code_edits

    from sgl_jax.tokenizer.chat_template import ChatTemplate

    template = ChatTemplate(engine.tokenizer)
    prompts = []
    for edit in code_edits():
        ids = template.encode([{"role": "user", "content": edit.request}])
        if len(ids) <= CODE_EDIT_TOKENS:
            prompts.append(ids)
        if len(prompts) == batch:
            return prompts
    raise SystemExit(f"fewer than {batch} code edits fit in {CODE_EDIT_TOKENS} tokens")


def bench_prompts(batch: int, context: int | None, vocab: int, repeats: int = 1
                  ) -> list[list[int]]:
    """`batch` prompts of a random phrase repeated `repeats` times (so NGRAM's lookups find
    matches): PROMPT_LEN tokens a phrase, or `context` tokens a prompt."""
    phrase = PROMPT_LEN if context is None else max(context // repeats, 1)
    return [prompt * repeats for prompt in random_prompts(batch, phrase, vocab, seed=batch)]


def model_label(args) -> str:
    """The rows' name for the target of the demo, spec and ngram rows."""
    return "demo" if args.model_path is None else Path(args.model_path).name


def result_row(model: str, kind: str, batch: int, engine_ms: float, device_ms: float,
               floor_ms: float, steps: int, engine_cpu_ms: float, tokens_per_step: float
               ) -> dict:
    return {"model": model, "kind": kind, "batch": batch, "engine_ms": engine_ms,
            "device_ms": device_ms, "floor_ms": floor_ms, "steps": steps,
            "engine_cpu_ms": engine_cpu_ms, "tokens_per_step": tokens_per_step,
            "engine_cpu_ms_per_token": engine_cpu_ms / tokens_per_step,
            "engine_over_floor": engine_ms / floor_ms, "engine_over_device": engine_ms / device_ms}


def _kind(step: str, args) -> str:
    """The rows' step name, saying how the loop ran and over what prompts if not the default."""
    step = step if args.context is None else f"{step}, {args.context}-token prompts"
    step = f"{step}, code edits" if args.dataset == "code-edits" else step
    return f"{step} (sync)" if args.disable_overlap_schedule else step


def print_row(row: dict) -> None:
    kernels = row.get("decode_kernels")
    print(f"| {row['model']} | {row['kind']} | {row['batch']} | {row['engine_ms']:.2f} | "
          f"{row['engine_cpu_ms']:.2f} | {row['tokens_per_step']:.1f} | "
          f"{row['engine_cpu_ms_per_token']:.3f} | {row['device_ms']:.2f} | "
          f"{row['floor_ms']:.2f} | {row['engine_over_device']:.2f}x | "
          f"{row['engine_over_floor']:.2f}x | {'-' if kernels is None else kernels} |",
          flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows, machine = [], machine_info()

    def add(row: dict) -> None:
        rows.append(row)
        print_row(row)
        if args.json:  # after every row: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))

    print(json.dumps(machine))
    print("| model | step | batch | engine ms | engine CPU ms | tokens / step | "
          "engine CPU ms / token | device ms | floor ms | engine / device | engine / floor | "
          "decode kernels |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    wanted = set(args.rows.split(","))
    if "tiny" in wanted:
        from sgl_jax.testing import write_tiny_checkpoint

        with tempfile.TemporaryDirectory(prefix="tiny-llama-") as tiny:
            write_tiny_checkpoint(Path(tiny), "llama", backend="numpy", **TINY_LLAMA)
            for row in bench_plain(tiny, "tiny", args.tiny_batch_sizes, args):
                add(row)
    batches = args.demo_batch_sizes
    for row in (bench_plain(args.model_path, model_label(args), batches, args, dtype=args.dtype,
                            quantization=args.quantization) if "demo" in wanted else ()):
        add(row)
    for row in bench_speculative(batches, args) if "spec" in wanted else ():
        add(row)
    for row in bench_speculative(batches, args, "NGRAM") if "ngram" in wanted else ():
        add(row)
    for row in bench_adaptive_ngram(batches, args) if "ngram-adaptive" in wanted else ():
        add(row)
    return rows


if __name__ == "__main__":
    main()
