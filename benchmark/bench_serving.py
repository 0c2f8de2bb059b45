"""Online serving benchmark: load on any OpenAI-compatible HTTP endpoint.

Sends --num-prompts streamed requests to /v1/chat/completions (or /v1/completions) of a
running server, ours or vLLM or SGLang, and measures what a client sees: time to first token
(TTFT), the gaps between later streamed text chunks (inter-token latency, ITL), time per
output token after the first (TPOT), end-to-end latency, and request and token throughput
over the wall time of the run. Requests arrive all at once (the default) or as a Poisson
process of --request-rate per second, optionally capped at --max-concurrency in flight.

Prompts (--dataset-name) are random words from a fixed list (no tokenizer needed, so
--random-input-len counts words, not tokens), lines of a JSONL file, or real data
(sgl_jax.datasets): ShareGPT's first human turns with their reply's token length as max_tokens
(sampled as SGLang's bench_serving does; counted with --tokenizer), MT-Bench's 80 first-turn
questions, or HumanEval's completion prompts. Token counts come from the usage chunk a server
sends at the end of the stream; when a server sends none, each text chunk is counted as one
output token and the report says so. Pass --ignore-eos so every request generates exactly
its max_tokens (an SGLang/vLLM extension that plain OpenAI rejects).

    python benchmark/bench_serving.py --num-prompts 200 --random-input-len 256 --ignore-eos
    python benchmark/bench_serving.py --dataset-name sharegpt --num-prompts 200 \\
        --request-rate 8 --max-concurrency 32 --output-json /tmp/serving.json
    python benchmark/bench_serving.py --dataset-name mt-bench --max-concurrency 1
    python benchmark/bench_serving.py --base-url http://host:8000 --endpoint completions \\
        --dataset-name jsonl --dataset-path prompts.jsonl --model my-model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

try:
    import sgl_jax  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_jax.datasets import load_humaneval, load_mt_bench, sample_sharegpt

# A fixed vocabulary for synthetic prompts: plain English words that most tokenizers keep
# as one or two tokens each.
WORDS = """
time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education river garden window table paper market light music field bridge stone summer
winter spring autumn cloud rain snow forest mountain ocean island valley road train ship
engine signal number letter color circle square answer method process model theory value
""".split()

ERRORS_SHOWN = 5
DATASETS = ["random", "jsonl", "sharegpt", "mt-bench", "humaneval"]


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                        help="chat: /v1/chat/completions with one user message; "
                             "completions: /v1/completions with a string prompt")
    parser.add_argument("--model", default=None,
                        help="model name to send (default: the first id of GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    parser.add_argument("--dataset-name", "--dataset", dest="dataset_name", choices=DATASETS,
                        default="random",
                        help="random: random words; jsonl: --dataset-path; sharegpt: sampled "
                             "with --seed; mt-bench: the first turns, in order (80 at most); "
                             "humaneval: the prompts, in order (164 at most)")
    parser.add_argument("--dataset-path", default=None,
                        help="jsonl: one object a line with 'prompt' (string) or 'messages' "
                             "(chat list), optionally 'max_tokens' (default: "
                             "--random-output-len), the first --num-prompts lines are used; "
                             "sharegpt, mt-bench, humaneval: a file in the installed package's "
                             "format (default: the installed one)")
    parser.add_argument("--tokenizer", default=None,
                        help="sharegpt: counts prompt and reply tokens for the length filters "
                             "and max_tokens; a directory, hub id or .gguf file (default: the "
                             "demo model's, SmolLM2-135M-Instruct)")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="max_tokens of every sharegpt request (default: its reply's "
                             "token length)")
    parser.add_argument("--mt-bench-output-len", type=int, default=256,
                        help="max_tokens of every mt-bench request")
    parser.add_argument("--humaneval-output-len", type=int, default=256,
                        help="max_tokens of every humaneval request")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=128,
                        help="words per synthetic prompt (not tokens)")
    parser.add_argument("--random-output-len", type=int, default=128,
                        help="max_tokens per synthetic request")
    parser.add_argument("--random-range-ratio", type=float, default=1.0,
                        help="draw each length uniformly from [ratio * len, len]")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once (default: no limit)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send 'ignore_eos': true so each request runs to max_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None,
                        help="write the summary, the arguments and every request's record here")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one request may take, end to end")
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if args.random_input_len < 1 or args.random_output_len < 1:
        parser.error("--random-input-len and --random-output-len must be >= 1")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error("--random-range-ratio must be in [0, 1]")
    if args.request_rate <= 0:
        parser.error("--request-rate must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    if args.dataset_name == "jsonl" and not args.dataset_path:
        parser.error("--dataset-name jsonl needs --dataset-path")
    if args.dataset_name == "mt-bench" and args.endpoint == "completions":
        parser.error("--dataset-name mt-bench sends chat messages: use --endpoint chat")
    lengths = (args.sharegpt_output_len or 1, args.mt_bench_output_len, args.humaneval_output_len)
    if min(lengths) < 1:
        parser.error("output lengths must be >= 1")
    return args


# --------------------------------------------------------------------------- requests


@dataclass
class RequestSpec:
    """One request to send: a string prompt or a chat message list, and its max_tokens."""

    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None


@dataclass
class RequestResult:
    """What the client saw of one request. Times in seconds; start_s is relative to the start
    of the run, the others to the moment the request was sent."""

    index: int
    success: bool = False
    error: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    text_chunks: int = 0
    output_chars: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False


def draw_lengths(num: int, max_len: int, range_ratio: float,
                 rng: np.random.Generator) -> np.ndarray:
    """num integers drawn uniformly from [max(1, ratio * max_len), max_len]."""
    low = max(1, int(range_ratio * max_len))
    return rng.integers(low, max_len + 1, size=num)


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[RequestSpec]:
    """num prompts of random words from WORDS, with their max_tokens; the same for a seed."""
    rng = np.random.default_rng(seed)
    input_lens = draw_lengths(num, input_len, range_ratio, rng)
    output_lens = draw_lengths(num, output_len, range_ratio, rng)
    specs = []
    for n_words, max_tokens in zip(input_lens, output_lens, strict=True):
        words = rng.choice(len(WORDS), size=int(n_words))
        specs.append(RequestSpec(max_tokens=int(max_tokens),
                                 prompt=" ".join(WORDS[i] for i in words)))
    return specs


def jsonl_requests(path: str | Path, num: int, default_max_tokens: int) -> list[RequestSpec]:
    """The first num requests of a JSONL file (fewer if the file is shorter)."""
    specs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if len(specs) >= num:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str) and not isinstance(row.get("messages"),
                                                                          list):
                raise ValueError(f"{path}:{line_no}: needs 'prompt' (string) or 'messages'")
            specs.append(RequestSpec(max_tokens=int(row.get("max_tokens", default_max_tokens)),
                                     prompt=row.get("prompt"), messages=row.get("messages")))
    if not specs:
        raise ValueError(f"{path}: no requests")
    return specs


def request_body(spec: RequestSpec, endpoint: str, model: str, temperature: float,
                 ignore_eos: bool) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": spec.max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = spec.messages or [{"role": "user", "content": spec.prompt}]
    elif spec.prompt is not None:
        body["prompt"] = spec.prompt
    else:
        raise ValueError("--endpoint completions needs string prompts, not 'messages'")
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


# --------------------------------------------------------------------------- streaming


class StreamError(Exception):
    """The server reported an error inside the stream, or the stream ended early."""


def sse_payload(line: str) -> str | None:
    """The data of one server-sent-event line, or None for blank, comment and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    """The generated text one streamed chunk carries (reasoning text included)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("reasoning_content") or "") + (delta.get("content") or "")


def chunk_error(chunk: dict[str, Any]) -> str | None:
    """The error message of an error event (OpenAI's {"error": ...} or vLLM's object=error)."""
    if chunk.get("error"):
        error = chunk["error"]
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    if chunk.get("object") == "error":
        return str(chunk.get("message", chunk))
    return None


async def read_stream(response: httpx.Response, endpoint: str, sent_s: float,
                      result: RequestResult) -> None:
    """Fill result's timings and token counts from a streamed 200 response."""
    last_chunk_s = None
    async for line in response.aiter_lines():
        payload = sse_payload(line)
        if not payload:
            continue
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if (message := chunk_error(chunk)) is not None:
            raise StreamError(f"error event: {message}")
        if usage := chunk.get("usage"):
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            result.completion_tokens = int(usage.get("completion_tokens") or 0)
            result.usage_reported = True
        text = chunk_text(chunk, endpoint)
        if not text:
            continue
        now_s = time.perf_counter()
        if last_chunk_s is None:
            result.ttft_s = now_s - sent_s
        else:
            result.itl_s.append(now_s - last_chunk_s)
        last_chunk_s = now_s
        result.text_chunks += 1
        result.output_chars += len(text)
    raise StreamError("stream ended without 'data: [DONE]'")


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       endpoint: str, timeout_s: float, result: RequestResult) -> None:
    """Send one streamed request and record what came back; never raises."""
    sent_s = time.perf_counter()

    async def exchange() -> None:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                raise StreamError(f"HTTP {response.status_code}: {text[:500]}")
            await read_stream(response, endpoint, sent_s, result)

    try:
        await asyncio.wait_for(exchange(), timeout_s)
        result.success = True
        if not result.usage_reported:
            result.completion_tokens = result.text_chunks
    except TimeoutError:
        result.error = f"timed out after {timeout_s:g} s"
    except StreamError as e:
        result.error = str(e)
    except Exception as e:  # connection errors, bad JSON, odd payloads: a failed request
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    result.e2e_s = time.perf_counter() - sent_s


