"""Start-up time of the server: a first start (empty caches) and a second start, each timed
from launch to /health answering and to the first streamed token of a chat request.

    python benchmark/bench_startup.py                      # the demo model, default flags
    python benchmark/bench_startup.py --model-path M.gguf --json out.json -- --dtype float32

Flags after `--` go to the server. The first start runs with an empty cache directory
(XDG_CACHE_HOME pointed at a fresh temporary directory, so the compilation cache and the GGUF
metadata are both cold); the second reuses it.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--json", default=None, help="write the figures here")
    return parser.parse_args(argv), server_flags


def time_one_start(command: list[str], env: dict[str, str], port: int, timeout: float
                   ) -> dict[str, float]:
    started = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready = _wait_healthy(process, port, started + timeout) - started
            first_token = _first_streamed_token(port) - started
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            process.terminate()
            process.wait(timeout=60)
    return {"ready_s": round(ready, 2), "first_token_s": round(first_token, 2)}


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


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    args, server_flags = parse_args(argv)
    port = free_port()
    command = [sys.executable, "-m", "sgl_jax.launch_server", "--port", str(port), *server_flags]
    if args.model_path:
        command += ["--model-path", args.model_path]
    results = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        for index in range(args.starts):
            figures = time_one_start(command, env, port, args.timeout)
            figures["start"] = "first (cold caches)" if index == 0 else f"#{index + 1} (warm)"
            results.append(figures)
            print(f"start {figures['start']}: ready {figures['ready_s']:.1f} s, first streamed "
                  f"token {figures['first_token_s']:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "starts": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
