"""benchmark/bench_serving.py against a stub OpenAI-compatible server (CPU only, no model).

The stub streams one text chunk per requested max_tokens, then a usage chunk and [DONE], so
every count the benchmark reports can be checked exactly. A prompt containing TRIGGER_400 is
answered with HTTP 400, one containing TRIGGER_SLOW stalls (to exercise --timeout), and the
model name "no-usage" makes the stub leave out the usage chunk.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sgl_jax.testing.benchmarks import load_benchmark

MODEL = "stub-model"
CHUNK_SLEEP_S = 0.002


def load_bench():
    return load_benchmark("bench_serving")


bench = load_bench()


# --------------------------------------------------------------------------- the stub


class StubState:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests: list[dict] = []  # one entry per generation request received
        self.served_tokens = 0  # text chunks streamed by successful requests
        self.in_flight = 0
        self.max_in_flight = 0


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def make_app(state: StubState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def generate(request: Request, chat: bool):
        body = await request.json()
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        state.requests.append({"body": body, "prompt": prompt,
                               "auth": request.headers.get("authorization")})
        if "TRIGGER_400" in prompt:
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
        n_chunks = int(body["max_tokens"])
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n_chunks,
                 "total_tokens": len(prompt.split()) + n_chunks}
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int | None) -> dict:
            if chat:
                if i is None:
                    delta, finish = {}, "length"
                elif i == -1:  # the opening role chunk: no text, must not count as TTFT
                    delta, finish = {"role": "assistant", "content": ""}, None
                elif i == 0:  # reasoning text counts as output text too
                    delta, finish = {"reasoning_content": "think "}, None
                else:
                    delta, finish = {"content": f"w{i} "}, None
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                text = "" if i is None or i < 0 else f"w{i} "
                finish = "length" if i is None else None
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return {"id": "x", "object": obj, "model": body["model"], "choices": [choice],
                    "usage": None}

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if "TRIGGER_SLOW" in prompt:
                    await asyncio.sleep(3.0)
                yield sse(chunk(-1))
                for i in range(n_chunks):
                    await asyncio.sleep(CHUNK_SLEEP_S)
                    yield sse(chunk(i))
                yield sse(chunk(None))
                if body["model"] != "no-usage":
                    yield sse({"id": "x", "object": obj, "model": body["model"], "choices": [],
                               "usage": usage})
                state.served_tokens += n_chunks
            finally:
                # Before [DONE], so a client freed by [DONE] never overlaps this stream.
                state.in_flight -= 1
            yield sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    return app


@pytest.fixture(scope="module")
def stub_server():
    state = StubState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def stub(stub_server):
    url, state = stub_server
    state.reset()
    return url, state


def run_bench(url: str, *extra: str) -> dict:
    return bench.main(["--base-url", url, "--disable-tqdm", *extra])


def check_requests(record: dict, state: StubState) -> None:
    """Per-request invariants every successful streamed request must satisfy."""
    summary = record["summary"]
    done = [r for r in record["requests"] if r["success"]]
    assert summary["completed"] == len(done)
    assert summary["output_tokens"] == state.served_tokens
    by_prompt = {s["prompt"]: s["body"] for s in state.requests}
    assert len(by_prompt) == len(state.requests)  # prompts are distinct in these tests
    for r in done:
        assert r["error"] is None
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["text_chunks"] >= 1
        assert len(r["itl_s"]) == r["text_chunks"] - 1
        assert all(gap >= 0 for gap in r["itl_s"])
        assert r["completion_tokens"] == r["text_chunks"]
    assert sum(r["completion_tokens"] for r in done) == summary["output_tokens"]
    assert summary["mean_ttft_ms"] <= summary["mean_e2e_ms"]


# --------------------------------------------------------------------------- end to end


def write_jsonl(path: Path, endpoint: str) -> list[dict]:
    rows = []
    for i in range(12):
        text = f"question number {i} about rivers and mountains"
        if i == 5:
            text = "TRIGGER_400 " + text
        row: dict = {"max_tokens": 2 + i % 5}
        if endpoint == "chat" and i % 3 == 0:
            row["messages"] = [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": text}]
        else:
            row["prompt"] = text
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_jsonl_with_max_concurrency(stub, tmp_path, endpoint):
    url, state = stub
    rows = write_jsonl(tmp_path / "prompts.jsonl", endpoint)
    out = tmp_path / "out.json"
    record = run_bench(url, "--endpoint", endpoint, "--dataset", "jsonl",
                       "--dataset-path", str(tmp_path / "prompts.jsonl"), "--num-prompts", "50",
                       "--max-concurrency", "3", "--ignore-eos", "--output-json", str(out))
    summary = record["summary"]
    assert summary["completed"] == 11 and summary["failed"] == 1
    failed = [r for r in record["requests"] if not r["success"]]
    assert [r["index"] for r in failed] == [5]
    assert failed[0]["error"].startswith("HTTP 400") and "bad prompt" in failed[0]["error"]
    expected_tokens = sum(r["max_tokens"] for i, r in enumerate(rows) if i != 5)
    assert state.served_tokens == expected_tokens
    for r in record["requests"]:
        if r["success"]:
            assert r["completion_tokens"] == rows[r["index"]]["max_tokens"]
    check_requests(record, state)
    assert summary["requests_without_usage"] == 0
    assert summary["input_tokens"] == sum(len(s["prompt"].split()) for s in state.requests
                                          if "TRIGGER_400" not in s["prompt"])
    assert 2 <= state.max_in_flight <= 3  # requests did overlap, never beyond the cap
    assert record["model"] == MODEL
    for seen in state.requests:
        body = seen["body"]
        assert body["model"] == MODEL and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0.0
    saved = json.loads(out.read_text())
    assert saved["summary"] == summary
    assert saved["args"]["max_concurrency"] == 3 and saved["args"]["request_rate"] == "inf"
    assert len(saved["requests"]) == 12


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_random_with_request_rate(stub, tmp_path, endpoint):
    url, state = stub
    num, rate, seed = 16, 200.0, 7
    out = tmp_path / "out.json"
    record = run_bench(url, "--endpoint", endpoint, "--num-prompts", str(num),
                       "--random-input-len", "20", "--random-output-len", "8",
                       "--random-range-ratio", "0.5", "--request-rate", str(rate),
                       "--seed", str(seed), "--output-json", str(out))
    summary = record["summary"]
    assert summary["completed"] == num and summary["failed"] == 0
    check_requests(record, state)
    for seen in state.requests:
        assert 10 <= len(seen["prompt"].split()) <= 20
        assert 4 <= seen["body"]["max_tokens"] <= 8
        assert "ignore_eos" not in seen["body"]
    assert summary["output_tokens"] == sum(s["body"]["max_tokens"] for s in state.requests)
    assert summary["input_tokens"] == sum(len(s["prompt"].split()) for s in state.requests)
    # Requests go out no earlier than their Poisson arrival times.
    offsets_s = bench.arrival_offsets_s(num, rate, seed)
    for r in record["requests"]:
        assert r["start_s"] >= offsets_s[r["index"]] - 1e-3
    assert summary["duration_s"] >= offsets_s[-1]
    assert summary["request_throughput"] == pytest.approx(num / summary["duration_s"])
    assert json.loads(out.read_text())["args"]["request_rate"] == rate


def test_default_model_api_key_and_no_usage(stub, tmp_path, capsys):
    url, state = stub
    out = tmp_path / "out.json"
    record = run_bench(url, "--num-prompts", "4", "--random-input-len", "5",
                       "--random-output-len", "3", "--api-key", "sk-secret",
                       "--output-json", str(out))
    assert record["summary"]["completed"] == 4
    assert {s["auth"] for s in state.requests} == {"Bearer sk-secret"}
    assert "sk-secret" not in out.read_text()

    state.reset()
    record = run_bench(url, "--num-prompts", "4", "--random-input-len", "5",
                       "--random-output-len", "3", "--model", "no-usage")
    summary = record["summary"]
    assert summary["completed"] == 4 and summary["requests_without_usage"] == 4
    assert summary["output_tokens"] == 12 and summary["input_tokens"] == 0
    check_requests(record, state)
    assert "without a usage chunk" in capsys.readouterr().out


def test_failures_never_crash(stub, tmp_path, capsys):
    url, state = stub
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "TRIGGER_SLOW hello", "max_tokens": 2}) + "\n"
                    + json.dumps({"prompt": "fast hello", "max_tokens": 2}) + "\n")
    record = run_bench(url, "--dataset", "jsonl", "--dataset-path", str(path),
                       "--timeout", "0.3")
    assert record["summary"]["completed"] == 1 and record["summary"]["failed"] == 1
    assert "timed out" in record["requests"][0]["error"]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    record = run_bench(dead_url, "--model", "m", "--num-prompts", "3")
    assert record["summary"]["completed"] == 0 and record["summary"]["failed"] == 3
    assert all(r["error"] for r in record["requests"])
    assert record["summary"]["mean_ttft_ms"] is None
    assert "request 0 failed" in capsys.readouterr().out


# --------------------------------------------------------------------------- pure parts


def test_summarize_by_hand():
    R = bench.RequestResult
    results = [
        R(index=0, success=True, ttft_s=0.1, itl_s=[0.01, 0.03], e2e_s=1.0,
          prompt_tokens=10, completion_tokens=10, usage_reported=True),
        R(index=1, success=True, ttft_s=0.2, itl_s=[], e2e_s=2.0,
          prompt_tokens=20, completion_tokens=1, usage_reported=True),
        R(index=2, success=True, ttft_s=0.4, itl_s=[0.02], e2e_s=3.0,
          prompt_tokens=30, completion_tokens=5, usage_reported=True),
        R(index=3, success=False, error="HTTP 500", ttft_s=0.05, itl_s=[9.0], e2e_s=0.5,
          prompt_tokens=99, completion_tokens=99),
    ]
    s = bench.summarize(results, duration_s=4.0)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["input_tokens"] == 60 and s["output_tokens"] == 16
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["requests_without_usage"] == 0
    # TTFT 100, 200, 400 ms: p50 = 200; p99 sits 0.98 of the way from 200 to 400.
    assert s["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(396.0)
    # ITL 10, 20, 30 ms pooled over requests.
    assert s["mean_itl_ms"] == pytest.approx(20.0)
    assert s["p50_itl_ms"] == pytest.approx(20.0)
    assert s["p99_itl_ms"] == pytest.approx(29.8)
    # E2E 1000, 2000, 3000 ms.
    assert s["mean_e2e_ms"] == pytest.approx(2000.0)
    assert s["p50_e2e_ms"] == pytest.approx(2000.0)
    assert s["p99_e2e_ms"] == pytest.approx(2980.0)
    # TPOT: (1.0-0.1)/9 = 100 ms, (3.0-0.4)/4 = 650 ms; the 1-token request is left out.
    assert s["mean_tpot_ms"] == pytest.approx(375.0)
    assert s["p50_tpot_ms"] == pytest.approx(375.0)
    assert s["p99_tpot_ms"] == pytest.approx(644.5)
    json.dumps(s)  # plain JSON values

    text = bench.format_summary(s)
    assert "Successful requests" in text and "396.00" in text

    empty = bench.summarize([], duration_s=0.0)
    assert empty["completed"] == 0 and empty["p99_ttft_ms"] is None


def test_arrival_offsets_and_random_prompts():
    assert np.all(bench.arrival_offsets_s(5, math.inf, 0) == 0)
    offsets = bench.arrival_offsets_s(4000, 50.0, 3)
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    assert np.mean(np.diff(offsets)) == pytest.approx(1 / 50, rel=0.1)
    assert np.array_equal(offsets, bench.arrival_offsets_s(4000, 50.0, 3))

    specs = bench.random_requests(50, 40, 16, 0.25, seed=1)
    assert specs == bench.random_requests(50, 40, 16, 0.25, seed=1)
    assert specs != bench.random_requests(50, 40, 16, 0.25, seed=2)
    assert all(10 <= len(s.prompt.split()) <= 40 and 4 <= s.max_tokens <= 16 for s in specs)
    assert all(w in bench.WORDS for s in specs for w in s.prompt.split())
    fixed = bench.random_requests(5, 12, 6, 1.0, seed=0)
    assert all(len(s.prompt.split()) == 12 and s.max_tokens == 6 for s in fixed)


def test_chunk_parsing():
    assert bench.sse_payload("data: [DONE]") == "[DONE]"
    assert bench.sse_payload(": keep-alive") is None
    assert bench.sse_payload("") is None
    chat = {"choices": [{"delta": {"reasoning_content": "a", "content": "b"}}]}
    assert bench.chunk_text(chat, "chat") == "ab"
    assert bench.chunk_text({"choices": [{"text": "x"}]}, "completions") == "x"
    assert bench.chunk_text({"choices": [], "usage": {}}, "chat") == ""
    assert bench.chunk_error({"error": {"message": "boom"}}) == "boom"
    assert bench.chunk_error({"object": "error", "message": "bad"}) == "bad"
    assert bench.chunk_error({"choices": []}) is None


# --------------------------------------------------------------------------- real-data sets


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from sgl_jax.testing import write_tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    return path, write_tiny_tokenizer(path)


def write_sharegpt(path: Path) -> dict[str, str]:
    """Eight usable conversations and two unusable ones; returns prompt -> reply."""
    pairs = {f"question {i} about rivers and mountains": "answer " * (4 + i) for i in range(8)}
    records = [{"id": str(i), "conversations": [{"from": "human", "value": q},
                                                {"from": "gpt", "value": a}]}
               for i, (q, a) in enumerate(pairs.items())]
    records.append({"id": "one", "conversations": [{"from": "human", "value": "alone here"}]})
    records.append({"id": "tiny", "conversations": [{"from": "human", "value": "hi"},
                                                    {"from": "gpt", "value": "a long answer"}]})
    path.write_text(json.dumps(records))
    return pairs


def test_sharegpt_prompts_and_output_lengths(stub, tmp_path, tiny_tokenizer):
    url, state = stub
    tokenizer_dir, tokenizer = tiny_tokenizer
    pairs = write_sharegpt(tmp_path / "sharegpt.json")
    common = ["--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sharegpt.json"),
              "--tokenizer", str(tokenizer_dir), "--num-prompts", "5", "--seed", "1"]
    record = run_bench(url, *common)
    assert record["summary"]["completed"] == 5
    check_requests(record, state)
    for seen in state.requests:  # the reply's token length is the request's max_tokens
        assert seen["body"]["max_tokens"] == len(tokenizer.encode(pairs[seen["prompt"]]))
    first = [s["prompt"] for s in state.requests]

    state.reset()
    run_bench(url, *common, "--sharegpt-output-len", "3")
    assert sorted(s["prompt"] for s in state.requests) == sorted(first)  # same seed, same 5
    assert {s["body"]["max_tokens"] for s in state.requests} == {3}


def test_mt_bench_sends_first_turns_as_chat(stub, tmp_path, capsys):
    url, state = stub
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps({"question_id": 81 + i, "category": "writing",
                                        "turns": [f"write poem {i}", f"shorter {i}"]}) + "\n"
                            for i in range(3)))
    record = run_bench(url, "--dataset-name", "mt-bench", "--dataset-path", str(path),
                       "--mt-bench-output-len", "4", "--num-prompts", "10")
    assert record["summary"]["completed"] == 3
    check_requests(record, state)
    assert sorted(s["body"]["messages"][0]["content"] for s in state.requests) == [
        f"write poem {i}" for i in range(3)]
    assert all(len(s["body"]["messages"]) == 1 and s["body"]["max_tokens"] == 4
               for s in state.requests)
    assert "mt-bench gave 3 requests, fewer than --num-prompts 10" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--dataset-name", "mt-bench", "--endpoint", "completions"])


def test_humaneval_prompts_as_completions(stub, tmp_path):
    url, state = stub
    path = tmp_path / "HumanEval.jsonl.gz"
    prompts = [f"def f{i}(x):\n    \"\"\"Return x.\"\"\"\n" for i in range(4)]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"task_id": f"HumanEval/{i}", "prompt": p, "entry_point": f"f{i}",
                                 "canonical_solution": "    return x\n", "test": ""}) + "\n"
                     for i, p in enumerate(prompts))
    record = run_bench(url, "--endpoint", "completions", "--dataset", "humaneval",
                       "--dataset-path", str(path), "--humaneval-output-len", "5",
                       "--num-prompts", "2")
    assert record["summary"]["completed"] == 2
    check_requests(record, state)
    assert sorted(s["body"]["prompt"] for s in state.requests) == prompts[:2]  # file order
    assert {s["body"]["max_tokens"] for s in state.requests} == {5}
