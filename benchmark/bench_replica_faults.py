"""Replicas that freeze and crash under load: what clients see, and what every process holds.

Starts `--dp-size 2` on a tiny random Qwen3 (or `-- FLAGS` for another model) and sends
--num-requests mixed requests through the router at --concurrency: plain and streamed chats,
streams the client hangs up on after the first chunk, JSON-schema answers, required tool
calls, n=2, and malformed bodies (expected: a 4xx in OpenAI's error shape). After
--freeze-after requests have ended, replica 0 is frozen (SIGSTOP); after --kill-after, replica 1
is killed (SIGKILL). The launcher supervises both (docs/parallel.md).

Prints what ended how (and what errors there were, by the fault they followed), the longest
wait, the seconds until each faulted replica served a request again, and the resident memory
and memory mappings of the launcher, the router and each replica at the start, --tail
requests before the end, and the end.

    python benchmark/bench_replica_faults.py --num-requests 10000 --concurrency 64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter

import httpx

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.server import launch_server

TINY_FLAGS = ["--dtype", "float32", "--precompile-bs-paddings", "1,4,16,64",
              "--context-length", "1024", "--served-model-name", "tiny",
              "--max-running-requests", "64"]
KINDS = ("chat", "stream", "hang_up", "json", "tool", "n2", "malformed")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}},
    "required": ["q"]}}}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--freeze-after", type=int, default=2000)
    parser.add_argument("--kill-after", type=int, default=6000)
    parser.add_argument("--tail", type=int, default=5000,
                        help="memory is also read this many requests before the end")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv), server_flags


def body(kind: str, rng: random.Random) -> dict:
    """The request of `kind` (chat completions), short answers."""
    words = " ".join(rng.choice(("sea", "ship", "north", "cloud", "gull", "grey"))
                     for _ in range(rng.randint(3, 40)))
    request = {"model": "tiny", "messages": [{"role": "user", "content": words}],
               "max_tokens": rng.randint(4, 24), "temperature": 0}
    if kind in ("stream", "hang_up"):
        request["stream"] = True
    elif kind == "json":
        request["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "n", "schema": SCHEMA}}
    elif kind == "tool":
        request.update(tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                       max_tokens=64)
    elif kind == "n2":
        request.update(n=2, temperature=0.8, seed=rng.randint(0, 1000))
    elif kind == "malformed":
        request["messages"] = "not a list"
    return request


def send(client: httpx.Client, url: str, kind: str, request: dict) -> str:
    """'answered', 'hung_up' (ours, on purpose), 'rejected' (a 4xx with OpenAI's error
    object, for a malformed body) or 'error: ...'."""
    try:
        if not request.get("stream"):
            response = client.post(url, json=request)
            if kind == "malformed":
                good = 400 <= response.status_code < 500 and "error" in response.json()
                return "rejected" if good else f"error: {response.status_code} for a bad body"
            if response.status_code != 200:
                return f"error: HTTP {response.status_code}"
            return "answered" if response.json()["choices"] else "error: no choices"
        with client.stream("POST", url, json=request) as response:
            if response.status_code != 200:
                return f"error: HTTP {response.status_code}"
            finished = False
            for line in response.iter_lines():
                if kind == "hang_up" and line.startswith("data:"):
                    return "hung_up"
                if '"error"' in line:
                    return "error: an error event"
                finished = finished or '"finish_reason":"' in line.replace(" ", "")
            return "answered" if finished else "error: a stream without finish_reason"
    except httpx.HTTPError as exc:
        return f"error: {type(exc).__name__}"


def replica_pids(log: str, rank: int) -> list[int]:
    return [int(pid) for pid in re.findall(rf"Replica {rank} is process (\d+)", log)]


def memory(pid: int) -> tuple[float, int] | None:
    """(resident MiB, mappings) of a live process, else None."""
    try:
        status = open(f"/proc/{pid}/status").read()
        rss_kb = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))
        with open(f"/proc/{pid}/maps", "rb") as maps:
            return rss_kb / 1024, sum(1 for _ in maps)
    except (OSError, AttributeError):
        return None


def processes(launcher) -> dict[str, int]:
    """name -> pid: the launcher, the router (its child running sglang_router) and each
    replica's current process."""
    named = {"launcher": launcher.process.pid}
    for child in os.listdir("/proc"):
        if child.isdigit():
            try:
                command = open(f"/proc/{child}/cmdline", "rb").read().replace(b"\0", b" ")
                parent = int(open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if parent == launcher.process.pid and b"router" in command:
                named["router"] = int(child)
    log = launcher.log()
    for rank in (0, 1):
        named[f"replica {rank}"] = replica_pids(log, rank)[-1]
    return named


def snapshot(launcher) -> dict[str, dict | None]:
    """name -> its process id, resident MiB and mappings now."""
    result = {}
    for name, pid in processes(launcher).items():
        measured = memory(pid)
        result[name] = measured and {"pid": pid, "rss_mib": round(measured[0]),
                                     "mappings": measured[1]}
    return result


def served(replica_url: str) -> float:
    try:
        text = httpx.get(f"{replica_url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return -1
    return sum(float(m) for m in re.findall(r"^sgl_jax_requests_total\{.*\} (\S+)$", text,
                                            re.MULTILINE))


class Faults:
    """Freezes replica 0 and kills replica 1 once enough requests have ended, then watches
    until each serves a request again (its /metrics count grows)."""

    def __init__(self, launcher, args: argparse.Namespace):
        self.launcher, self.args = launcher, args
        ports = [int(p) for p in re.findall(r"Starting replica \d on port (\d+)", launcher.log())]
        self.replicas = [f"http://127.0.0.1:{port}" for port in ports[:2]]
        self.at: dict[str, float] = {}  # event -> time.monotonic()
        self.lock = threading.Lock()

    def after_request(self, ended: int) -> str | None:
        """The fault to apply now (once), given how many requests have ended."""
        with self.lock:
            for name, count, rank, sig in (("freeze", self.args.freeze_after, 0, signal.SIGSTOP),
                                           ("kill", self.args.kill_after, 1, signal.SIGKILL)):
                if ended >= count and name not in self.at:
                    self.at[name] = time.monotonic()
                    os.kill(replica_pids(self.launcher.log(), rank)[-1], sig)
                    threading.Thread(target=self._watch, args=(name, rank), daemon=True).start()
                    return name
        return None

    def _watch(self, name: str, rank: int) -> None:
        url = self.replicas[rank]
        while len(replica_pids(self.launcher.log(), rank)) < 2:
            time.sleep(0.2)
        self.at[f"{name}: restarted"] = time.monotonic()
        before = max(served(url), 0)
        while served(url) <= before:
            time.sleep(0.5)
        self.at[f"{name}: serving again"] = time.monotonic()


def main(argv: list[str] | None = None) -> dict:
    args, server_flags = parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        if not server_flags:
            model = write_tiny_checkpoint(f"{workdir}/qwen3", "qwen3")
            server_flags = ["--model-path", str(model), *TINY_FLAGS]
        flags = [*server_flags, "--dp-size", "2", "--enable-metrics"]
        with launch_server(flags, timeout_s=1800) as launcher:
            return run(launcher, args)


def run(launcher, args: argparse.Namespace) -> dict:
    url = f"{launcher.base_url}/v1/chat/completions"
    rng = random.Random(0)
    plan = [(kind := rng.choice(KINDS), body(kind, rng)) for _ in range(args.num_requests)]
    faults = Faults(launcher, args)
    outcomes, ended, phase = [], 0, "before the faults"
    lock = threading.Lock()
    memory_at = {"start": snapshot(launcher)}
    started = time.monotonic()

    def one(item: tuple[str, dict]) -> None:
        nonlocal ended, phase
        kind, request = item
        begin = time.monotonic()
        with httpx.Client(timeout=600) as client:
            outcome = send(client, url, kind, request)
        with lock:
            outcomes.append((kind, outcome, time.monotonic() - begin, phase))
            ended += 1
            count = ended
            fault = faults.after_request(count)
            if fault:
                phase = f"after the {fault}"
            if count == args.num_requests - args.tail:
                memory_at[f"{args.tail} before the end"] = snapshot(launcher)

    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, plan))
    wall = time.monotonic() - started
    memory_at["end"] = snapshot(launcher)
    return report(outcomes, faults, memory_at, wall, args)


def report(outcomes: list, faults: Faults, memory_at: dict, wall: float,
           args: argparse.Namespace) -> dict:
    counts = Counter(outcome.split(":")[0] for _, outcome, _, _ in outcomes)
    errors = Counter((phase, outcome) for _, outcome, _, phase in outcomes
                     if outcome.startswith("error"))
    result = {"requests": len(outcomes), "wall_s": round(wall, 1), "outcomes": dict(counts),
              "errors": {f"{phase}: {outcome}": n for (phase, outcome), n in errors.items()},
              "longest_s": round(max(seconds for _, _, seconds, _ in outcomes), 1),
              "back_s": {f"{name} {what}": round(faults.at[f"{name}: {what}"]
                                                 - faults.at[name], 1)
                         for name in ("freeze", "kill")
                         for what in ("restarted", "serving again")
                         if f"{name}: {what}" in faults.at},
              "memory": memory_at}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
