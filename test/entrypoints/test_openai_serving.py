"""OpenAIServing pieces that need no running engine."""

from types import SimpleNamespace

from sgl_jax.entrypoints.openai.serving import OpenAIServing
from sgl_jax.server_args import ServerArgs
from sgl_jax.testing.tokenizer import write_tiny_tokenizer


def test_chat_logprobs_bytes_are_the_tokens_own_bytes(tmp_path):
    tokenizer = write_tiny_tokenizer(tmp_path)
    engine = SimpleNamespace(tokenizer=tokenizer, context_length=64)
    serving = OpenAIServing(engine, ServerArgs().http, chat_template=None)
    ids = tokenizer("日本 😀", add_special_tokens=False).input_ids
    meta = {"output_token_logprobs": [(-0.5, i) for i in ids],
            "output_top_logprobs": [[(-0.5, i)] for i in ids]}
    content = serving._chat_logprobs(meta)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == "日本 😀".encode()
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]
