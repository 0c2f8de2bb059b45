"""Offline throughput of the real sgl_jax.Engine, beside transformers' batched generate.

Like SGLang's bench_offline_throughput: N random prompts of --input-len tokens are submitted
at once, in one `engine.generate(input_ids=[...], sampling_params=...)` call, and each
generates exactly --output-len tokens (greedy, `ignore_eos`). The concurrency c is the
engine's `max_running_requests`, as on a server: the scheduler admits up to c requests and
admits the next ones as the running ones finish. One Engine is started per concurrency level,
with its start-up (weights, KV pool, compilation of every bucket) timed separately, and shut
down afterwards. The timed call compiles nothing (the script checks the engine's counter).

transformers runs the same prompts in batches of c through `model.generate` on the same
checkpoint, right after our run at that level (so the two are measured minutes apart at most
on a machine whose memory bandwidth drifts), in a process of its own with torch's defaults
(benchmark/transformers_peer.py) while this one waits. A full pass at c=1 takes long, so by
default it times only --transformers-requests prompts (rounded up to whole batches) and
reports their rate; every batch has the same shape, so the rate stands for all N.

    python benchmark/bench_offline_throughput.py                  # the demo model, float32
    python benchmark/bench_offline_throughput.py --concurrency 16 --json /tmp/offline.json
    python benchmark/bench_offline_throughput.py --model-path random  # a random ~66M Llama
    python benchmark/bench_offline_throughput.py --model-path DIR --no-compare-transformers
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import sys
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
from bench_one_batch import (  # noqa: E402
    int_list,
    machine_info,
    model_or_demo,
    random_llama,
    random_prompts,
    time_weight_products,
)
from transformers_peer import describe_peer, run_peer, vocab_size  # noqa: E402

from sgl_jax.demo import DEMO_MODEL_NAME  # noqa: E402
from sgl_jax.model_executor.forward_batch import EXTEND_Q_BLOCK  # noqa: E402

TARGET_CONCURRENCY = 16
TARGET_RATIO = 3.0  # ours >= 3x transformers' output tok/s at batch 16

# The random Llama of bench_one_batch: 66.3M parameters, 265 MB in float32.
TINY_LLAMA = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                  vocab_size=32000, num_attention_heads=8, num_key_value_heads=8,
                  max_position_embeddings=4096)


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None,
                        help="a checkpoint directory, hub id or .gguf file; 'random': a random "
                             f"~66M Llama (default: the demo model, {DEMO_MODEL_NAME})")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where to write the random checkpoint (default: a temp dir); "
                             "reused if it already holds a matching one")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 16],
                        help="max requests in flight (the engine's max_running_requests)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-prefill-tokens", type=int, default=2048)
    parser.add_argument("--context-length", type=int, default=None,
                        help="the engine's context_length (default: the model's)")
    parser.add_argument("--token-paddings", type=int_list, default=None,
                        help="the engine's precompile_token_paddings (default: the extend "
                             "batches this run makes: 1, 4, 16, ... prompts up to c, capped at "
                             "--max-prefill-tokens)")
    parser.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the same N prompts with max_new_tokens=1 (prefill "
                             "only) to split the time into prefill and decode")
    parser.add_argument("--compare-transformers", action=argparse.BooleanOptionalAction,
                        default=True, help="time transformers' batched generate")
    parser.add_argument("--transformers-requests", type=int, default=32,
                        help="prompts transformers runs per level (rounded up to whole batches "
                             "of c, at most N); its tok/s is a rate, so it stands for all N")
    parser.add_argument("--engine-log", action="store_true",
                        help="show the engine's INFO log (compilations, prefill/decode lines)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure to this file")
    args = parser.parse_args(argv)
    for name in ("num_requests", "input_len", "output_len", "transformers_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# --------------------------------------------------------------------------- setup


def prepare_checkpoint(args: argparse.Namespace, scratch: contextlib.ExitStack) -> str:
    """--model-path (the demo model by default), or for 'random' the random Llama written
    into --checkpoint-dir (reused when its config matches) or into a temporary directory
    removed when `scratch` closes."""
    if (path := model_or_demo(args.model_path)) is not None:
        return path
    overrides = dict(TINY_LLAMA, max_position_embeddings=max(
        TINY_LLAMA["max_position_embeddings"], args.input_len + args.output_len))
    return random_llama(args.checkpoint_dir, scratch, overrides, args.dtype, "bench_offline_")


def engine_settings(args: argparse.Namespace, c: int) -> dict:
    """Server arguments for concurrency c: decode buckets 1, 2, 4, ... up to c; extend buckets
    for the batches this workload makes (1, 4, 16, ... prompts, up to c), so a 128-token
    prompt is not padded to a 256-token bucket."""
    q = EXTEND_Q_BLOCK  # extend buckets are multiples of it; each prompt is block-aligned
    prompt = -(-args.input_len // q) * q
    cap = max(q, args.max_prefill_tokens // q * q)
    if args.token_paddings:
        tokens = sorted(set(args.token_paddings))
    else:
        tokens, k = set(), 1
        while True:
            tokens.add(min(k * prompt, cap))
            if k >= c:
                break
            k = min(4 * k, c)
        tokens = sorted(tokens)
    bs, b = [], 1
    while b < c:
        bs.append(b)
        b *= 2
    settings = dict(
        dtype=args.dtype, page_size=args.page_size, max_running_requests=c,
        max_prefill_tokens=args.max_prefill_tokens,
        precompile_bs_paddings=[*bs, c], precompile_token_paddings=tokens,
        random_seed=args.seed,
    )
    if args.context_length:
        settings["context_length"] = args.context_length
    return settings


# --------------------------------------------------------------------------- our engine


def bench_engine(path: str, prompts: list[list[int]], c: int, args) -> dict:
    """Start an Engine with max_running_requests=c, time all prompts through it, shut it down."""
    settings = engine_settings(args, c)
    start = time.perf_counter()
    engine = sgl_jax.Engine(model_path=path, **settings)
    startup_s = time.perf_counter() - start
    try:
        greedy = {"temperature": 0.0, "max_new_tokens": args.output_len, "ignore_eos": True}
        # One untimed round on other prompts warms the host-side paths; then forget its KV.
        warm = random_prompts(min(c, len(prompts)), args.input_len,
                              engine.model.config.vocab_size, args.seed + 1)
        engine.generate(input_ids=warm, sampling_params={**greedy, "max_new_tokens": 2})
        engine.flush_cache()
        compilations = engine.get_server_info()["num_compilations"]

        start = time.perf_counter()
        outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
        wall_s = time.perf_counter() - start

        info = engine.get_server_info()
        new_compilations = info["num_compilations"] - compilations
        latencies = np.array([o["meta_info"]["e2e_latency"] for o in outputs])
        tokens = [o["output_ids"] for o in outputs]
        wrong = [i for i, t in enumerate(tokens) if len(t) != args.output_len]
        if wrong:
            raise RuntimeError(f"requests {wrong[:5]} did not produce {args.output_len} tokens")
        n, out_tokens = len(prompts), len(prompts) * args.output_len
        result = {
            "concurrency": c, "engine_settings": settings, "startup_s": startup_s,
            "wall_s": wall_s, "output_tok_s": out_tokens / wall_s,
            "total_tok_s": (out_tokens + n * args.input_len) / wall_s,
            "request_s": n / wall_s,
            "mean_e2e_s": float(latencies.mean()), "p50_e2e_s": float(np.median(latencies)),
            "max_e2e_s": float(latencies.max()),
            "compilations_at_startup": compilations,
            "recompilations_while_timed": new_compilations,
            "kv_pool_tokens": info["max_total_num_tokens"],
            "num_retractions": info["num_retractions"],
            "tokens": tokens,
        }
        if args.breakdown:
            engine.flush_cache()  # the same prompts again, so nothing may come from the cache
            start = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": 1})
            prefill_s = time.perf_counter() - start
            waves = -(-n // c)  # prompts are admitted c at a time, all finishing together
            decode_steps = waves * (args.output_len - 1)
            result.update(
                prefill_only_s=prefill_s, prefill_share=prefill_s / wall_s,
                decode_s=wall_s - prefill_s, decode_steps=decode_steps,
                decode_ms_per_step=(wall_s - prefill_s) / max(decode_steps, 1) * 1e3,
                prefill_tok_s=n * args.input_len / prefill_s,
            )
            result.update(products_ceiling(engine.model, n, c, args))
    finally:
        engine.shutdown()
        del engine
        gc.collect()
    return result


def products_ceiling(model, n: int, c: int, args) -> dict:
    """The most output tok/s this workload could reach if only the model's weight matrix
    products cost anything: no attention, norms, sampling, scheduling or padding.

    Each wave of c prompts is prefilled in extend batches of at most --max-prefill-tokens
    (each gives one logits row per prompt), then decoded for output_len - 1 steps of c rows.
    """
    prompt = -(-args.input_len // EXTEND_Q_BLOCK) * EXTEND_Q_BLOCK
    per_extend = min(c, max(1, args.max_prefill_tokens // prompt))
    prefill_ms = -(-c // per_extend) * time_weight_products(model, per_extend * prompt,
                                                            per_extend)
    decode_ms = time_weight_products(model, c)
    wall_s = -(-n // c) * (prefill_ms + (args.output_len - 1) * decode_ms) / 1e3
    return {"floor_prefill_ms_per_wave": prefill_ms, "floor_decode_ms_per_step": decode_ms,
            "ceiling_output_tok_s": n * args.output_len / wall_s}


# --------------------------------------------------------------------------- transformers


def bench_transformers(path: str, prompts: list[list[int]], c: int, args) -> dict:
    """The first K prompts (K = --transformers-requests rounded up to batches of c, at most N)
    in batches of c through greedy generate, in a child process with torch's defaults;
    output tok/s over the whole pass."""
    k = min(len(prompts), max(c, -(-args.transformers_requests // c) * c))
    hf = run_peer({"task": "throughput", "model_path": path, "dtype": args.dtype,
                   "output_len": args.output_len, "concurrency": c, "prompts": prompts[:k]})
    hf.update(concurrency=c, extrapolated=k < len(prompts),
              total_tok_s=k * (args.output_len + args.input_len) / hf["wall_s"])
    return hf


# --------------------------------------------------------------------------- comparisons


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Over the requests both ran: the share of identical token positions and of identical
    requests, and the first position where they part (None if never)."""
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    same = x == y
    diverged = [int(np.argmin(row)) for row in same if not row.all()]
    return {"requests": n, "token_agreement": float(same.mean()),
            "identical_requests": int(same.all(axis=1).sum()),
            "first_divergence": min(diverged) if diverged else None}


