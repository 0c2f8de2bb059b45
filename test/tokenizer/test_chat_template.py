"""Chat templates: built-in names against the templates transformers renders for the same
conversation, files, and clear errors."""

import pytest

from sgl_jax.testing.tokenizer import IM_START, write_tiny_tokenizer
from sgl_jax.tokenizer.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    ChatTemplateError,
    resolve_chat_template,
)

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_the_tokenizers_own_template_is_the_default(tokenizer):
    template = ChatTemplate(tokenizer, resolve_chat_template(None))
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                             add_generation_prompt=True)
    assert template.render(MESSAGES) == expected
    assert expected.startswith(IM_START + "system\nBe brief.")


def test_qwen3_no_thinking_matches_qwen3_with_thinking_off(tokenizer):
    # The tiny tokenizer carries Qwen3's convention: enable_thinking=False adds an empty block.
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    named = ChatTemplate(tokenizer, resolve_chat_template("qwen3-instruct-no-thinking"))
    assert named.render(MESSAGES) == expected
    assert expected.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_kwargs_reach_the_template(tokenizer):
    template = ChatTemplate(tokenizer)
    off = template.render(MESSAGES, template_kwargs={"enable_thinking": False})
    on = template.render(MESSAGES, template_kwargs={"enable_thinking": True})
    assert off == on + "<think>\n\n</think>\n\n"
    with pytest.raises(ChatTemplateError, match="may not set"):
        template.render(MESSAGES, template_kwargs={"tokenize": True})


def test_chatml_and_llama3_render_each_turn(tokenizer):
    chatml = ChatTemplate(tokenizer, BUILTIN_TEMPLATES["chatml"]).render(MESSAGES)
    assert chatml == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                             for m in MESSAGES) + "<|im_start|>assistant\n"
    llama = ChatTemplate(tokenizer, BUILTIN_TEMPLATES["llama-3-instruct"]).render(MESSAGES)
    turns = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}"
                    "<|eot_id|>" for m in MESSAGES)
    bos = tokenizer.bos_token or ""
    assert llama == bos + turns + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_a_template_file(tokenizer, tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    template = ChatTemplate(tokenizer, resolve_chat_template(str(path)))
    assert template.render(MESSAGES[1:2]) == "[user] Hello there\n[assistant] "
    ids = template.encode(MESSAGES[1:2])
    assert tokenizer.decode(ids) == "[user] Hello there\n[assistant] "


def test_unknown_names_and_missing_templates_are_clear_errors(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a built-in name"):
        resolve_chat_template("no-such-template")
    bare = write_tiny_tokenizer(tmp_path)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate(bare).render(MESSAGES)
    strict = ChatTemplate(tokenizer, "{{ raise_exception('only one turn') }}")
    with pytest.raises(ChatTemplateError, match="only one turn"):
        strict.render(MESSAGES)


def test_check_renders_a_sample_so_broken_templates_fail_early(tokenizer):
    ChatTemplate(tokenizer).check()
    with pytest.raises(ChatTemplateError, match="could not render"):
        ChatTemplate(tokenizer, "{{ messages[0]['content'] | no_such_filter }}").check()
