"""Replicas behind SGLang's router (`sglang-router`, the real Rust binary from its wheel): two
tiny-model servers with the cache-aware policy answer every request kind through the router
as they answer directly, share the requests, and survive one of them being killed; and
`--dp-size 2` starts the same from one command (or one per node) and stops it all."""

import concurrent.futures
import json
import os
import random
import re
import signal
import string
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from sgl_jax.entrypoints.router import healthy
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.server import StreamedChat, free_port, launch_server

pytest.importorskip("sglang_router")  # the test extra installs it; CI always has it

SERVER_FLAGS = ["--dtype", "float32", "--precompile-token-paddings", "64,256",
                "--precompile-bs-paddings", "1,4,16", "--max-prefill-tokens", "256",
                "--skip-server-warmup", "--context-length", "1024", "--enable-metrics",
                "--served-model-name", "tiny"]
# The router checks each replica every second and drops it after two failed checks.
ROUTER_FLAGS = ["--policy", "cache_aware", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "2", "--log-level", "warn"]
GREEDY = {"temperature": 0, "max_tokens": 12}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"]}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def cluster(model_dir):
    """(router url, [replica A, replica B]): two servers and the router started by hand."""
    flags = ["--model-path", str(model_dir), *SERVER_FLAGS]
    with launch_server(flags) as a, launch_server(flags) as b:
        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router",
                                   "--worker-urls", a.base_url, b.base_url, "--host",
                                   "127.0.0.1", "--port", str(port), "--prometheus-port",
                                   str(free_port()), *ROUTER_FLAGS])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: healthy(url) and chat(url, "ready?").choices, 120)
            yield url, [a, b]
        finally:
            router.terminate()
            router.wait(timeout=30)


def wait_until(condition, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (OSError, openai.APIError, httpx.HTTPError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s} s")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def chat(url: str, text: str, **fields):
    return client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], **{**GREEDY, **fields})


def every_kind(url: str) -> dict:
    """One answer of each request kind, as plain data."""
    openai_client = client(url)
    stream = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "stream it"}], stream=True,
        **GREEDY)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    completion = openai_client.completions.create(model="tiny", prompt="Once upon",
                                                  **GREEDY)
    generate = httpx.post(f"{url}/generate", timeout=120, json={
        "text": "The sky is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    structured = chat(url, "A number, please.", response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}, max_tokens=24)
    tool = chat(url, "Weather in Paris?", tools=[WEATHER], tool_choice="required",
                parallel_tool_calls=False, max_tokens=120)
    return {"chat": chat(url, "What is the capital of France?").choices[0].message.content,
            "stream": streamed, "completion": completion.choices[0].text,
            "generate": generate.json()["text"],
            "json": json.loads(structured.choices[0].message.content),
            "tool": [(c.function.name, json.loads(c.function.arguments))
                     for c in tool.choices[0].message.tool_calls]}


def unrelated_prompts(count: int, seed: int) -> list[str]:
    """Prompts without a shared prefix: the cache-aware policy sends each to the replica
    whose cache tree is smaller, so they spread over both."""
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_letters + " ", k=60)) for _ in range(count)]


def requests_served(replica_url: str) -> float:
    text = httpx.get(f"{replica_url}/metrics").text
    return sum(float(m) for m in re.findall(r"^sgl_jax_requests_total\{.*\} (\S+)$", text,
                                            re.MULTILINE))


def server_info(replica) -> dict:
    return httpx.get(f"{replica.base_url}/get_server_info").json()


def test_every_request_kind_through_the_router_equals_the_direct_answer(cluster):
    url, (a, _) = cluster
    through_router = every_kind(url)
    assert through_router == every_kind(a.base_url)
    assert through_router["tool"][0][0] == "get_weather"


def test_requests_are_shared_by_both_replicas(cluster):
    url, replicas = cluster
    before = [requests_served(r.base_url) for r in replicas]
    prompts = unrelated_prompts(12, seed=0)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: chat(url, p, max_tokens=24), prompts))
    assert all(a.choices[0].message.content is not None for a in answers)
    served = [requests_served(r.base_url) - b for r, b in zip(replicas, before, strict=True)]
    assert sum(served) == len(prompts) and min(served) > 0, served


