"""SGLang's request protocol on the real server (tiny checkpoint, over a socket): the bodies
SGLang's router forwards (its extension fields at their defaults) succeed on chat, completions
and /generate; the SGLang fields this server implements change the output as SGLang's do;
a non-default value of one it does not implement, or a field outside SGLang's schema, is a 400
naming it; /model_info and /server_info answer what the router reads."""

import contextlib
import json
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from sgl_jax.entrypoints.native_api import GenerateRequest
from sgl_jax.entrypoints.openai.protocol import (
    SGLANG_CHAT_DEFAULT_ONLY,
    SGLANG_COMPLETION_DEFAULT_ONLY,
    SGLANG_GENERATE_DEFAULT_ONLY,
    ChatCompletionRequest,
    CompletionRequest,
)
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.server import launch_server
from sgl_jax.testing.tokenizer import IM_END

MODEL = "tiny-qwen3"
SERVER_FLAGS = ["--dtype", "float32", "--precompile-token-paddings", "64,256",
                "--precompile-bs-paddings", "1,4", "--max-prefill-tokens", "256",
                "--skip-server-warmup", "--context-length", "256", "--served-model-name", MODEL,
                "--random-seed", "0", "--reasoning-parser", "qwen3"]
USER = [{"role": "user", "content": "What is the capital of France?"}]

# What SGLang's router (sglang-router 0.3.2) forwards for a client's plain request: each
# extension field it knows, at its default, and max_tokens renamed max_completion_tokens.
ROUTER_CHAT = {"messages": USER, "model": MODEL, "logprobs": False, "max_completion_tokens": 8,
               "stream": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False}
ROUTER_COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
                     "stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                     "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_GENERATE = {"text": "Hello", "model": None,
                   "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
                   "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False,
                   "return_bytes": False, "return_entropy": False}


# Qwen3's own generation_config.json sampling defaults (the card's recommendation).
QWEN3_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    generation_config = path / "generation_config.json"
    generation_config.write_text(json.dumps({
        **json.loads(generation_config.read_text()), "do_sample": True, **QWEN3_DEFAULTS}))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with launch_server(["--model-path", str(model_dir), *SERVER_FLAGS]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def greedy(**body) -> dict:
    return {"temperature": 0, "ignore_eos": True, **body}


# ---------------------------------------------------------------------- router-shaped requests


def test_router_shaped_bodies_succeed_on_every_endpoint(server):
    chat = post(server, "/v1/chat/completions", ROUTER_CHAT)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] <= 8
    streamed = post(server, "/v1/chat/completions", {**ROUTER_CHAT, "stream": True})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    completion = post(server, "/v1/completions", ROUTER_COMPLETION)
    assert completion.status_code == 200, completion.text
    generate = post(server, "/generate", ROUTER_GENERATE)
    assert generate.status_code == 200, generate.text
    assert generate.json()["meta_info"]["completion_tokens"] <= 4


def test_a_request_without_a_model_reaches_the_served_one(server):
    """SGLang's schemas default the model; its router sends "unknown" for a request that
    named none."""
    for body in ({"messages": USER, "max_tokens": 2}, {**ROUTER_CHAT, "model": "unknown"}):
        reply = post(server, "/v1/chat/completions", body)
        assert reply.status_code == 200 and reply.json()["model"] == MODEL, reply.text
    assert post(server, "/generate", {**ROUTER_GENERATE, "model": MODEL}).status_code == 200
    wrong = post(server, "/generate", {**ROUTER_GENERATE, "model": "gpt-4o"})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


def test_messages_may_carry_name_and_reasoning_content(server):
    messages = [{"role": "user", "content": "Hi", "name": "ann"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
                {"role": "user", "content": "Bye"}]
    reply = post(server, "/v1/chat/completions", {**ROUTER_CHAT, "messages": messages})
    assert reply.status_code == 200, reply.text


def test_every_sglang_field_at_its_default_is_accepted():
    for schema, fields, base in [
        (ChatCompletionRequest, SGLANG_CHAT_DEFAULT_ONLY, {"messages": USER}),
        (CompletionRequest, SGLANG_COMPLETION_DEFAULT_ONLY, {"prompt": "x"}),
        (GenerateRequest, SGLANG_GENERATE_DEFAULT_ONLY, {"text": "x"}),
    ]:
        defaults = {field: values[0] for field, values in fields.items()}
        schema.model_validate_json(json.dumps({**base, **defaults}))


# ---------------------------------------------------------------------- implemented fields


def first_stop(text: str) -> str:
    """Two characters from the middle of `text` that are not blank."""
    return next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip())


