"""The engine loop's host overhead: engine ms per decode step (and per speculative round)
beside the device-only time of the same programs and a synchronous floor.

For each batch size b, b random prompts generate greedily with `ignore_eos` through
`Engine.generate`. The engine's ms per step is the difference between a run of
`--short` + `--steps` new tokens and one of `--short`, over `--steps` (so prefill, start and
finish cancel out); a speculative round's is that difference over the rounds it took.
Beside it, on the engine's own runner and compiled programs:

- device: the same step program (a decode batch of b rows at the run's mean context)
  dispatched `--steps` times back to back, each call's output feeding the next, read once
  at the end: what the device needs, with no host work between steps;
- floor: the same program called in a Python loop that reads each step's tokens back to
  the host and feeds them in as the next inputs: the best a synchronous loop can do.

The tiny model is a random Llama as transformers writes it (2 layers, hidden 64, vocab 512);
the demo model is SmolLM2-135M-Instruct (float32), plain and with its shipped EAGLE3 head.

    python benchmark/bench_host_overhead.py                      # tiny 1,32,128,256; demo 1,32
    python benchmark/bench_host_overhead.py --tiny-batch-sizes 1,128 --rows tiny
    python benchmark/bench_host_overhead.py --json /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
try:
    import sgl_jax
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_HERE.parent))
    import sgl_jax
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))
import jax  # noqa: E402
from bench_one_batch import int_list, machine_info, random_prompts  # noqa: E402

from sgl_jax.model_executor.forward_batch import SeqChunk  # noqa: E402
from sgl_jax.model_executor.model_runner import greedy_sampling_batch  # noqa: E402

TINY_LLAMA = dict(num_hidden_layers=2)  # the "llama" test preset: hidden 64, vocab 512
PROMPT_LEN = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-batch-sizes", type=int_list, default=[1, 32, 128, 256])
    parser.add_argument("--demo-batch-sizes", type=int_list, default=[1, 32])
    parser.add_argument("--rows", default="tiny,demo,spec",
                        help="which rows: tiny (decode), demo (decode), spec (demo rounds)")
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
    return engine._require_loop().call(lambda scheduler: (scheduler.stats.num_decode_steps,))


def engine_ms_per_step(engine, prompts, short: int, steps: int) -> tuple[float, int]:
    """(ms per decode step or round, steps or rounds counted) from the difference of a long
    and a short run, each the faster of two."""
    engine_run_seconds(engine, prompts, short + steps)  # first runs of every program
    times, counts = {}, {}
    for new in (short, short + steps):
        best = float("inf")
        for _ in range(2):
            before = scheduler_counters(engine)[0]
            best = min(best, engine_run_seconds(engine, prompts, new))
            counts[new] = scheduler_counters(engine)[0] - before
        times[new] = best
    steps_taken = counts[short + steps] - counts[short]
    return 1e3 * (times[short + steps] - times[short]) / steps_taken, steps_taken


# --------------------------------------------------------------------------- the programs


def row_pages(batch: int, context: int, page_size: int, num_pages: int) -> np.ndarray:
    """i32[batch, pages each]: each row's own KV pages for `context` tokens plus a round's
    lookahead. Rows never share pages, as a served batch's requests do not: rows reading
    one set of pages would find them in the CPU's caches and run faster than any batch the
    engine serves."""
    each = -(-context // page_size)
    if 1 + batch * each > num_pages:
        raise ValueError(f"{batch} rows of {each} pages need more than the pool's {num_pages}")
    return 1 + np.arange(batch * each, dtype=np.int32).reshape(batch, each)  # page 0: null


def num_kv_pages(runner) -> int:
    return runner.kv_cache[0][0].shape[0]  # a Llama-shaped model: every layer has pages


def decode_chunks(batch: int, context: int, runner) -> list[SeqChunk]:
    """b decode rows at `context` tokens, each over its own pages."""
    pages = row_pages(batch, context + 1, runner.page_size, num_kv_pages(runner))
    return [SeqChunk([1], context, list(row)) for row in pages]


def replay_ms(runner, chunks: list[SeqChunk], steps: int, read_each: bool) -> float:
    """ms per call of the runner's compiled decode program for `chunks`: back to back (the
    device's time), or reading each step's tokens back and feeding them in (the floor)."""
    from sgl_jax.model_executor.forward_batch import build_forward_batch

    shape = runner.buckets.shape_for(chunks)
    batch = build_forward_batch(chunks, page_size=runner.page_size, shape=shape)
    rows = shape.num_logits
    sampling = greedy_sampling_batch(rows, runner.config.vocab_size)
    no_slots, emits = np.full(rows, -1, np.int32), np.ones(rows, bool)

    def run(count: int) -> float:
        step_batch = batch
        start = time.perf_counter()
        for _ in range(count):
            pending = runner.launch(step_batch, sampling, no_slots, no_slots, emits, rows,
                                    want_top_logprobs=False, want_logprobs=False)
            if read_each:
                tokens = pending.result().tokens
                step_batch = dataclasses.replace(step_batch, input_ids=tokens)
        pending.result()
        jax.block_until_ready(runner.kv_cache)
        return time.perf_counter() - start

    run(3)
    return 1e3 * min(run(steps) for _ in range(2)) / steps


def round_replay_ms(spec, batch: int, context: int, steps: int, read_each: bool) -> float:
    """ms per speculative round of the flags' shape on b rows at `context`: the round program
    dispatched back to back (device), or through SpecRunner.round, which reads every round's
    results back (floor)."""
    from sgl_jax.speculative.spec_runner import RoundRows

    padded = spec.target.buckets.batch_padding(batch)
    pages = row_pages(batch, context + spec.lookahead, spec.page_size,
                      num_kv_pages(spec.target))
    page_table = np.zeros((padded, spec.target.buckets.pages_per_seq), np.int32)
    page_table[:batch, : pages.shape[1]] = pages
    real = np.arange(padded) < batch
    rows = RoundRows(slots=np.where(real, np.arange(padded), -1).astype(np.int32),
                     page_table=page_table, kv_lens=np.where(real, context, 0).astype(np.int32),
                     root_tokens=real.astype(np.int32), min_new_tokens=np.zeros(padded, np.int32),
                     state_slots=np.zeros(padded, np.int32))
    sampling = greedy_sampling_batch(padded, spec.vocab_size)
    program = spec._rounds[spec.shape]

    def run(count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            if read_each:
                spec.round(rows, sampling, False, num_rows=batch).result()
                continue
            (spec.target.kv_cache, spec.draft_kv, spec.slot_state, spec.target.last_tokens,
             _) = program(spec.target.model.params, spec.draft.params, spec.target.kv_cache,
                          spec.draft_kv, spec.slot_state, spec.target.last_tokens, rows,
                          sampling, np.bool_(False))
        jax.block_until_ready((spec.target.kv_cache, spec.draft_kv))
        return time.perf_counter() - start

    run(3)
    return 1e3 * min(run(steps) for _ in range(2)) / steps


# --------------------------------------------------------------------------- rows


def bench_plain(model_path: str | None, label: str, batch: int, args) -> dict:
    engine = make_engine(model_path, batch,
                         disable_overlap_schedule=args.disable_overlap_schedule)
    try:
        vocab = engine.model.config.vocab_size
        prompts = random_prompts(batch, PROMPT_LEN, vocab, seed=batch)
        engine_ms, steps = engine_ms_per_step(engine, prompts, args.short, args.steps)
        runner = engine._runner
        chunks = decode_chunks(batch, PROMPT_LEN + args.short + args.steps // 2, runner)
        device = replay_ms(runner, chunks, args.steps, read_each=False)
        floor = replay_ms(runner, chunks, args.steps, read_each=True)
    finally:
        engine.shutdown()
    return {"model": label, "kind": _kind("decode", args), "batch": batch,
            "engine_ms": engine_ms,
            "device_ms": device, "floor_ms": floor, "steps": steps,
            "engine_over_floor": engine_ms / floor, "engine_over_device": engine_ms / device}


def bench_speculative(batch: int, args) -> dict:
    steps, topk, draft_tokens = (int(x) for x in args.spec_shape.split(","))
    engine = make_engine(None, batch, disable_overlap_schedule=args.disable_overlap_schedule,
                         speculative_algorithm="EAGLE3",
                         speculative_num_steps=steps, speculative_eagle_topk=topk,
                         speculative_num_draft_tokens=draft_tokens,
                         speculative_adaptive=False)
    try:
        prompts = random_prompts(batch, PROMPT_LEN, engine.model.config.vocab_size, seed=batch)
        engine_ms, rounds = engine_ms_per_step(engine, prompts, args.short, args.steps)
        context = PROMPT_LEN + args.short + args.steps // 2
        rounds_timed = max(8, rounds // 2)
        device = round_replay_ms(engine._spec, batch, context, rounds_timed, read_each=False)
        floor = round_replay_ms(engine._spec, batch, context, rounds_timed, read_each=True)
    finally:
        engine.shutdown()
    return {"model": "demo", "kind": _kind(f"round {args.spec_shape.replace(',', '/')}", args),
            "batch": batch, "engine_ms": engine_ms, "device_ms": device, "floor_ms": floor,
            "steps": rounds, "engine_over_floor": engine_ms / floor,
            "engine_over_device": engine_ms / device}


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
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "rows": rows},
                                              indent=1))
    return rows


if __name__ == "__main__":
    main()
