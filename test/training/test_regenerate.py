"""--regenerate: each assistant turn becomes the target's own answer to the regenerated history,
checked against transformers' greedy generation on the same rendered prompt."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgl_jax import Engine
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.training.regenerate import regenerate

SMALL = dict(dtype="float32", precompile_token_paddings=[16, 64],
             precompile_bs_paddings=[1, 2, 4], max_prefill_tokens=64, skip_server_warmup=True)
NEW_TOKENS = 6


def transformers_answer(model, tokenizer, history) -> str:
    ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def test_assistant_turns_are_the_targets_answers(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "target", "llama")
    conversations = [
        [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "old"},
         {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "old 2"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two"},
         {"role": "assistant", "content": "old 3"}],
        [{"role": "user", "content": "a prompt far too long " * 40},
         {"role": "assistant", "content": "never regenerated"}],
    ]
    with Engine(model_path=str(model_dir), **SMALL) as engine:
        result = regenerate(engine, engine.tokenizer, conversations, temperature=0.0,
                            max_new_tokens=NEW_TOKENS, context_length=64, progress=False)
    assert len(result) == 2  # the third has no room for an answer and is dropped
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for original, new in zip(conversations, result, strict=False):
        assert [m["role"] for m in new] == [m["role"] for m in original]
        for i, message in enumerate(new):
            if message["role"] == "assistant":
                assert message["content"] == transformers_answer(model, tokenizer, new[:i])
            else:
                assert message == original[i]
