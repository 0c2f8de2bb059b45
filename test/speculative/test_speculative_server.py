"""The seed cards' speculative command line, served over HTTP to the official openai client:
answers equal the plain server's, and acceptance shows in /get_server_info and /metrics."""

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


def chat(base_url: str, **extra) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                           max_tokens=24, extra_body={"ignore_eos": True},
                                           **extra)
    return reply.choices[0].message.content


def test_speculative_server_answers_like_the_plain_one(paths):
    target, draft = paths
    with launch_server(["--model-path", str(target), *FLAGS]) as plain:
        expected = chat(plain.base_url)
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
