"""The seed cards' speculative command line, served over HTTP to the official openai client:
answers equal the plain server's, and acceptance shows in /get_server_info and /metrics (our
names and vLLM's). NGRAM from the command line: a question asked again drafts from the answer
given before, and a request may turn speculation off or cap its depth (a bad value is a 400
naming the field)."""

import json
import re

import httpx
import openai
import pytest

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft
from sgl_jax.testing.server import launch_server

FLAGS = ["--dtype", "float32", "--precompile-token-paddings", "64", "--precompile-bs-paddings",
         "1,4", "--max-prefill-tokens", "64", "--skip-server-warmup", "--context-length", "256",
         "--served-model-name", "tiny", "--enable-metrics"]
# The shape of the seed cards' commands: a wide tree.
SPEC_FLAGS = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
              "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]
MESSAGES = [{"role": "user", "content": "Name three rivers in Europe."}]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-server")
    target = write_tiny_checkpoint(root / "qwen3", "qwen3")
    config = json.loads((target / "config.json").read_text())
    return target, write_tiny_eagle3_draft(root / "draft", config, draft_vocab_size=256)


def chat(base_url: str, **extra_body) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                           max_tokens=24,
                                           extra_body={"ignore_eos": True, **extra_body})
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def expected(paths):
    with launch_server(["--model-path", str(paths[0]), *FLAGS]) as plain:
        return chat(plain.base_url)


def test_speculative_server_answers_like_the_plain_one(paths, expected):
    target, draft = paths
    flags = ["--model-path", str(target), *FLAGS, *SPEC_FLAGS,
             "--speculative-draft-model-path", str(draft)]
    with launch_server(flags) as server:
        assert chat(server.base_url) == expected
        info = httpx.get(f"{server.base_url}/get_server_info").json()
        assert info["speculative_algorithm"] == "EAGLE3"
        assert info["spec_verify_rounds"] >= 1 and info["avg_spec_accept_length"] >= 1.0
        assert len(info["spec_accept_rates"]) == 3
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert re.search(r'^sgl_jax_spec_accept_rate\{model_name="tiny",position="2"\} ',
                         metrics, re.M)
        assert re.search(r"^sgl_jax_spec_accept_length\{[^}]*\} [0-9.]+$", metrics, re.M)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="not supported with speculative"):
            client.chat.completions.create(model="tiny", messages=MESSAGES,
                                           frequency_penalty=0.5)
        assert httpx.get(f"{server.base_url}/health").status_code == 200


def vllm_counter(metrics: str, name: str, position: int | None = None) -> float:
    where = "" if position is None else f',position="{position}"'
    found = re.search(rf'^vllm:{name}_total\{{engine="0",model_name="tiny"{where}\}} '
                      rf'([0-9.e+]+)$', metrics, re.M)
    assert found, f"vllm:{name} is missing"
    return float(found.group(1))


def test_ngram_server_drafts_a_repeated_answer_and_takes_per_request_control(paths, expected):
    flags = ["--model-path", str(paths[0]), *FLAGS, "--speculative-algorithm", "NGRAM",
             "--speculative-ngram-max-match-window-size", "8"]
    with launch_server(flags) as server:
        url = server.base_url
        assert chat(url) == expected
        assert chat(url) == expected  # drafted from the first answer
        info = httpx.get(f"{url}/get_server_info").json()
        assert info["speculative_algorithm"] == "NGRAM" and info["spec_accepted_tokens"] > 0
        metrics = httpx.get(f"{url}/metrics").text
        assert vllm_counter(metrics, "spec_decode_num_drafts") == info["spec_verify_rounds"]
        assert vllm_counter(metrics, "spec_decode_num_accepted_tokens") == \
            info["spec_accepted_tokens"]
        assert vllm_counter(metrics, "spec_decode_num_draft_tokens") == \
            sum(info["spec_drafted_per_position"])
        assert vllm_counter(metrics, "spec_decode_num_accepted_tokens_per_pos", 0) == \
            info["spec_accepted_per_position"][0]
        # Speculation off for one request: the same answer, and no draft verified for it.
        assert chat(url, speculative=False) == expected
        after = httpx.get(f"{url}/get_server_info").json()
        assert after["spec_verify_rounds"] == info["spec_verify_rounds"]
        # A cap: no draft deeper than one token.
        assert chat(url, speculative_num_steps=1) == expected
        capped = httpx.get(f"{url}/get_server_info").json()["spec_drafted_per_position"]
        assert capped[1:] == after["spec_drafted_per_position"][1:]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for body, field in (({"speculative_num_steps": 0}, "speculative_num_steps"),
                            ({"speculative": "no"}, "speculative")):
            with pytest.raises(openai.BadRequestError, match=field):
                client.chat.completions.create(model="tiny", messages=MESSAGES,
                                               extra_body=body)
        reply = httpx.post(f"{url}/generate", json={
            "text": "hi", "sampling_params": {"max_new_tokens": 2, "speculative": 3}})
        assert reply.status_code == 400 and "speculative" in reply.text
        assert httpx.get(f"{url}/health").status_code == 200
