"""Replicas behind SGLang's router against one server: aggregate output tokens per second.

Starts the server twice in turn, by default on the built-in demo model: once alone, and once
as `--dp-size N` replicas behind SGLang's router (`pip install "sgl-jax[router]"`). Both runs
get the same random prompts from benchmark/bench_serving.py at the same --max-concurrency,
with ignore_eos, so every request generates exactly its max_tokens. Prints both summaries and
the ratio of output throughputs.

Replicas on one machine share it: on a CPU they share its cores, so the ratio shows the cost
of the router's hop more than any gain; on N accelerators each replica has its own.

    python benchmark/bench_replicas.py                      # demo model, 2 replicas
    python benchmark/bench_replicas.py --dp-size 2 --num-prompts 64 --max-concurrency 16 \\
        -- --model-path Qwen/Qwen3-8B --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import bench_serving  # noqa: E402

from sgl_jax.testing.server import launch_server  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128, help="words per prompt")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per answer")
    parser.add_argument("server_flags", nargs="*",
                        help="flags for every server, after `--` (default: the demo model)")
    args = parser.parse_args(argv)
    return args, args.server_flags


def serve_and_measure(server_flags: list[str], dp_size: int, args: argparse.Namespace
                      ) -> dict[str, Any]:
    flags = [*server_flags, "--dp-size", str(dp_size)] if dp_size > 1 else server_flags
    with launch_server(flags, timeout_s=1800) as server:
        return bench_serving.main([
            "--base-url", server.base_url, "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--random-input-len",
            str(args.input_len), "--random-output-len", str(args.output_len),
            "--ignore-eos"])["summary"]


def main(argv: list[str] | None = None) -> dict[str, float]:
    args, server_flags = parse_args(argv)
    one = serve_and_measure(server_flags, 1, args)
    many = serve_and_measure(server_flags, args.dp_size, args)
    ratio = many["output_throughput"] / one["output_throughput"]
    print(f"\nOutput throughput: 1 server {one['output_throughput']:.1f} tok/s, "
          f"{args.dp_size} replicas behind the router {many['output_throughput']:.1f} tok/s: "
          f"{ratio:.2f}x")
    return {"one": one["output_throughput"], "replicas": many["output_throughput"],
            "ratio": ratio}


if __name__ == "__main__":
    main(sys.argv[1:])