# --------------------------------------------------------------------------- the run


def arrival_offsets_s(num: int, request_rate: float, seed: int) -> np.ndarray:
    """When each request is due, in seconds after the start: all 0 for an infinite rate,
    else a Poisson process (exponential gaps of mean 1/rate) with the first at 0."""
    if math.isinf(request_rate):
        return np.zeros(num)
    gaps_s = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num - 1)
    return np.concatenate([[0.0], np.cumsum(gaps_s)])


def make_client(args: argparse.Namespace) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No pool limit: httpx's default of 100 connections would cap concurrency silently.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                             limits=limits, timeout=httpx.Timeout(args.timeout))


async def first_model_id(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError("GET /v1/models listed no model")
    return str(models[0]["id"])


async def run_requests(client: httpx.AsyncClient, bodies: list[dict[str, Any]],
                       args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """Send every body on its arrival schedule; the results in order and the wall time."""
    url = endpoint_path(args.endpoint)
    offsets_s = arrival_offsets_s(len(bodies), args.request_rate, args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    results = [RequestResult(index=i) for i in range(len(bodies))]
    progress = tqdm(total=len(bodies), disable=args.disable_tqdm, desc="requests")
    start_s = time.perf_counter()

    async def one(i: int) -> None:
        if semaphore is not None:
            await semaphore.acquire()
        try:
            results[i].start_s = time.perf_counter() - start_s
            await send_request(client, url, bodies[i], args.endpoint, args.timeout, results[i])
        finally:
            if semaphore is not None:
                semaphore.release()
            progress.update(1)

    tasks = []
    for i, offset_s in enumerate(offsets_s):
        delay_s = start_s + offset_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - start_s
    progress.close()
    return results, duration_s


# --------------------------------------------------------------------------- summary


def stats_ms(values_s: Sequence[float], name: str) -> dict[str, float | None]:
    """mean, p50 and p99 of values in seconds, as milliseconds (None when there are none)."""
    if not values_s:
        return {f"mean_{name}_ms": None, f"p50_{name}_ms": None, f"p99_{name}_ms": None}
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {
        f"mean_{name}_ms": float(values_ms.mean()),
        f"p50_{name}_ms": float(np.percentile(values_ms, 50)),
        f"p99_{name}_ms": float(np.percentile(values_ms, 99)),
    }


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Counts, throughputs and latency statistics of a run; only successful requests count
    toward tokens and latencies. TPOT is (e2e - ttft) / (completion_tokens - 1), for
    requests with more than one output token."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    ttfts_s = [r.ttft_s for r in done if r.ttft_s is not None]
    itls_s = [gap for r in done for gap in r.itl_s]
    e2es_s = [r.e2e_s for r in done]
    tpots_s = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in done
               if r.ttft_s is not None and r.completion_tokens > 1]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) * per_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
        "requests_without_usage": sum(not r.usage_reported for r in done),
        **stats_ms(ttfts_s, "ttft"),
        **stats_ms(itls_s, "itl"),
        **stats_ms(e2es_s, "e2e"),
        **stats_ms(tpots_s, "tpot"),
    }