# --------------------------------------------------------------------------- report


def print_table(ours: list[dict], hf: dict[int, dict], args) -> None:
    header = (f"{'conc':>4} {'ours out tok/s':>14} {'ours total tok/s':>16} {'mean e2e s':>10} "
              f"{'HF out tok/s':>12} {'HF reqs':>7} {'ours/HF':>8} {'startup s':>9}")
    print(header)
    print("-" * len(header))
    for r in ours:
        h = hf.get(r["concurrency"])
        hf_rate = f"{h['output_tok_s']:.1f}" if h else "-"
        hf_reqs = f"{h['requests']}" if h else "-"
        ratio = f"{r['output_tok_s'] / h['output_tok_s']:.2f}x" if h else "-"
        print(f"{r['concurrency']:>4} {r['output_tok_s']:>14.1f} {r['total_tok_s']:>16.1f} "
              f"{r['mean_e2e_s']:>10.2f} {hf_rate:>12} {hf_reqs:>7} {ratio:>8} "
              f"{r['startup_s']:>9.1f}")
    if any(h["extrapolated"] for h in hf.values()):
        print(f"HF reqs < {args.num_requests}: transformers timed that many of the prompts; its "
              "tok/s is the rate over them (every batch has the same shape), not a full pass.")
    if ours and "prefill_only_s" in ours[0]:
        print("\nWhere our time goes (prefill-only = the same prompts with max_new_tokens=1):")
        head = (f"{'conc':>4} {'total s':>8} {'prefill-only s':>14} {'prefill share':>13} "
                f"{'prefill tok/s':>13} {'decode s':>8} {'decode ms/step':>14} "
                f"{'decode tok/s':>12} {'floor prefill ms':>16} {'floor step ms':>13} "
                f"{'ceiling tok/s':>13}")
        print(head)
        print("-" * len(head))
        for r in ours:
            c = r["concurrency"]
            print(f"{c:>4} {r['wall_s']:>8.2f} {r['prefill_only_s']:>14.2f} "
                  f"{r['prefill_share']:>13.0%} {r['prefill_tok_s']:>13.0f} "
                  f"{r['decode_s']:>8.2f} {r['decode_ms_per_step']:>14.2f} "
                  f"{c / r['decode_ms_per_step'] * 1e3 if r['decode_ms_per_step'] else 0:>12.1f} "
                  f"{r['floor_prefill_ms_per_wave']:>16.1f} {r['floor_decode_ms_per_step']:>13.2f} "
                  f"{r['ceiling_output_tok_s']:>13.1f}")
        print("floor = the weight matrix products alone (prefill: per wave of c prompts; "
              "decode: per step of c rows); ceiling = output tok/s if nothing else cost "
              "anything")


