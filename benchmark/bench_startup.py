"""Start-up time of the server: a first start (empty caches) and a second start, each timed
from launch to /health answering and to the first streamed token of a chat request; then,
right after /health, bursts of concurrent chat requests, each timed to its slowest answer
(while larger batch buckets are still being built in the background).

    python benchmark/bench_startup.py                      # the demo model, default flags
    python benchmark/bench_startup.py --bursts 1,4,8,16,32 -- --speculative-algorithm EAGLE3 \
        --speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8
    python benchmark/bench_startup.py --model-path M.gguf --json out.json -- --dtype float32

With `--soak N`, each start then serves N mixed chat requests (prompts of 1-60 words,
8-64 tokens, a third streamed) at `--soak-concurrency` (48) right after the bursts, and the
same N again once the first soak has had every batch bucket it needed built: the ratio of
the two wall times is what compiling while serving costs. `--tiny-eagle3-tree` serves a tiny
random Llama with a random EAGLE3 head (tree 3/4/8) instead of the demo model:

    python benchmark/bench_startup.py --tiny-eagle3-tree --soak 400 --starts 1

With `--settle S`, each start waits (up to S s) before it stops for its background builder
to finish what serving asked of it, so the next start is the restart of a server that ran a
while rather than of one stopped mid-build; `--log-dir D` keeps each start's server log.

With `--programs`, no server starts: the programs an accelerator start builds are counted
and traced and lowered for TPU and CUDA on this host (sgl_jax.testing.lowering's recorder), for
the README's plain and EAGLE3 demo servers and for Llama-3.1-8B's layer structure with an
EAGLE3 head: every program (a start before the background builder), and those a server needs
before it reports ready (prefills and the smallest batch bucket).

    python benchmark/bench_startup.py --programs --json /tmp/programs.json

Flags after `--` go to the server. The first start runs with an empty cache directory
(XDG_CACHE_HOME pointed at a fresh temporary directory, so the compiled programs and the GGUF
metadata are both cold); the later ones reuse it. Bursts run after every start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from sgl_jax.testing.server import free_port


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in demo model")
    parser.add_argument("--starts", type=int, default=2, help="starts sharing one cache")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--bursts", default="",
                        help="comma-separated burst sizes sent after /health (32 tokens each)")
    parser.add_argument("--soak", type=int, default=0,
                        help="mixed chat requests sent after the bursts, then again warm")
    parser.add_argument("--soak-concurrency", type=int, default=48)
    parser.add_argument("--tiny-eagle3-tree", action="store_true",
                        help="serve a tiny random Llama with a random EAGLE3 tree head")
    parser.add_argument("--programs", action="store_true",
                        help="count and lower an accelerator start's programs instead")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--settle", type=float, default=0,
                        help="before stopping a start, wait up to this many seconds for its "
                             "background builds to finish (a restart of a server that ran a "
                             "while, rather than of one stopped mid-build)")
    parser.add_argument("--log-dir", default=None,
                        help="keep each start's server log here (start-N.log)")
    return parser.parse_args(argv), server_flags


def time_one_start(command: list[str], env: dict[str, str], port: int, timeout: float,
                   bursts: list[int], soak: tuple[int, int] = (0, 0),
                   log_path: str | None = None, settle: float = 0) -> dict:
    started = time.perf_counter()
    with open(log_path, "w+b") if log_path else tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready = _wait_healthy(process, port, started + timeout) - started
            first_token = _first_streamed_token(port) - started
            slowest = {size: round(_slowest_of_burst(port, size), 2) for size in bursts}
            soaks = [round(_soak(port, *soak), 1) for _ in range(2)] if soak[0] else []
            settle_started = time.perf_counter()
            settled = _wait_for_builds(port, settle) if settle else None
            settle_s = time.perf_counter() - settle_started
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            process.terminate()
            process.wait(timeout=60)
    figures = {"ready_s": round(ready, 2), "first_token_s": round(first_token, 2),
               "burst_slowest_s": slowest}
    if settled is not None:
        figures.update(builds_pending_at_stop=settled, settle_s=round(settle_s, 1))
    if soaks:
        figures.update(soak_s=soaks[0], soak_warm_s=soaks[1],
                       soak_ratio=round(soaks[0] / soaks[1], 2))
    return figures


def _wait_for_builds(port: int, timeout: float) -> int:
    """Wait up to `timeout` s for the server's background builder to finish what it was
    given; the build jobs still pending then."""
    deadline = time.perf_counter() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info",
                                    timeout=30) as response:
            pending = json.loads(response.read())["programs_building"]
        if pending == 0 or time.perf_counter() > deadline:
            return pending
        time.sleep(1)


def _soak(port: int, count: int, concurrency: int) -> float:
    """Seconds to answer `count` mixed chat requests, `concurrency` at a time (the same
    requests every call: a fixed seed)."""
    import random

    rng = random.Random(0)
    words = "the sea a ship sails north under grey clouds while gulls cry".split()
    bodies = [{"model": "default", "temperature": 0, "max_tokens": rng.randint(8, 64),
               "stream": rng.random() < 1 / 3,
               "messages": [{"role": "user", "content": " ".join(
                   rng.choice(words) for _ in range(rng.randint(1, 60)))}]}
              for _ in range(count)]

    def one(body: dict) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, bodies))
    return time.perf_counter() - started


def tiny_eagle3_tree(workdir: str) -> list[str]:
    """Server flags for a tiny random Llama with a random EAGLE3 head, README tree flags."""
    from sgl_jax.testing import write_tiny_checkpoint
    from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft

    target = write_tiny_checkpoint(f"{workdir}/llama", "llama")
    draft = write_tiny_eagle3_draft(f"{workdir}/eagle3",
                                    json.loads((target / "config.json").read_text()))
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in README_EAGLE3.items()]
    return ["--model-path", str(target), "--speculative-draft-model-path", str(draft), *flags]


def _slowest_of_burst(port: int, size: int) -> float:
    """Seconds until the last of `size` concurrent 32-token chat answers arrived."""
    body = json.dumps({"model": "default", "max_tokens": 32, "temperature": 0,
                       "messages": [{"role": "user", "content": "Tell me about the sea."}]})

    def one(_: int) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=body.encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            json.loads(response.read())

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        list(pool.map(one, range(size)))
    return time.perf_counter() - started


def _wait_healthy(process: subprocess.Popen, port: int, deadline: float) -> float:
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return time.perf_counter()
        except OSError:
            time.sleep(0.1)
    raise TimeoutError("the server did not become healthy in time")


def _first_streamed_token(port: int) -> float:
    body = json.dumps({"model": "default", "stream": True, "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hello!"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if b'"content"' in line:
                first = time.perf_counter()
                break
        else:
            raise RuntimeError("the stream ended without a content delta")
        response.read()
    return first


# Llama-3.1-8B's layer structure: what tracing and lowering cost follows (the number of
# operations), with small widths and vocabulary so the random checkpoint loads in seconds.
LLAMA_8B_LAYERS = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, hidden_size=512, intermediate_size=1024,
                       vocab_size=2048, max_position_embeddings=8192)
README_EAGLE3 = dict(speculative_algorithm="EAGLE3", speculative_num_steps=3,
                     speculative_eagle_topk=4, speculative_num_draft_tokens=8)


def program_cases(workdir: str) -> dict[str, tuple[str, dict]]:
    """name -> (model path, Engine settings): the README's two demo servers, and the 8B
    layer structure with a random EAGLE3 head (README flags)."""
    from sgl_jax.demo import demo_draft_path, demo_model_path
    from sgl_jax.testing import write_tiny_checkpoint
    from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft

    target = write_tiny_checkpoint(f"{workdir}/llama8b", "llama", **LLAMA_8B_LAYERS)
    config = json.loads((target / "config.json").read_text())
    draft = write_tiny_eagle3_draft(f"{workdir}/llama8b-eagle3", config)
    demo = str(demo_model_path())
    return {"demo plain": (demo, {}),
            "demo EAGLE3": (demo, dict(README_EAGLE3,
                                       speculative_draft_model_path=str(demo_draft_path()))),
            "Llama-3.1-8B layers, EAGLE3": (str(target), dict(
                README_EAGLE3, speculative_draft_model_path=str(draft)))}


def lower_programs(model_path: str, settings: dict) -> dict:
    """Programs of an accelerator start, and the seconds to trace and lower them for each
    platform: all of them, and those needed before ready (the smallest batch bucket)."""
    from sgl_jax.testing.lowering import PLATFORMS, lower_program, record_engine_programs

    every = record_engine_programs(model_path, **settings)
    first = record_engine_programs(model_path, precompile_bs_paddings=[1], **settings)
    figures = {"programs": len(every), "programs_before_ready": len(first)}
    for platform in PLATFORMS:
        for name, programs in (("all", every), ("before_ready", first)):
            started = time.perf_counter()
            for program in programs:
                lower_program(program, platform)  # traced afresh: nothing reused
            figures[f"{platform}_trace_lower_s_{name}"] = round(
                time.perf_counter() - started, 1)
    return figures


def count_programs() -> dict[str, dict]:
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name, (path, settings) in program_cases(workdir).items():
            results[name] = lower_programs(path, settings)
            print(name, results[name], flush=True)
    return results


def main(argv: list[str] | None = None) -> list[dict[str, float]] | dict:
    args, server_flags = parse_args(argv)
    if args.programs:
        results = count_programs()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return results
    port = free_port()
    command = [sys.executable, "-m", "sgl_jax.launch_server", "--port", str(port), *server_flags]
    if args.model_path:
        command += ["--model-path", args.model_path]
    results = []
    bursts = [int(size) for size in args.bursts.split(",") if size]
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        if args.tiny_eagle3_tree:
            command += tiny_eagle3_tree(cache)
        for index in range(args.starts):
            log_path = (os.path.join(args.log_dir, f"start-{index + 1}.log")
                        if args.log_dir else None)
            figures = time_one_start(command, env, port, args.timeout, bursts,
                                     (args.soak, args.soak_concurrency), log_path, args.settle)
            figures["start"] = "first (cold caches)" if index == 0 else f"#{index + 1} (warm)"
            results.append(figures)
            waits = ", ".join(f"{size}: {s:.1f} s" for size, s in
                              figures["burst_slowest_s"].items())
            soak = (f"; soak of {args.soak}: {figures['soak_s']:.1f} s, again warm "
                    f"{figures['soak_warm_s']:.1f} s ({figures['soak_ratio']:.2f}x)"
                    if args.soak else "")
            if args.settle:
                soak += (f"; builds settled in {figures['settle_s']:.0f} s, "
                         f"{figures['builds_pending_at_stop']} left at stop")
            print(f"start {figures['start']}: ready {figures['ready_s']:.1f} s, first streamed "
                  f"token {figures['first_token_s']:.1f} s"
                  + (f"; slowest answer of each burst {waits}" if waits else "") + soak,
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "starts": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