def test_no_stop_trim_keeps_the_stop_string(client):
    chat = dict(model=MODEL, messages=USER, temperature=0, max_tokens=16)
    full = client.chat.completions.create(**chat, extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    stop = first_stop(text)
    end = text.index(stop) + len(stop)
    kept = client.chat.completions.create(**chat, stop=[stop], extra_body={
        "ignore_eos": True, "no_stop_trim": True})
    assert kept.choices[0].message.content == text[:end]
    assert kept.choices[0].finish_reason == "stop"
    prompt = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=16)
    text = client.completions.create(**prompt, extra_body={"ignore_eos": True}).choices[0].text
    stop = first_stop(text)
    kept = client.completions.create(**prompt, stop=stop, extra_body={
        "ignore_eos": True, "no_stop_trim": True})
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]


def test_echo_prepends_each_prompt(client, tokenizer):
    prompts = ["The capital of France is", "Once upon a time"]
    common = dict(model=MODEL, temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt=prompts, **common)
    echoed = client.completions.create(prompt=prompts, echo=True, n=2, **common)
    expected = [p + choice.text for p, choice in zip(prompts, plain.choices, strict=True)]
    assert [c.text for c in echoed.choices] == [expected[0]] * 2 + [expected[1]] * 2
    ids = tokenizer(prompts[0]).input_ids
    by_ids = client.completions.create(prompt=ids, echo=True, **common)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    streamed = client.completions.create(prompt=prompts[0], echo=True, stream=True, **common)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected[0]


