"""The real server in a subprocess on 127.0.0.1, driven by the official openai client: chat and
text completions (plain and streamed) against transformers, every bad input's status and error
shape, API keys, metrics, native endpoints, and 50 concurrent streams with disconnects."""

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.server import launch_server

API_KEY = "test-key"
MODEL = "tiny-qwen3"
CONTEXT = 256
# Few shape buckets compiled on first use keep start-up and compilation short on CPU.
SERVER_FLAGS = ["--dtype", "float32", "--precompile-token-paddings", "64,256",
                "--precompile-bs-paddings", "1,4,16,64", "--max-prefill-tokens", "256",
                "--skip-server-warmup", "--context-length", str(CONTEXT),
                "--served-model-name", MODEL, "--random-seed", "0"]
USER = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 8}
NO_EOS = {"extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def server(model_dir):
    flags = ["--model-path", str(model_dir), *SERVER_FLAGS, "--api-key", API_KEY,
             "--enable-metrics", "--reasoning-parser", "qwen3"]
    with launch_server(flags) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the requests below ignore EOS too
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def chat_prompt_ids(hf, messages) -> list[int]:
    text = hf[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return hf[1](text, add_special_tokens=False).input_ids


def server_info(server) -> dict:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.get(f"{server.base_url}/get_server_info", headers=headers).json()


# ---------------------------------------------------------------------- chat


def test_greedy_chat_matches_transformers_plain_and_streamed(client, hf):
    reply = client.chat.completions.create(model=MODEL, messages=USER, **GREEDY, **NO_EOS)
    prompt_ids = chat_prompt_ids(hf, USER)
    expected = hf[1].decode(hf_greedy(hf, prompt_ids, 8), skip_special_tokens=True)
    choice = reply.choices[0]
    assert choice.message.content == expected and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert reply.model == MODEL and reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 8)
    assert reply.usage.total_tokens == len(prompt_ids) + 8

    stream = client.chat.completions.create(model=MODEL, messages=USER, **GREEDY, **NO_EOS,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_message_forms_roles_and_max_completion_tokens(client, hf):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                             {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "And then?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_completion_tokens=5, **NO_EOS)
    as_strings = [{**m, "content": "Hello there"} if isinstance(m["content"], list) else m
                  for m in messages]
    expected = hf[1].decode(hf_greedy(hf, chat_prompt_ids(hf, as_strings), 5),
                            skip_special_tokens=True)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(chat_prompt_ids(hf, as_strings))
    # "default" names the served model too (clients written for SGLang send it).
    again = client.chat.completions.create(model="default", messages=messages, temperature=0,
                                           max_tokens=5, **NO_EOS)
    assert again.choices[0].message.content == expected


def test_stop_string_ends_the_text_with_finish_reason_stop(client):
    full = client.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                          max_tokens=16, **NO_EOS).choices[0].message.content
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if full[i:i + 2].strip())
    reply = client.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                           max_tokens=16, stop=[stop], **NO_EOS)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_choices(client):
    kwargs = dict(model=MODEL, messages=USER, temperature=1.0, top_p=0.9, top_k=50, max_tokens=12,
                  seed=1234, n=3, **NO_EOS)
    kwargs["extra_body"] = {**kwargs["extra_body"], "top_k": 50, "min_p": 0.01}
    del kwargs["top_k"]
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 36
    streamed = client.chat.completions.create(**kwargs, stream=True)
    by_index = {}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
    assert [by_index[i] for i in range(3)] == texts


def test_chat_logprobs_are_the_greedy_tokens_and_sorted_alternatives(client):
    reply = client.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                           max_tokens=4, logprobs=True, top_logprobs=3,
                                           **NO_EOS)
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        # Greedy picks the most likely token, so its logprob is the best alternative's.
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)
        assert entry.token == entry.top_logprobs[0].token
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_reasoning_parser_keeps_plain_answers_as_content(client):
    reply = client.chat.completions.create(model=MODEL, messages=USER, **GREEDY, **NO_EOS)
    message = reply.choices[0].message
    # The random model never opens a <think> block: all of it is the answer.
    assert message.content and not getattr(message, "reasoning_content", None)


# ---------------------------------------------------------------------- completions and models


def test_completions_accept_every_prompt_form(client, hf):
    tok = hf[1]
    prompt = "The capital of France is"
    ids = tok(prompt).input_ids
    expected = tok.decode(hf_greedy(hf, ids, 6), skip_special_tokens=True)
    common = dict(model=MODEL, temperature=0, max_tokens=6, **NO_EOS)
    for form in (prompt, [prompt], ids, [ids]):
        reply = client.completions.create(prompt=form, **common)
        assert [c.text for c in reply.choices] == [expected]
        assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].finish_reason == "length"
    other = "Once upon a time"
    reply = client.completions.create(prompt=[prompt, other], n=2, **common)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices[:2]] == [expected, expected]
    assert reply.usage.prompt_tokens == len(ids) + len(tok(other).input_ids)
    streamed = client.completions.create(prompt=[prompt, other], stream=True, **common)
    texts = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts[0] == expected and len(texts) == 2


