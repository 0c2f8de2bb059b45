"""The EAGLE3 head shipped for the demo model, served the way the README starts it (no draft
path): greedy output equals plain decoding token for token, and its drafts are accepted far
more often than a random head's (whose accept length is 1.0)."""

from __future__ import annotations

import pytest

from sgl_jax import Engine
from sgl_jax.datasets import load_mt_bench
from sgl_jax.demo import demo_model_path

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 48}
# One batch bucket: the batch shrinking as answers end compiles nothing more.
SETTINGS = dict(page_size=16, skip_server_warmup=True, max_running_requests=4,
                precompile_bs_paddings=[4], context_length=1024)


@pytest.fixture(scope="module")
def prompts():
    try:
        demo_model_path()
        questions = load_mt_bench()
    except FileNotFoundError as e:
        pytest.skip(f"demo model or MT-Bench not installed: {e}")
    return [[{"role": "user", "content": q.turns[0]}] for q in questions[:4]]


def chat_ids(engine, messages):
    from sgl_jax.tokenizer.chat_template import ChatTemplate

    template = ChatTemplate(engine.tokenizer)
    return [template.encode(m) for m in messages]


def test_demo_head_is_lossless_and_accepted(prompts):
    with Engine(**SETTINGS) as plain:
        ids = chat_ids(plain, prompts)
        expected = [o["output_ids"] for o in plain.generate(input_ids=ids,
                                                           sampling_params=GREEDY)]
    with Engine(speculative_algorithm="EAGLE3", speculative_num_steps=3,
                speculative_eagle_topk=1, speculative_num_draft_tokens=4, **SETTINGS) as spec:
        assert spec.server_args.speculative_draft_model_path.endswith(
            "smollm2-135m-instruct-eagle3")
        got = [o["output_ids"] for o in spec.generate(input_ids=ids, sampling_params=GREEDY)]
        info = spec.get_server_info()
    assert got == expected
    accept_length = 1 + info["spec_accepted_tokens"] / info["spec_verify_rounds"]
    assert accept_length > 1.3, info
