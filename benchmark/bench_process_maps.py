"""Memory mappings of the demo servers: how many the process holds once ready, and after it
has served a batch of every size (which compiles what warm-up left to first use).

XLA:CPU maps each compiled kernel into the process apart, and Linux allows a process
`vm.max_map_count` mappings (65,530 by default): past it the process dies while compiling.
Starts `python -m sgl_jax.launch_server` as README.md does, plain and with the demo's EAGLE3
head, each against a fresh compilation cache (cold: every program compiled) unless --warm.

    python benchmark/bench_process_maps.py [--sizes 1,2,4,8,16,32,64] [--warm] [--json F]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sgl_jax.process_maps import mapping_limit
from sgl_jax.testing.server import ServerProcess, launch_server

SERVERS = {
    "plain": [],
    "eagle3": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
               "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
}


def process_mappings(server: ServerProcess) -> int:
    with open(f"/proc/{server.process.pid}/maps", "rb") as maps:
        return sum(1 for _ in maps)


def chat(server: ServerProcess, text: str, max_tokens: int) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(f"{server.base_url}/v1/chat/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        response.read()


def serve_batch(server: ServerProcess, size: int, max_tokens: int) -> None:
    """`size` concurrent chats, so the scheduler runs batches of that size."""
    with ThreadPoolExecutor(size) as pool:
        list(pool.map(lambda i: chat(server, f"Count from {i} to {i + 40}.", max_tokens),
                      range(size)))


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(name: str, flags: list[str], sizes: list[int], warm: bool, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        extra = [] if warm else ["--compilation-cache-dir", cache]
        start = time.perf_counter()
        with launch_server([*flags, *extra], timeout_s=1800) as server:
            row = {"server": name, "ready_s": time.perf_counter() - start,
                   "mappings_ready": process_mappings(server), "after_size": {},
                   "first_batch_extra_s": {}}
            print(f"{name}: ready in {row['ready_s']:.1f} s, {row['mappings_ready']} mappings",
                  flush=True)
            for size in sizes:  # the first batch of a size compiles what it needs
                first, again = (timed(serve_batch, server, size, max_tokens) for _ in range(2))
                row["after_size"][size] = process_mappings(server)
                row["first_batch_extra_s"][size] = first - again
                print(f"  after a batch of {size}: {row['after_size'][size]} mappings; the "
                      f"first took {first - again:.1f} s longer than the next", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64",
                        help="batch sizes served after start-up, in order")
    parser.add_argument("--servers", default="plain,eagle3")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--warm", action="store_true",
                        help="use the user's compilation cache instead of a fresh one")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rows = [measure(name, SERVERS[name], sizes, args.warm, args.max_tokens)
            for name in args.servers.split(",")]
    print(f"\nlimit (vm.max_map_count): {mapping_limit()}")
    print("| server | ready (s) | mappings when ready | " +
          " | ".join(f"after batch {s}" for s in sizes) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in sizes) + " |")
    for row in rows:
        print(f"| {row['server']} | {row['ready_s']:.1f} | {row['mappings_ready']} | " +
              " | ".join(str(row["after_size"][s]) for s in sizes) + " |")
    print("\nseconds the first batch of each size took beyond the next one (compiling):")
    for row in rows:
        print(f"{row['server']}: " + ", ".join(f"{s}: {row['first_batch_extra_s'][s]:.1f}"
                                              for s in sizes))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