def test_continue_final_message_extends_the_last_assistant_turn(client, tokenizer):
    messages = [*USER, {"role": "assistant", "content": "The capital of France"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6,
        extra_body={"ignore_eos": True, "continue_final_message": True})
    # The same prompt as text: the template with the last message left open.
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("The capital of France")
    same = client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=6,
                                     extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == same.choices[0].text
    assert reply.usage.prompt_tokens == same.usage.prompt_tokens


def test_max_completion_tokens_caps_the_output(server):
    reply = post(server, "/v1/chat/completions", {**ROUTER_CHAT, "ignore_eos": True,
                                                  "max_completion_tokens": 3})
    assert reply.json()["usage"]["completion_tokens"] == 3
    assert reply.json()["choices"][0]["finish_reason"] == "length"


def test_skip_special_tokens_false_keeps_special_tokens(server, tokenizer):
    """A bias forces the special <|im_end|> token; by default its text is skipped."""
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    body = {**ROUTER_CHAT, **greedy(max_completion_tokens=3, logit_bias={str(im_end): 100})}
    skipped = post(server, "/v1/chat/completions", body).json()
    kept = post(server, "/v1/chat/completions", {**body, "skip_special_tokens": False}).json()
    assert skipped["choices"][0]["message"]["content"] == ""
    assert kept["choices"][0]["message"]["content"] == IM_END * 3


def test_json_schema_constrains_a_completion(server):
    body = {**ROUTER_COMPLETION, **greedy(max_tokens=8),
            "json_schema": json.dumps({"enum": ["yes", "no"]})}
    reply = post(server, "/v1/completions", body)
    assert json.loads(reply.json()["choices"][0]["text"]) in ("yes", "no"), reply.text


def test_return_text_in_logprobs_adds_each_tokens_text(server, tokenizer):
    body = {**ROUTER_GENERATE, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
    plain = post(server, "/generate", body).json()["meta_info"]
    assert {len(entry) for entry in plain["output_token_logprobs"]} == {2}
    labelled = post(server, "/generate", {**body, "return_text_in_logprobs": True})
    meta = labelled.json()["meta_info"]
    assert [e[:2] for e in meta["output_token_logprobs"]] == plain["output_token_logprobs"]
    assert all(text == tokenizer.decode([token])
               for _, token, text in meta["output_token_logprobs"])
    assert all(len(top) == 2 and all(len(entry) == 3 for entry in top)
               for top in meta["output_top_logprobs"])
    with httpx.stream("POST", f"{server.base_url}/generate", timeout=60, json={
            **body, "return_text_in_logprobs": True, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    streamed = [e for chunk in events[:-1]
                for e in json.loads(chunk)["meta_info"]["output_token_logprobs"]]
    assert [e[1:] for e in streamed] == [e[1:] for e in meta["output_token_logprobs"]]


def test_sampling_seed_is_sglangs_name_for_seed(server):
    params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}
    outputs = [post(server, "/generate", {**ROUTER_GENERATE, "sampling_params": {
        **params, name: 7}}).json()["output_ids"] for name in ("seed", "sampling_seed")]
    assert outputs[0] == outputs[1]


def test_left_out_sampling_fields_default_to_the_models_generation_config(client, server):
    """As SGLang's and vLLM's OpenAI servers: a chat or completion that leaves temperature,
    top_p and top_k out, or sends them null, samples as with the generation config's values;
    /generate keeps SamplingParams' own defaults."""
    openai_defaults = {"temperature": 1.0, "top_p": 1.0, "extra_body": {"top_k": -1}}
    model_defaults = {"temperature": 0.6, "top_p": 0.95, "extra_body": {"top_k": 20}}
    nulls = {"temperature": None, "top_p": None, "extra_body": {"top_k": None}}

    def chat(**fields):
        extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
        return client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=24, seed=11, extra_body=extra,
            **fields).choices[0].message.content

    left_out = chat()
    assert left_out == chat(**nulls) == chat(**model_defaults) != chat(**openai_defaults)

    def complete(**fields):
        extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
        return client.completions.create(model=MODEL, prompt="The capital", max_tokens=24,
                                         seed=11, extra_body=extra, **fields).choices[0].text

    assert complete() == complete(**model_defaults) != complete(**openai_defaults)

    def generate(params):
        body = {**ROUTER_GENERATE, "text": "The capital", "sampling_params": {
            "max_new_tokens": 24, "ignore_eos": True, "seed": 11, **params}}
        return post(server, "/generate", body).json()["output_ids"]

    assert generate({}) == generate({"temperature": 1.0}) != generate(QWEN3_DEFAULTS)


# ---------------------------------------------------------------------- refused


REFUSED = [  # (path, body changes, param, code)
    ("/v1/chat/completions", {"return_hidden_states": True}, "return_hidden_states",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"lora_path": "adapter"}, "lora_path", "unsupported_parameter"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {
        "continuous_usage_stats": True}}, "stream_options.continuous_usage_stats",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message",
     "invalid_value"),
    ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    # Not in SGLang's chat schema (its router forwards it when a client sends it).
    ("/v1/chat/completions", {"sampling_seed": 1}, "sampling_seed", "unknown_parameter"),
    ("/v1/completions", {"stop_regex": "x+"}, "stop_regex", "unsupported_parameter"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo", "unsupported_parameter"),
    ("/v1/completions", {"suffix": "!"}, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ("/generate", {"return_entropy": True}, "return_entropy", "unsupported_parameter"),
    ("/generate", {"log_metrics": False}, "log_metrics", "unsupported_parameter"),
    ("/generate", {"sampling_params": {"stop_regex": "x+"}}, "sampling_params.stop_regex",
     "unsupported_parameter"),
    ("/generate", {"frobnicate": 1}, "frobnicate", "unknown_parameter"),
]
BASES = {"/v1/chat/completions": ROUTER_CHAT, "/v1/completions": ROUTER_COMPLETION,
         "/generate": ROUTER_GENERATE}


@pytest.mark.parametrize("path, change, param, code", REFUSED)
def test_what_is_not_implemented_is_a_400_naming_it(server, path, change, param, code):
    response = post(server, path, {**BASES[path], **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error"


# ---------------------------------------------------------------------- server metadata


def test_model_info_and_server_info_under_sglangs_names(server, model_dir):
    base = server.base_url
    model = httpx.get(f"{base}/model_info").json()
    assert model == httpx.get(f"{base}/get_model_info").json()
    assert model["model_path"] == str(model_dir) and model["is_generation"] is True
    assert model["architectures"] == ["Qwen3ForCausalLM"] and model["model_type"] == "qwen3"
    info = httpx.get(f"{base}/server_info").json()
    assert info.keys() == httpx.get(f"{base}/get_server_info").json().keys()
    assert info["model_path"] == str(model_dir) and info["served_model_name"] == MODEL
    assert isinstance(info["max_running_requests"], int) and isinstance(info["version"], str)


# ---------------------------------------------------------------------- behind SGLang's router


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def sglang_router(worker_url: str, log_path):
    pytest.importorskip("sglang_router")
    port = _free_port()
    # Its own metrics port: the default one is shared by every router on the host.
    command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", worker_url,
               "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
               str(_free_port())]
    with open(log_path, "w") as log:
        router = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"{base_url}/v1/models"):
            assert router.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield base_url
    finally:
        router.terminate()
        router.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_openai_clients_work_through_sglangs_router(server, tmp_path):
    with sglang_router(server.base_url, tmp_path / "router.log") as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        direct = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        chat = dict(messages=USER, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(model=MODEL, **chat)
        assert reply.choices[0].message.content == (
            direct.chat.completions.create(model=MODEL, **chat).choices[0].message.content)
        stream = client.chat.completions.create(model="default", stream=True, **chat)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == reply.choices[0].message.content
        completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                               echo=True)
        assert completion.choices[0].text.startswith("Hello")
        generate = httpx.post(f"{base_url}/generate", timeout=60, json={
            "text": "Hello", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert len(generate.json()["output_ids"]) == 3
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, **{
                **chat, "extra_body": {"return_hidden_states": True}})
        assert info.value.body["param"] == "return_hidden_states"