def test_a_killed_replica_is_routed_around(cluster):
    """Runs last in the module: it kills replica B while it streams."""
    url, (a, b) = cluster
    # Long enough that no stream ends between B's first chunk and the kill.
    long = {"max_tokens": 900, "extra_body": {"ignore_eos": True}}
    streaming = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        in_flight = [pool.submit(ended_cleanly, url, prompt, long, streaming)
                     for prompt in unrelated_prompts(8, seed=1)]
        assert streaming.acquire(timeout=120), "no stream started"
        # B has its share running (polled at once: on the tiny model a 900-token stream can
        # end while the other replica's streams are still starting)
        wait_until(lambda: server_info(b)["num_running_reqs"] > 0, 60)
        b.process.kill()
        outcomes = [f.result(timeout=300) for f in in_flight]  # none hangs
    assert all(outcome in ("answered", "error") for outcome in outcomes), outcomes
    assert "error" in outcomes  # B's streams were cut, and said so
    time.sleep(3)  # two failed health checks
    later = [chat(url, f"after the loss {i}") for i in range(6)]
    assert all(answer.choices for answer in later)
    wait_until(lambda: server_info(a)["kv_pages_in_use"] == 0, 60)
    assert server_info(a)["num_running_reqs"] == 0


def ended_cleanly(url: str, text: str, fields: dict, streaming: threading.Semaphore) -> str:
    """'answered' or 'error' for a streamed request whose replica may die under it; releases
    `streaming` once its first chunk has come."""
    started = False
    try:
        stream = client(url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}], stream=True,
            temperature=0, **fields)
        finished = []
        for chunk in stream:
            if not started:
                started = True
                streaming.release()
            finished += [c.finish_reason for c in chunk.choices]
        return "answered" if finished and finished[-1] else "error"
    except Exception as exc:  # the client's error, or its HTTP stack's (a cut stream)
        if type(exc).__module__.split(".")[0] in ("openai", "httpx", "httpx2", "httpcore"):
            return "error"
        raise
    finally:
        if not started:
            streaming.release()  # never block the test on a request that failed to start


HEALTH_TIMEOUT_S = 3
# docs/parallel.md's bound on a request that meets a frozen replica: the health timeout, the
# launcher's 2 s check, the kill and the router's retry (10 s), plus the answer's own time
# (under this test's load on 2 cores, up to 10 s).
FROZEN_BOUND_S = HEALTH_TIMEOUT_S + 10 + 10
DRAIN_S = 2  # --shutdown-drain-s of the launcher's replicas


def test_dp_size_starts_replicas_and_the_router_and_stops_them(model_dir, tmp_path):
    """Also the launcher's supervision: a killed replica and a frozen one are each started
    again on their port, and the router sends them their share again. Requests sent while a
    replica freezes all end within the documented bound: those not streaming yet answered by
    the other replica, streams answered or ended with an error (after a kill, what was in
    flight on the killed replica may end with an error too); no page stays in use. SIGTERM
    with streams in flight: the replicas drain behind the router (--shutdown-drain-s), every
    stream ends with [DONE] or an error event, and the launcher exits within the drain window
    plus a few seconds."""
    flags = ["--model-path", str(model_dir), *SERVER_FLAGS, "--dp-size", "2",
             "--router-policy", "round_robin", "--replica-health-timeout", str(HEALTH_TIMEOUT_S),
             "--shutdown-drain-s", str(DRAIN_S)]
    with launch_server(flags, timeout_s=600) as launcher:
        answers = [chat(launcher.base_url, f"question {i}") for i in range(4)]
        assert all(answer.choices for answer in answers)
        ports = [int(p) for p in re.findall(r"Starting replica \d on port (\d+)", launcher.log())]
        assert len(ports) == 2 and all(healthy(f"http://127.0.0.1:{p}") for p in ports)
        replicas = [f"http://127.0.0.1:{port}" for port in ports]
        for rank, fault in ((0, signal.SIGKILL), (1, signal.SIGSTOP)):
            with RequestStream(launcher.base_url) as load:
                time.sleep(2)  # requests on both replicas
                os.kill(replica_processes(launcher.log(), rank)[-1], fault)
                # until the launcher has started it again (and a few requests later)
                wait_until(lambda r=rank: len(replica_processes(launcher.log(), r)) == 2, 120)
                time.sleep(2)
            assert all(seconds <= FROZEN_BOUND_S for seconds, _, _ in load.ended), load.ended
            assert {outcome for _, _, outcome in load.ended} <= {"answered", "error"}
            if fault == signal.SIGSTOP:  # it never answered: retried on the other replica
                assert all(outcome == "answered" for _, streamed, outcome in load.ended
                           if not streamed), load.ended
            wait_until(lambda r=rank: healthy(replicas[r]), 120)
            # The router takes it back after two good health checks (2 s apart).
            wait_until(lambda r=rank: serves_through(launcher.base_url, replicas[r]), 60)
        for url in replicas:
            wait_until(lambda u=url: httpx.get(f"{u}/get_server_info").json()[
                "kv_pages_in_use"] == 0, 60)
        streams = [StreamedChat(launcher.base_url, 900) for _ in range(4)]
        for stream in streams:
            stream.start()
        wait_until(lambda: all(stream.chunks > 0 for stream in streams), 60)
        signalled = time.monotonic()
        launcher.process.send_signal(signal.SIGTERM)
        launcher.process.wait(timeout=DRAIN_S + 30)
        exited_after = time.monotonic() - signalled
        for stream in streams:
            stream.join(timeout=10)
    assert exited_after <= DRAIN_S + 10, exited_after
    assert {stream.ending for stream in streams} <= {"done", "error"}, [
        (stream.ending, stream.chunks) for stream in streams]
    assert not any(healthy(url) for url in replicas)  # stopped with it