SUMMARY_ROWS = [
    ("Successful requests", "completed", "{:d}"),
    ("Failed requests", "failed", "{:d}"),
    ("Duration (s)", "duration_s", "{:.2f}"),
    ("Input tokens", "input_tokens", "{:d}"),
    ("Output tokens", "output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Output throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
]


def format_summary(summary: dict[str, Any], title: str = "Serving benchmark") -> str:
    """The summary as an aligned plain-text table."""
    width = 50
    lines = [f" {title} ".center(width, "="), *(
        f"{label:<36}{fmt.format(summary[key]):>14}" for label, key, fmt in SUMMARY_ROWS)]
    for name, label in [("ttft", "Time to first token"), ("tpot", "Time per output token"),
                        ("itl", "Inter-token latency"), ("e2e", "End-to-end latency")]:
        lines.append(f" {label} (ms) ".center(width, "-"))
        for stat in ("mean", "p50", "p99"):
            value = summary[f"{stat}_{name}_ms"]
            lines.append(f"{stat.capitalize():<36}"
                         f"{'n/a' if value is None else f'{value:.2f}':>14}")
    lines.append("=" * width)
    return "\n".join(lines)


def report_notes(summary: dict[str, Any], results: Sequence[RequestResult]) -> list[str]:
    """Warnings to print under the table: missing usage, the first few errors."""
    notes = []
    if summary["requests_without_usage"]:
        notes.append(f"note: {summary['requests_without_usage']} of {summary['completed']} "
                     "successful requests came without a usage chunk; their output tokens are "
                     "counted as text chunks and their input tokens as 0")
    errors = [r for r in results if not r.success]
    for r in errors[:ERRORS_SHOWN]:
        notes.append(f"request {r.index} failed: {r.error}")
    if len(errors) > ERRORS_SHOWN:
        notes.append(f"... and {len(errors) - ERRORS_SHOWN} more failures")
    return notes


def args_record(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments as JSON-safe values, with the API key masked."""
    record = dict(vars(args))
    if record.get("api_key"):
        record["api_key"] = "***"
    if isinstance(record.get("request_rate"), float) and math.isinf(record["request_rate"]):
        record["request_rate"] = "inf"
    return record


# --------------------------------------------------------------------------- entry points


def build_requests(args: argparse.Namespace) -> list[RequestSpec]:
    """The requests of --dataset-name; a note when the dataset has fewer than --num-prompts."""
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed)
    if args.dataset_name == "jsonl":
        specs = jsonl_requests(args.dataset_path, args.num_prompts, args.random_output_len)
    elif args.dataset_name == "sharegpt":
        specs = sharegpt_requests(args)
    elif args.dataset_name == "mt-bench":
        specs = [RequestSpec(max_tokens=args.mt_bench_output_len,
                             messages=[{"role": "user", "content": q.turns[0]}])
                 for q in load_mt_bench(args.dataset_path)[:args.num_prompts]]
    else:
        specs = [RequestSpec(max_tokens=args.humaneval_output_len, prompt=p.prompt)
                 for p in load_humaneval(args.dataset_path)[:args.num_prompts]]
    if len(specs) < args.num_prompts:
        print(f"note: {args.dataset_name} gave {len(specs)} requests, fewer than "
              f"--num-prompts {args.num_prompts}")
    return specs


def sharegpt_requests(args: argparse.Namespace) -> list[RequestSpec]:
    count_tokens = token_counter(args.tokenizer)
    sampled = sample_sharegpt(args.num_prompts, count_tokens, seed=args.seed,
                              output_len=args.sharegpt_output_len, path=args.dataset_path)
    return [RequestSpec(max_tokens=s.output_len, prompt=s.prompt) for s in sampled]


def token_counter(tokenizer: str | None) -> Callable[[str], int]:
    """Token count of a text under `tokenizer` (default: the demo model's), as SGLang's
    bench_serving counts: `encode(text)`, special tokens included."""
    from transformers import AutoTokenizer

    from sgl_jax.demo import demo_model_path

    path = Path(tokenizer) if tokenizer else demo_model_path()
    if path.suffix == ".gguf":  # transformers reads the tokenizer out of the GGUF metadata
        loaded = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        loaded = AutoTokenizer.from_pretrained(str(path))
    return lambda text: len(loaded.encode(text))


async def async_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns {"args", "model", "summary", "requests"}, the same record
    --output-json gets."""
    specs = build_requests(args)
    async with make_client(args) as client:
        model = args.model
        if model is None:
            try:
                model = await first_model_id(client)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                raise SystemExit(f"cannot read the model from {args.base_url}/v1/models "
                                 f"({type(e).__name__}: {e}); pass --model") from e
        bodies = [request_body(s, args.endpoint, model, args.temperature, args.ignore_eos)
                  for s in specs]
        print(f"{len(bodies)} requests to {args.base_url}{endpoint_path(args.endpoint)} "
              f"(model {model}, rate {args.request_rate} req/s, "
              f"max concurrency {args.max_concurrency or 'unlimited'})")
        results, duration_s = await run_requests(client, bodies, args)

    summary = summarize(results, duration_s)
    print(format_summary(summary))
    for note in report_notes(summary, results):
        print(note)
    record = {"args": args_record(args), "model": model, "summary": summary,
              "requests": [asdict(r) for r in results]}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.output_json}")
    return record


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return asyncio.run(async_main(parse_args(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