def test_completion_logprobs_legacy_shape(client):
    reply = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=3,
                                      logprobs=2, **NO_EOS)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 3
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == reply.choices[0].text


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].owned_by == "sgl-jax"
    assert client.models.retrieve(MODEL).id == MODEL


# ---------------------------------------------------------------------- bad input


def _raw_post(server, path, content, key=API_KEY):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=30)


BAD_CHAT = [
    # (body changes, status, param, words in the message)
    ({"temperature": "hot"}, 400, "temperature", "valid number"),
    ({"temperature": 3}, 400, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, 400, "top_p", "greater than 0"),
    ({"n": 0}, 400, "n", "greater than or equal to 1"),
    ({"max_tokens": -1}, 400, "max_tokens", "greater than or equal to 0"),
    ({"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", "less than or equal"),
    ({"top_logprobs": 2}, 400, None, "requires logprobs"),
    ({"functions": [{"name": "f"}]}, 400, "functions", "not supported"),
    ({"logit_bias": {"5": "high"}}, 400, "logit_bias.5", "valid number"),
    ({"response_format": {"type": "xml"}}, 400, "response_format.type", "'json_schema'"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format",
     "json_schema exactly when"),
    ({"regex": "(unclosed"}, 400, None, "invalid regex"),
    ({"regex": "a", "response_format": {"type": "json_object"}}, 400, None, "at most one of"),
    ({"frobnicate": 1}, 400, "frobnicate", "unknown field"),
    ({"model": "gpt-4o"}, 404, "model", "does not exist"),
    ({"messages": []}, 400, "messages", "at least 1 item"),
    ({"messages": [{"role": "function", "content": "x"}]}, 400, "messages.0.role", "'tool'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0", "tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0", "'image_url' are not supported"),
    ({"max_tokens": CONTEXT}, 400, "max_tokens", f"context length is {CONTEXT} tokens"),
    ({"chat_template_kwargs": {"tokenize": True}}, 400, "messages", "may not set"),
    ({"stream_options": {"include_usage": True}}, 400, None, "only allowed with stream"),
]


@pytest.mark.parametrize("change, status, param, words", BAD_CHAT)
def test_bad_chat_requests_get_openai_errors(server, client, change, status, param, words):
    body = {"model": MODEL, "messages": USER, **change}
    response = _raw_post(server, "/v1/chat/completions", json.dumps(body))
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if words:
        assert words in error["message"]


def test_the_openai_client_sees_the_same_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, extra_body={"foo": 1})
    assert info.value.status_code == 400 and info.value.body["param"] == "foo"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=USER)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1000)
    numbers = re.findall(r"\d+", info.value.body["message"])
    assert str(CONTEXT) in numbers and "1000" in numbers


@pytest.mark.parametrize("path, content, status, code", [
    ("/v1/chat/completions", "{not json", 400, "invalid_json"),
    ("/v1/chat/completions", json.dumps({"model": MODEL}), 400, "missing_parameter"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": ""}), 400, "invalid_value"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [10**6]}), 400,
     "invalid_request"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "suffix": "!"}), 400,
     "unsupported_parameter"),
    ("/generate", json.dumps({"text": "x", "input_ids": [1]}), 400, "invalid_value"),
    ("/generate", json.dumps({"text": "x", "sampling_params": {"temprature": 0}}), 400,
     "invalid_request"),
    ("/no/such/path", "{}", 404, "not_found"),
])
def test_other_bad_requests(server, path, content, status, code):
    response = _raw_post(server, path, content)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code


def test_openapi_describes_every_request_body(server):
    document = httpx.get(f"{server.base_url}/openapi.json",
                         headers={"Authorization": f"Bearer {API_KEY}"}).json()
    schemas = document["components"]["schemas"]
    for path, name in [("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/v1/completions", "CompletionRequest"), ("/generate", "GenerateRequest")]:
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{name}"
    fields = set(schemas["ChatCompletionRequest"]["properties"])
    assert {"messages", "model", "response_format", "logit_bias", "regex", "tools",
            "tool_choice"} <= fields
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(document))
    assert refs and all(ref in schemas for ref in refs)


def test_wrong_method_is_405_in_the_error_shape(server):
    response = httpx.get(f"{server.base_url}/v1/chat/completions",
                         headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 405 and response.json()["error"]["code"]


def test_api_key_is_required_everywhere_but_health(server):
    body = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 1})
    for key in (None, "wrong-key"):
        response = _raw_post(server, "/v1/chat/completions", body, key=key)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    bad_client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()