class RequestStream:
    """Two clients sending 32-token chats through the router back to back, one of them
    streamed, until the block ends; `ended`: (seconds, streamed, 'answered' | 'error')."""

    def __init__(self, url: str):
        self.url, self.ended, self._stop = url, [], threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i, i % 2 == 1))
                         for i in range(2)]

    def __enter__(self) -> "RequestStream":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def _client(self, index: int, streamed: bool) -> None:
        fields = {"max_tokens": 32, "extra_body": {"ignore_eos": True}}
        done = threading.Semaphore(0)
        count = 0
        while not self._stop.is_set():
            started = time.monotonic()
            text = f"client {index} request {count}"
            if streamed:
                outcome = ended_cleanly(self.url, text, fields, done)
            else:
                try:
                    chat(self.url, text, **fields)
                    outcome = "answered"
                except (openai.APIError, httpx.HTTPError):
                    outcome = "error"
            self.ended.append((time.monotonic() - started, streamed, outcome))
            count += 1


def serves_through(router_url: str, replica_url: str) -> bool:
    """Four chats through the round-robin router, all answered, and the replica got one."""
    before = requests_served(replica_url)
    answers = [chat(router_url, f"through the router {i}") for i in range(4)]
    assert all(answer.choices for answer in answers)
    return requests_served(replica_url) > before


def replica_processes(log: str, rank: int) -> list[int]:
    """The process ids replica `rank` has had, oldest first (the launcher logs each start)."""
    return [int(pid) for pid in re.findall(rf"Replica {rank} is process (\d+)", log)]


def test_dp_size_over_two_nodes_serves_both_nodes_replicas(model_dir, tmp_path):
    """Two launchers on this host stand in for two nodes: rank 1 reports its replica to
    rank 0, whose router serves both; rank 1's launcher starts its replica again when it is
    killed, and the router serves it again; stopping rank 0 stops rank 1's replica too."""
    meeting = f"127.0.0.1:{free_port()}"
    flags = ["--model-path", str(model_dir), *SERVER_FLAGS, "--dp-size", "2", "--nnodes", "2",
             "--dist-init-addr", meeting, "--router-policy", "round_robin"]
    rank_1_log = tmp_path / "rank1.log"
    with open(rank_1_log, "w") as log:
        rank_1 = subprocess.Popen([sys.executable, "-m", "sgl_jax.launch_server", *flags,
                                   "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        with launch_server([*flags, "--node-rank", "0"], timeout_s=600) as rank_0:
            [port_0] = re.findall(r"Starting replica 0 on port (\d+)", rank_0.log())
            [port_1] = re.findall(r"Starting replica 1 on port (\d+)", rank_1_log.read_text())
            replicas = [f"http://127.0.0.1:{port}" for port in (port_0, port_1)]
            before = [requests_served(url) for url in replicas]
            answers = [chat(rank_0.base_url, f"question {i}") for i in range(4)]
            assert all(answer.choices for answer in answers)
            served = [requests_served(url) - b for url, b in zip(replicas, before, strict=True)]
            assert served == [2, 2]  # round robin over both nodes' replicas
            [pid] = replica_processes(rank_1_log.read_text(), 1)
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: len(replica_processes(rank_1_log.read_text(), 1)) == 2, 60)
            wait_until(lambda: healthy(replicas[1]), 300)
            wait_until(lambda: serves_through(rank_0.base_url, replicas[1]), 60)
        assert rank_1.wait(timeout=60) == 0  # rank 0 hung up, so rank 1 stopped
        assert not healthy(f"http://127.0.0.1:{port_1}")
    finally:
        if rank_1.poll() is None:
            rank_1.kill()