def summarize(ours: list[dict], hf: dict[int, dict], args) -> dict:
    summary: dict = {}
    base = ours[0]
    consistency = {r["concurrency"]: agreement(base["tokens"], r["tokens"]) for r in ours[1:]}
    summary["consistency_vs_first_level"] = consistency
    all_same = (all(a["token_agreement"] == 1.0 for a in consistency.values())
                if consistency else None)  # None: a single level, nothing to compare
    summary["outputs_identical_across_concurrency"] = all_same
    if consistency:
        detail = ", ".join(f"c={c}: {a['identical_requests']}/{a['requests']} requests, "
                           f"{a['token_agreement']:.1%} of tokens" for c, a in consistency.items())
        print(f"Outputs identical across concurrency levels (vs c={base['concurrency']}): "
              f"{'YES' if all_same else 'NO'} ({detail})")
    recompiled = {r["concurrency"]: r["recompilations_while_timed"] for r in ours}
    summary["recompilations_while_timed"] = recompiled
    print(f"Compilations during the timed runs: {recompiled}")

    agree = {}
    for r in ours:
        h = hf.get(r["concurrency"])
        if h:
            agree[r["concurrency"]] = agreement(r["tokens"], h["tokens"])
    summary["greedy_agreement_with_transformers"] = agree
    if agree:
        print("Greedy tokens vs transformers: " + ", ".join(
            f"c={c}: {a['token_agreement']:.1%} of tokens, {a['identical_requests']}/"
            f"{a['requests']} requests identical" for c, a in agree.items()))

    target = next((r for r in ours if r["concurrency"] == TARGET_CONCURRENCY), None)
    h = hf.get(TARGET_CONCURRENCY)
    if target is None or h is None:
        summary["target_met"] = None
        print(f"Target (ours >= {TARGET_RATIO:g}x transformers' output tok/s at concurrency "
              f"{TARGET_CONCURRENCY}): NOT EVALUATED (needs concurrency {TARGET_CONCURRENCY} "
              "and the transformers comparison)")
    else:
        ratio = target["output_tok_s"] / h["output_tok_s"]
        summary.update(target_ratio=ratio, target_met=ratio >= TARGET_RATIO)
        print(f"Target: ours >= {TARGET_RATIO:g}x transformers' output tok/s at concurrency "
              f"{TARGET_CONCURRENCY}: {target['output_tok_s']:.1f} vs {h['output_tok_s']:.1f} "
              f"tok/s = {ratio:.2f}x -> {'MET' if ratio >= TARGET_RATIO else 'MISSED'}")
        if "ceiling_output_tok_s" in target:
            ceiling = target["ceiling_output_tok_s"] / h["output_tok_s"]
            summary["ceiling_ratio"] = ceiling
            print(f"  ceiling (weight products only, everything else free): "
                  f"{target['ceiling_output_tok_s']:.1f} tok/s = {ceiling:.2f}x transformers")
    return summary