def test_the_server_keeps_serving_after_bad_requests(server, client):
    for _ in range(3):
        _raw_post(server, "/v1/chat/completions", "{")
        _raw_post(server, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}))
    reply = client.chat.completions.create(model=MODEL, messages=USER, **GREEDY, **NO_EOS)
    assert reply.usage.completion_tokens == 8
    info = server_info(server)
    assert info["kv_pages_in_use"] == 0 and info["num_running_reqs"] == 0


# ---------------------------------------------------------------------- native and metrics


def test_native_endpoints(server, hf):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    base = server.base_url
    body = {"text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 4,
                                                 "ignore_eos": True}}
    out = httpx.post(f"{base}/generate", json=body, headers=headers, timeout=60).json()
    assert len(out["output_ids"]) == 4 and out["meta_info"]["completion_tokens"] == 4
    by_ids = httpx.post(f"{base}/generate", headers=headers, timeout=60, json={
        **body, "text": None, "input_ids": hf[1]("Hello").input_ids}).json()
    assert by_ids["output_ids"] == out["output_ids"]
    with httpx.stream("POST", f"{base}/generate", json={**body, "stream": True},
                      headers=headers, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum((c["output_ids"] for c in chunks), []) == out["output_ids"]
    assert "".join(c["text"] for c in chunks) == out["text"]
    assert httpx.get(f"{base}/health_generate", headers=headers, timeout=60).status_code == 200
    info = httpx.get(f"{base}/get_model_info", headers=headers).json()
    assert info["architecture"] == "Qwen3ForCausalLM" and info["context_length"] == CONTEXT
    assert info["served_model_name"] == MODEL and info["dtype"] == "float32"
    server_state = server_info(server)
    assert server_state["api_key"] == "<set>" and server_state["context_length"] == CONTEXT
    assert server_state["dtype"] == "float32"
    assert httpx.post(f"{base}/flush_cache", headers=headers).status_code == 200


def metrics_text(server) -> str:
    return httpx.get(f"{server.base_url}/metrics",
                     headers={"Authorization": f"Bearer {API_KEY}"}).text


def abort_count(server) -> float:
    return finished_count(server, "abort")


def finished_count(server, reason: str) -> float:
    found = re.search(rf'^sgl_jax_requests_total\{{finish_reason="{reason}"[^}}]*\}} (\S+)$',
                      metrics_text(server), re.M)
    return float(found.group(1)) if found else 0.0


def test_metrics_count_requests_and_latencies(server, client):
    client.chat.completions.create(model=MODEL, messages=USER, **GREEDY, **NO_EOS)
    values = dict(re.findall(r'^(sgl_jax_\w+)\{[^}]*\} ([0-9.e+]+)$', metrics_text(server),
                             re.M))
    assert float(values["sgl_jax_requests_total"]) >= 1
    assert float(values["sgl_jax_time_to_first_token_seconds_count"]) >= 1
    assert float(values["sgl_jax_inter_token_latency_seconds_count"]) >= 7
    assert float(values["sgl_jax_e2e_request_latency_seconds_count"]) >= 1
    assert float(values["sgl_jax_generation_tokens_total"]) >= 8
    for gauge in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate",
                  "scheduler_idle_seconds"):
        assert f"sgl_jax_{gauge}" in values
    # the engine thread's steps: the request's prefill, and a decode step per later token
    steps = dict(re.findall(r'^sgl_jax_scheduler_steps\{kind="(\w+)"[^}]*\} ([0-9.e+]+)$',
                            metrics_text(server), re.M))
    assert float(steps["prefill"]) >= 1 and float(steps["decode"]) >= 7


# ---------------------------------------------------------------------- concurrency


def test_fifty_streams_half_disconnecting_leave_no_pages_in_use(server, client):
    prompts = [[{"role": "user", "content": f"Tell me about topic number {i}."}]
               for i in range(5)]
    request = dict(model=MODEL, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    expected = [client.chat.completions.create(messages=p, **request).choices[0].message.content
                for p in prompts]

    async def one_client(i: int, aclient: openai.AsyncOpenAI):
        # Odd clients ask for long answers and hang up after a few chunks.
        long = {"max_tokens": 200} if i % 2 else {}
        stream = await aclient.chat.completions.create(messages=prompts[i % 5], stream=True,
                                                       **{**request, **long})
        text, chunks = "", 0
        async for chunk in stream:
            chunks += 1
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if i % 2 and chunks == 3:
                await stream.close()
                return None
        return text

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY,
                                     max_retries=0, timeout=300)
        return await asyncio.gather(*(one_client(i, aclient) for i in range(50)))

    aborted_before, finished_before = abort_count(server), finished_count(server, "length")
    results = asyncio.run(run_all())
    for i, text in enumerate(results):
        assert (text is None) == bool(i % 2)
        if text is not None:
            assert text == expected[i % 5], f"client {i}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = server_info(server)
        if info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0:
            break
        time.sleep(0.5)
    assert info["num_running_reqs"] == 0 and info["kv_pages_in_use"] == 0
    # Each hang-up aborts its request, unless (on a loaded machine) the request reached its
    # 200 tokens before the server saw the client go; every request ended one way or the other.
    aborted = abort_count(server) - aborted_before
    assert 0 < aborted <= 25
    assert aborted + finished_count(server, "length") - finished_before == 50
    reply = client.chat.completions.create(messages=prompts[0], **request)
    assert reply.choices[0].message.content == expected[0]


