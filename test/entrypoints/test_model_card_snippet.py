"""The Python snippet of the EAGLE3 model cards users read (SGLang's `sgl.LLM(model=...)`),
run as written with only the module name and the paths changed, on a tiny checkpoint with a
tiny EAGLE3 head and (slow) on the demo model with its trained head. Both add settings that
keep a CPU test short (few buckets, compiled when first used): every default bucket in
bfloat16 takes minutes to compile on two cores."""

import json

import pytest

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft

CARD_SNIPPET = """
import sgl_jax as sgl

llm = sgl.LLM(
    model={model!r},
    speculative_algorithm="EAGLE3",
    speculative_draft_model_path={draft!r},
    speculative_num_steps=5,
    speculative_eagle_topk=4,
    dtype="bfloat16",{extra}
)
"""
QUICK = """
    precompile_token_paddings=[16, 64], precompile_bs_paddings=[1], skip_server_warmup=True,"""


def run_card_snippet(model: str, draft: str, extra: str = ""):
    scope = {}
    exec(CARD_SNIPPET.format(model=model, draft=draft, extra=extra), scope)  # the card's text
    return scope["llm"]


def check_it_serves_the_cards_settings(llm) -> None:
    try:
        info = llm.get_server_info()
        assert (info["speculative_num_steps"], info["speculative_eagle_topk"]) == (5, 4)
        assert info["dtype"] == "bfloat16" and info["speculative_algorithm"] == "EAGLE3"
        out = llm.generate(prompt="The capital of France is",
                           sampling_params={"temperature": 0, "max_new_tokens": 8,
                                            "ignore_eos": True})
        assert len(out["output_ids"]) == 8
        assert llm.get_server_info()["spec_verify_rounds"] >= 1
    finally:
        llm.shutdown()


def test_the_card_snippet_on_a_tiny_checkpoint(tmp_path):
    target = write_tiny_checkpoint(tmp_path / "llama", "llama")
    config = json.loads((target / "config.json").read_text())
    draft = write_tiny_eagle3_draft(tmp_path / "eagle3", config)
    check_it_serves_the_cards_settings(run_card_snippet(str(target), str(draft), QUICK))


@pytest.mark.slow
def test_the_card_snippet_on_the_demo_model():
    from sgl_jax.demo import demo_draft_path, demo_model_path

    try:
        model = str(demo_model_path())
    except FileNotFoundError as e:
        pytest.skip(f"demo model not installed: {e}")
    check_it_serves_the_cards_settings(run_card_snippet(model, str(demo_draft_path()), QUICK))


def test_model_and_model_path_are_one_argument():
    import sgl_jax

    assert sgl_jax.LLM is sgl_jax.Engine
    with pytest.raises(TypeError, match="model_path or as model, not both"):
        sgl_jax.LLM("a", model="b")
