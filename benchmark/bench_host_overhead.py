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

The tiny model is a random Llama as transformers writes it (2 layers, hidden 64, vocab 512);
the demo model is SmolLM2-135M-Instruct (float32), plain, with its shipped EAGLE3 head, and
with NGRAM (whose drafting on the host is part of the engine's time and not the replay's).

    python benchmark/bench_host_overhead.py                      # tiny 1,32,128,256; demo 1,32
    python benchmark/bench_host_overhead.py --tiny-batch-sizes 1,128 --rows tiny
    python benchmark/bench_host_overhead.py --json /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
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
                             "with its EAGLE3 head), ngram (demo rounds drafted by NGRAM)")
    parser.add_argument("--steps", type=int, default=256, help="timed decode steps")
    parser.add_argument("--short", type=int, default=16,
                        help="new tokens of the run whose time is subtracted")
    parser.add_argument("--spec-shape", default="3,1,4",
                        help="num_steps,topk,num_draft_tokens of the speculative rows")
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="time the synchronous engine loop instead (the rows say 'sync')")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- the engine


def make_engine(model_path: str | None, batch: int, **extra):
    """An engine whose only decode bucket is `batch` (start-up compiles little)."""
    return sgl_jax.Engine(
        model_path, dtype="float32", max_running_requests=batch,
        precompile_bs_paddings=(batch,), precompile_token_paddings=(max(64, 16 * batch),),
        max_prefill_tokens=max(64, 16 * batch), log_level="warning", decode_log_interval=10**9,
        **extra)


def engine_run_seconds(engine, prompts: list[list[int]], new_tokens: int) -> float:
    engine.flush_cache()  # every run prefills the same way
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
    return time.perf_counter() - start


def scheduler_counters(engine) -> tuple[int]:
    """(decode steps or speculative rounds of the whole batch) the engine has run so far."""
    return engine.runtime.call(lambda scheduler: (scheduler.stats.num_decode_steps,))


def engine_and_replay_ms(engine, owner, dispatches: tuple[str, ...], prompts: list[list[int]],
                         short: int, steps: int) -> tuple[float, float, float, int]:
    """(engine, device, floor) ms per decode step or round, and the steps or rounds counted.
    Each is the difference between a run of `short` + `steps` new tokens and one of `short`
    over the steps between them: the engine's from its runs (the faster of two), device and
    floor from replays of the calls of `owner`'s `dispatches` that a third run made."""
    engine_run_seconds(engine, prompts, short + steps)  # first runs of every program
    seconds, calls, counts = {}, {}, {}
    for new in (short, short + steps):
        seconds[new] = min(engine_run_seconds(engine, prompts, new) for _ in range(2))
        before = scheduler_counters(engine)[0]
        with recorded_dispatches(owner, dispatches) as calls[new]:
            engine_run_seconds(engine, prompts, new)
        counts[new] = scheduler_counters(engine)[0] - before
    taken = counts[short + steps] - counts[short]

    def per_step(run_seconds) -> float:
        return 1e3 * (run_seconds(short + steps) - run_seconds(short)) / taken

    def replay_ms(read_each: bool) -> float:
        return per_step(lambda new: min(replay_seconds(calls[new], read_each) for _ in range(2)))

    return per_step(seconds.get), replay_ms(read_each=False), replay_ms(read_each=True), taken


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


def bench_plain(model_path: str | None, label: str, batch: int, args) -> dict:
    engine = make_engine(model_path, batch,
                         disable_overlap_schedule=args.disable_overlap_schedule)
    try:
        prompts = random_prompts(batch, PROMPT_LEN, engine.model.config.vocab_size, seed=batch)
        timings = engine_and_replay_ms(engine, engine.runtime.runner, ("launch",), prompts,
                                       args.short, args.steps)
    finally:
        engine.shutdown()
    return result_row(label, _kind("decode", args), batch, *timings)


def bench_speculative(batch: int, args, algorithm: str = "EAGLE3") -> dict:
    """Rounds of the demo model with its EAGLE3 head, or with NGRAM: the host then also
    looks up every request's text each round (prompts that repeat a phrase, so lookups
    find matches), which the replay does not do."""
    steps, topk, draft_tokens = (int(x) for x in args.spec_shape.split(","))
    engine = make_engine(None, batch, disable_overlap_schedule=args.disable_overlap_schedule,
                         speculative_algorithm=algorithm,
                         speculative_num_steps=steps, speculative_eagle_topk=topk,
                         speculative_num_draft_tokens=draft_tokens,
                         speculative_adaptive=False)
    try:
        prompts = random_prompts(batch, PROMPT_LEN, engine.model.config.vocab_size, seed=batch)
        if algorithm == "NGRAM":
            prompts = [prompt * 4 for prompt in prompts]
        timings = engine_and_replay_ms(engine, engine.runtime.spec_runner, ("prefill", "round"),
                                       prompts, args.short, args.steps)
    finally:
        engine.shutdown()
    label = "demo" if algorithm == "EAGLE3" else f"demo {algorithm}"
    return result_row(label, _kind(f"round {args.spec_shape.replace(',', '/')}", args), batch,
                      *timings)


def result_row(model: str, kind: str, batch: int, engine_ms: float, device_ms: float,
               floor_ms: float, steps: int) -> dict:
    return {"model": model, "kind": kind, "batch": batch, "engine_ms": engine_ms,
            "device_ms": device_ms, "floor_ms": floor_ms, "steps": steps,
            "engine_over_floor": engine_ms / floor_ms, "engine_over_device": engine_ms / device_ms}


def _kind(step: str, args) -> str:
    return f"{step} (sync)" if args.disable_overlap_schedule else step


def print_row(row: dict) -> None:
    print(f"| {row['model']} | {row['kind']} | {row['batch']} | {row['engine_ms']:.2f} | "
          f"{row['device_ms']:.2f} | {row['floor_ms']:.2f} | {row['engine_over_device']:.2f}x | "
          f"{row['engine_over_floor']:.2f}x |", flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    print(json.dumps(machine_info()))
    print("| model | step | batch | engine ms | device ms | floor ms | engine / device | "
          "engine / floor |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    wanted = set(args.rows.split(","))
    with contextlib.ExitStack() as scratch:
        from sgl_jax.testing import write_tiny_checkpoint

        tiny = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="tiny-llama-")))
        write_tiny_checkpoint(tiny, "llama", backend="numpy", **TINY_LLAMA)
        for batch in args.tiny_batch_sizes if "tiny" in wanted else []:
            rows.append(bench_plain(str(tiny), "tiny", batch, args))
            print_row(rows[-1])
    for batch in args.demo_batch_sizes if "demo" in wanted else []:
        rows.append(bench_plain(None, "demo", batch, args))
        print_row(rows[-1])
    for batch in args.demo_batch_sizes if "spec" in wanted else []:
        rows.append(bench_speculative(batch, args))
        print_row(rows[-1])
    for batch in args.demo_batch_sizes if "ngram" in wanted else []:
        rows.append(bench_speculative(batch, args, "NGRAM"))
        print_row(rows[-1])
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "rows": rows},
                                              indent=1))
    return rows


if __name__ == "__main__":
    main()