def _versions() -> dict:
    """Of this process; the transformers peer reports its own (torch, transformers)."""
    out = {}
    for name in ("jax", "jaxlib", "numpy"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.engine_log else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    with contextlib.ExitStack() as scratch:
        return run(args, prepare_checkpoint(args, scratch))


def run(args: argparse.Namespace, path: str) -> dict:
    info = machine_info()
    info["versions"] = _versions()
    print(f"Machine: {info['platform']}, {info['cpu_count']} CPUs, "
          f"{info['memory_gib'] or 0:.0f} GiB, JAX {info['jax_version']} on {info['devices']}, "
          f"commit {info['git_commit']}")
    print(f"Workload: {args.num_requests} requests x ({args.input_len} prompt + "
          f"{args.output_len} output tokens), greedy, ignore_eos, {args.dtype}, "
          f"concurrency {args.concurrency}", flush=True)

    prompts = random_prompts(args.num_requests, args.input_len, vocab_size(path), args.seed)
    ours, hf = [], {}
    for c in args.concurrency:
        r = bench_engine(path, prompts, c, args)
        ours.append(r)
        print(f"  c={c:>3} ours: start-up {r['startup_s']:.1f} s "
              f"({r['compilations_at_startup']} compilations), {r['wall_s']:.2f} s for "
              f"{args.num_requests} requests -> {r['output_tok_s']:.1f} output tok/s, "
              f"{r['recompilations_while_timed']} compilations while timed"
              + (f"; prefill-only {r['prefill_only_s']:.2f} s" if args.breakdown else ""),
              flush=True)
        if args.compare_transformers:
            h = bench_transformers(path, prompts, c, args)
            hf[c] = h
            print(f"  c={c:>3} transformers: {h['wall_s']:.2f} s for {h['requests']} requests "
                  f"({h['batches']} batch(es)) -> {h['output_tok_s']:.1f} output tok/s; "
                  f"{describe_peer(h['environment'])}", flush=True)

    print()
    print(f"bench_offline_throughput: {args.num_requests} requests, input_len={args.input_len}, "
          f"output_len={args.output_len}, page_size={args.page_size}, dtype={args.dtype}")
    print_table(ours, hf, args)
    print()
    summary = summarize(ours, hf, args)
    report = {"machine": info, "args": vars(args), "checkpoint": path, "results": ours,
              "transformers": {
                  "method": "one child process per c with torch's defaults (its settings in "
                            "each level's 'environment'); batches of c through generate("
                            "max_new_tokens=min_new_tokens=output_len, do_sample=False) with "
                            "the generation config's eos_token_id cleared (= ignore_eos); one "
                            "untimed 2-token warm-up",
                  "by_concurrency": hf},
              "summary": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"Wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