def test_the_server_log_shows_no_failures(server):
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log
    assert "Prefill batch" in log


# ---------------------------------------------------------------------- another configuration


def test_named_template_reasoning_split_small_pool_and_no_api_key(model_dir, hf):
    flags = ["--model-path", str(model_dir), *SERVER_FLAGS, "--reasoning-parser", "deepseek-r1",
             "--chat-template", "qwen3-instruct-no-thinking", "--max-total-tokens", "128"]
    with launch_server(flags) as proc:
        metrics = httpx.get(f"{proc.base_url}/metrics")
        assert metrics.status_code == 404  # no --enable-metrics
        assert metrics.json()["error"] == {
            "message": "/metrics is off; start the server with --enable-metrics",
            "type": "invalid_request_error", "param": None, "code": "not_found"}
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0)
        request = dict(model=MODEL, messages=USER, temperature=0, max_tokens=8)
        plain = client.chat.completions.create(**request, extra_body={
            "ignore_eos": True, "separate_reasoning": False})
        split = client.chat.completions.create(**request, extra_body={"ignore_eos": True})
        text = hf[1].apply_chat_template(USER, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)
        prompt_ids = hf[1](text, add_special_tokens=False).input_ids
        expected = hf[1].decode(hf_greedy(hf, prompt_ids, 8), skip_special_tokens=True)
        assert plain.choices[0].message.content == expected
        assert plain.usage.prompt_tokens == len(prompt_ids)
        # deepseek-r1 style: the block is open from the first token and never closes here.
        assert split.choices[0].message.reasoning_content == expected
        assert split.choices[0].message.content == ""
        stream = client.chat.completions.create(**request, stream=True,
                                                extra_body={"ignore_eos": True})
        deltas = [c.choices[0].delta for c in stream if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == expected
        assert not "".join(d.content or "" for d in deltas)
        # Without max_tokens a request gets all the KV pool holds (smaller than the context).
        longest = client.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert longest.usage.completion_tokens == 128 - len(prompt_ids)
        assert longest.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------- fuzzing

FUZZ_EXAMPLES = 40  # per operation and mode: about 500 requests, 15 s on 2 cores


def test_generated_bodies_never_break_the_server(server):
    """schemathesis reads /openapi.json and sends every operation bodies its schema admits
    and bodies it does not: no answer is a 5xx, every error is in OpenAI's shape, a body the
    schema rejects is never answered 2xx (no field silently ignored), and afterwards the
    server answers with no request or page left. A body the schema admits may still be
    refused (checks across fields, token ids past the vocabulary, an unknown model name)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    headers = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=headers)
    schema.config.update(base_url=server.base_url)
    failures, answered = [], {}

    def check(case, mode: str) -> None:
        response = case.call(headers=headers, timeout=60)
        status = response.status_code
        key = (case.operation.method.upper(), case.operation.path, mode)
        answered[key] = answered.get(key, 0) + 1
        shaped = status < 400 or set(response.json().get("error", {})) >= {
            "message", "type", "code"}
        if status >= 500 or not shaped or (mode == "negative" and status < 400):
            failures.append((key, status, repr(case.body)[:200], response.text[:200]))

    def sender(operation, mode):
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        def send(case):
            check(case, mode.value)
        return send

    for operation in (result.ok() for result in schema.get_all_operations()):
        for mode in schemathesis.GenerationMode:
            try:
                sender(operation, mode)()
            except Unsatisfiable:  # nothing to make invalid (an operation without inputs)
                assert mode.value == "negative"
    assert not failures, failures[:5]
    posts = [key for key in answered if key[0] == "POST" and key[2] == "negative"]
    assert len(posts) == 3 and all(answered[key] >= FUZZ_EXAMPLES // 2 for key in posts)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    info = server_info(server)
    assert info["kv_pages_in_use"] == 0 and info["num_running_reqs"] == 0
