"""Chat templates: built-in names against the templates transformers renders for the same
conversation, files, clear errors, and tools: offered to a template that lists them, or
described in the system message; past calls and tool results written by the template or in
the parser's format."""

import json

import pytest

from sgl_jax.testing.tokenizer import IM_START, write_tiny_tokenizer
from sgl_jax.tokenizer.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    ChatTemplateError,
    resolve_chat_template,
)
from sgl_jax.tokenizer.tool_calls import tool_call_format

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


def test_continue_final_message_leaves_the_last_message_open(tokenizer):
    started = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    text = ChatTemplate(tokenizer).render(started, continue_final_message=True)
    closed = ChatTemplate(tokenizer).render(started, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\nThe capital is")
    assert closed.startswith(text) and closed != text  # the turn's end is all that is cut


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


# ---------------------------------------------------------------------- tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
]
PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
RESPONSES = "<tool_response>\n20 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"

# Qwen2.5's template in miniature: tools in a system turn, calls read through
# `tool_call.function` with `arguments | tojson`, each tool result a user turn.
QWEN25_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": '"
    " + tool_call.arguments | tojson + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_tool_aware_template_gets_the_tools_and_calls_as_they_are(tokenizer):
    template = ChatTemplate(tokenizer, QWEN25_STYLE)
    assert template.renders_tools and template.renders_tool_calls
    assert template.render(TOOL_TURNS, tools=[WEATHER]) == (
        f"<|im_start|>system\n<tools>\n{json.dumps(WEATHER)}\n</tools><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        f"<|im_start|>assistant\n{PARIS_CALL}\n{ROME_CALL}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n20 C\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n25 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_template_without_tools_is_told_about_them_in_the_system_message(tokenizer):
    template = ChatTemplate(tokenizer)  # the tiny tokenizer's plain ChatML template
    assert not template.renders_tools and not template.renders_tool_calls
    instructions = tool_call_format("qwen25").instructions([WEATHER])
    assert template.render([{"role": "system", "content": "Be brief."}, *TOOL_TURNS],
                           tools=[WEATHER]) == (
        f"<|im_start|>system\nBe brief.\n\n{instructions}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        f"<|im_start|>assistant\n{PARIS_CALL}\n{ROME_CALL}<|im_end|>\n"
        f"<|im_start|>user\n{RESPONSES}<|im_end|>\n"
        "<|im_start|>assistant\n")
    llama = tool_call_format("llama3")
    text = template.render(TOOL_TURNS, tools=[WEATHER],
                           tool_format=template.choose_tool_format("llama3"))
    assert text.startswith(f"<|im_start|>system\n{llama.instructions([WEATHER])}<|im_end|>\n")
    assert ('<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_weather", "parameters": {"city": "Rome"}}<|im_end|>') in text
    # No tools offered (tool_choice "none"): past calls are still written, nothing is added.
    assert template.render(TOOL_TURNS).startswith("<|im_start|>user\n")


def test_builtin_templates_write_calls_and_results_in_their_parsers_format(tokenizer):
    chatml = ChatTemplate(tokenizer, BUILTIN_TEMPLATES["chatml"])
    assert chatml.renders_tool_calls and not chatml.renders_tools
    assert chatml.render(TOOL_TURNS) == (
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        f"<|im_start|>assistant\n{PARIS_CALL}\n{ROME_CALL}<|im_end|>\n"
        f"<|im_start|>user\n{RESPONSES}<|im_end|>\n"
        "<|im_start|>assistant\n")
    with_text = [TOOL_TURNS[0], {**TOOL_TURNS[1], "content": "Checking."}]
    assert f"<|im_start|>assistant\nChecking.\n{PARIS_CALL}\n" in chatml.render(with_text)
    llama = ChatTemplate(tokenizer, BUILTIN_TEMPLATES["llama-3-instruct"]).render(TOOL_TURNS)
    assert llama.endswith(
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": '
        '{"city": "Rome"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n20 C<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\n25 C<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # Built-ins do not list tools themselves: the system message does.
    system = chatml.render(TOOL_TURNS[:1], tools=[WEATHER]).split("<|im_start|>user")[0]
    assert system.startswith("<|im_start|>system\n") and json.dumps(WEATHER) in system


def test_the_call_format_comes_from_the_flag_or_the_template(tokenizer):
    def chosen(template, parser=None):
        choice = ChatTemplate(tokenizer, template).choose_tool_format(parser)
        return choice.format.name, choice.source, choice.in_template

    assert chosen(QWEN25_STYLE) == ("qwen25", "chat template", True)
    assert chosen(BUILTIN_TEMPLATES["llama-3-instruct"]) == ("llama3", "chat template", False)
    assert chosen(BUILTIN_TEMPLATES["chatml"]) == ("qwen25", "chat template", False)
    assert chosen(None) == ("qwen25", "built-in", False)  # the tiny tokenizer's ChatML
    # A parser that is not the template's own format: the system message teaches it.
    assert chosen(QWEN25_STYLE, "llama3") == ("llama3", "--tool-call-parser", False)
    assert chosen(QWEN25_STYLE, "hermes") == ("qwen25", "--tool-call-parser", True)
    # A template that shows tools in a format the server does not know: without a parser
    # the built-in format is taught; with one, the template is trusted to teach it.
    unknown = "{%- if tools %}{{ tools | tojson }}{%- endif %}" + BUILTIN_TEMPLATES["chatml"][
        BUILTIN_TEMPLATES["chatml"].index("{%- if add_generation_prompt"):]
    assert chosen(unknown) == ("qwen25", "built-in", False)
    assert chosen(unknown, "llama3") == ("llama3", "--tool-call-parser", True)
