"""benchmark/bench_speculative.py end to end on a tiny random target: rows for every shape and
batch size, acceptance figures consistent with each other, JSON and PNG written; the prompt
builders of its code-edits, edits-and-chat and quote-turns datasets, and its NGRAM wiring (no
model run)."""

from __future__ import annotations

import importlib
import inspect
import json
import re
import textwrap
from collections import Counter

import pytest

from sgl_jax.testing.benchmarks import load_benchmark


def load_bench():
    return load_benchmark("bench_speculative")


def test_bench_speculative_reports_every_shape_and_batch_size(tmp_path, capsys):
    bench = load_bench()
    out_json, out_png = tmp_path / "spec.json", tmp_path / "spec.png"
    code = bench.main(["--hidden-size", "64", "--num-layers", "2", "--batch-sizes", "1,2",
                       "--input-len", "16", "--output-len", "12", "--draft", "noisy-copy",
                       "--output-json", str(out_json), "--output-png", str(out_png)])
    assert code == 0
    rows = json.loads(out_json.read_text())
    assert [(r["shape"], r["batch_size"]) for r in rows] == [
        ("chain", 1), ("chain", 2), ("tree", 1), ("tree", 2)]
    for row in rows:
        steps = 5 if row["shape"] == "chain" else 3
        draft_tokens = 6 if row["shape"] == "chain" else 8
        assert len(row["position_rates"]) == steps
        assert 1.0 <= row["accept_length"] <= steps + 1
        assert abs(row["accept_rate"] - row["accept_length"] / draft_tokens) < 1e-9
        assert abs(row["speedup"] - row["speculative_tok_s"] / row["baseline_tok_s"]) < 1e-9
        # rates of later positions can only be lower: a position needs all before it
        assert row["position_rates"] == sorted(row["position_rates"], reverse=True)
        assert abs(sum(row["position_rates"]) + 1 - row["accept_length"]) < 1e-9
        assert row["num_prompts"] == row["batch_size"] and row["outputs_differing"] == 0
    assert any(row["accept_length"] > 1.5 for row in rows)  # the near copy is accepted
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "baseline tok/s" in printed and printed.count("\nrandom      chain") == 2
    replotted = tmp_path / "again.png"
    assert bench.main(["--replot", str(out_json), str(out_json), "--output-png",
                       str(replotted)]) == 0
    assert replotted.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_speculative_reports_the_adaptive_policy_rounds(tmp_path):
    """The adaptive row with per-request lengths: the policy's shapes include the packed
    rounds of its 3-step chain and of its tree."""
    out_json = tmp_path / "adaptive.json"
    assert load_bench().main(["--hidden-size", "64", "--num-layers", "4", "--batch-sizes", "2",
                              "--input-len", "16", "--output-len", "12", "--shapes",
                              "per-request", "--repeats", "2", "--output-json",
                              str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())
    assert row["shape"] == "per-request" and row["outputs_differing"] == 0
    assert set(row["rounds_by_shape"]) == {"plain", "1/1/2", "3/1/4", "3/1/4:2", "3/4/8",
                                           "3/4/8:2", "3/4/8:4"}
    assert sum(row["rounds_by_shape"].values()) >= 11  # 12 tokens, at most one per plain round
    # the batch's two requests in each of the two timed passes (the warm-up not counted),
    # every output compared with plain decoding's
    assert sum(row["finished_requests"].values()) == 4
    # each engine's scheduler over its own timed turns: a prefill row per request
    for engine in ("plain", "speculative"):
        assert row["phases"][engine]["prefill"]["rows"] == 4
        assert row["phases"][engine]["decode"]["steps"] >= 1
        assert row["phases"][engine]["compilations"] == 0  # warm-up built every program
    assert len(row["repeat_speedups"]) == 2 and all(x > 0 for x in row["repeat_speedups"])
    assert set(row["round_ms"]) == set(row["rounds_by_shape"])  # the policy's bucket-2 costs
    assert all(ms > 0 for ms in row["round_ms"].values())


def test_random_word_requests_draw_whole_words_from_the_vocabulary(tmp_path):
    from sgl_jax.testing.tokenizer import write_tiny_tokenizer

    tokenizer = write_tiny_tokenizer(tmp_path)
    requests = load_bench().random_word_requests(tokenizer, 3, seed=0)
    assert len(requests) == 3 and len(set(requests)) == 3
    words = requests[0].split(": ", 1)[1].split(", ")
    assert len(words) == 40 and all(w.isalpha() and len(w) >= 4 for w in words)


# --------------------------------------------------------------------------- code-edits

CHANGES = {
    "parameter": r"rename the parameter `(\w+)` to `(\w+)`",
    "local": r"rename the local variable `(\w+)` to `(\w+)`",
    "docstring": r'add "This copy was edited for review\." '
                 r"(to it as a one-line docstring|as the last line of its docstring)",
    "default": r"change the default value of `(\w+)` from `(.+)` to `(.+)`",
}


def change_kind(edit) -> tuple[str, re.Match]:
    (found,) = [(kind, m) for kind, pattern in CHANGES.items()
                if (m := re.fullmatch(pattern, edit.change))]
    return found


def without_trailing_comments(source: str) -> str:
    lines = source.splitlines(keepends=True)
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("#")):
        lines.pop()
    return "".join(lines)


def test_code_edits_hold_the_whole_function_and_name_one_change():
    bench = load_bench()
    edits = bench.code_edits()
    assert edits == bench.code_edits() and len(edits) >= 100
    assert len({(e.module, e.qualname) for e in edits}) == len(edits)
    kinds, checked = Counter(), 0
    for edit in edits:
        assert 15 <= len(edit.source.splitlines()) <= 60
        assert f"```python\n{edit.source}```" in edit.request
        assert edit.request.count(edit.change) == 1 and "output the whole" in edit.request
        kind, match = change_kind(edit)
        kinds[kind] += 1
        if kind in ("parameter", "local"):
            old, new = match.groups()
            assert re.search(rf"\b{old}\b", edit.source) and new not in edit.source
        elif kind == "default":
            name, old, new = match.groups()
            assert re.search(rf"\b{name}\s*(:[^=]+)?=\s*{re.escape(old)}", edit.source)
            assert old != new
        obj = importlib.import_module(edit.module)
        for part in edit.qualname.split("."):
            obj = getattr(obj, part, None)
        if inspect.isfunction(obj) and obj.__qualname__ == edit.qualname:
            # the module's own text of the function, as inspect reads it (which also takes the
            # comment lines after the last statement)
            assert edit.source == without_trailing_comments(
                textwrap.dedent(inspect.getsource(obj)))
            checked += 1
    assert set(kinds) == set(CHANGES) and checked > len(edits) // 2


def test_edits_and_chat_alternate_a_code_edit_with_an_mt_bench_question(tmp_path):
    from sgl_jax import datasets
    from sgl_jax.testing.tokenizer import write_tiny_tokenizer
    from sgl_jax.tokenizer.chat_template import ChatTemplate

    try:
        questions = [q.turns[0] for q in datasets.load_mt_bench()]
    except FileNotFoundError as e:
        pytest.skip(f"not installed: {e}")
    bench = load_bench()
    args = bench.parse_args(["--dataset", "edits-and-chat", "--num-prompts", "7",
                             "--max-prompt-tokens", "100000"])
    convs = bench.conversations(args, None, ChatTemplate(write_tiny_tokenizer(tmp_path)))
    requests = [c[0]["content"] for c in convs]
    assert len(convs) == 7 and all(len(c) == 1 and c[0]["role"] == "user" for c in convs)
    assert requests[0::2] == [e.request for e in bench.code_edits()[:4]]
    assert requests[1::2] == questions[:3]


def test_edit_change_picks_among_what_the_function_allows():
    bench = load_bench()
    docstring_only = "def f():\n    return 1\n"
    assert {bench.edit_change(f"k{i}", docstring_only) for i in range(20)} == {
        'add "This copy was edited for review." to it as a one-line docstring'}
    source = 'def g(self, a, *, b=2):\n    """Doc."""\n    c = a + b\n    return c\n'
    assert {bench.edit_change(f"k{i}", source) for i in range(40)} == {
        "rename the parameter `a` to `a_arg`",
        "rename the local variable `c` to `c_var`",
        'add "This copy was edited for review." as the last line of its docstring',
        "change the default value of `b` from `2` to `3`"}
    assert bench.edit_change("k1", source) == bench.edit_change("k1", source)


# --------------------------------------------------------------------------- quote-turns


def words(messages: list[dict]) -> int:
    return sum(len(m["content"].split()) for m in messages)


def reply(i: int, n: int) -> str:
    return " ".join(["Introduction"] + [f"w{i}_{j}" for j in range(n - 1)])


def test_quote_turns_repeat_an_earlier_reply_within_the_budget():
    bench = load_bench()
    exchanges = [(f"question {i}", reply(i, 50)) for i in range(12)]
    exchanges[1] = ("short", reply(1, 10))  # too little to quote
    exchanges[2] = ("long " * 200, reply(2, 50))  # over the budget
    convs = bench.quote_turn_conversations(exchanges, words, 6, max_tokens=100)
    assert convs == bench.quote_turn_conversations(iter(exchanges), words, 6, max_tokens=100)
    assert [c[0]["content"] for c in convs] == [f"question {i}" for i in (0, 3, 4, 5, 6, 7)]
    for conv, i in zip(convs, (0, 3, 4, 5, 6, 7), strict=True):
        assert [m["role"] for m in conv] == ["user", "assistant", "user"]
        assert conv[1]["content"] == reply(i, 50) and words(conv) <= 100
        request = conv[2]["content"]
        assert re.match(r"(Repeat|Quote) .*your previous answer", request)
    # each request in turn; the topic one names the reply's longest word
    assert [c[2]["content"] for c in convs[:4]] == [
        bench.QUOTE_REQUESTS[0], bench.QUOTE_REQUESTS[1],
        'Quote the part of your previous answer about "Introduction", word for word.',
        bench.QUOTE_REQUESTS[3]]
    assert bench.quote_request("no long word here, only w4_longer1", 2) == \
        bench.QUOTE_REQUESTS[0]


def test_quote_turns_from_the_installed_sharegpt_fit_the_tokenized_budget(tmp_path):
    from sgl_jax import datasets
    from sgl_jax.testing.tokenizer import write_tiny_tokenizer
    from sgl_jax.tokenizer.chat_template import ChatTemplate

    try:
        path = datasets.SHAREGPT.path()
    except FileNotFoundError as e:
        pytest.skip(f"not installed: {e}")
    template = ChatTemplate(write_tiny_tokenizer(tmp_path))
    seen = []

    def exchanges():
        for pair in datasets.iter_sharegpt_exchanges(path):  # stops after the first few
            seen.append(pair)
            yield pair

    def measure(messages):
        return len(template.encode(messages))

    convs = load_bench().quote_turn_conversations(exchanges(), measure, 8, max_tokens=1200)
    assert len(convs) == 8 and len(seen) < 1000
    for conv in convs:
        assert (conv[0]["content"], conv[1]["content"]) in seen
        assert conv[-1]["role"] == "user" and re.match(r"(Repeat|Quote) ", conv[-1]["content"])
        assert measure(conv) <= 1200


# --------------------------------------------------------------------------- NGRAM wiring


def test_ngram_loads_no_draft_and_has_its_own_shapes(tmp_path):
    bench = load_bench()
    args = bench.parse_args(["--algorithm", "NGRAM", "--model-path", str(tmp_path)])
    assert bench.build_models(args, tmp_path) == (str(tmp_path), None, "NGRAM")
    shapes = bench.shapes_for("NGRAM")
    assert [(s["speculative_num_steps"], s["speculative_eagle_topk"],
             s["speculative_num_draft_tokens"], s["speculative_adaptive"])
            for s in shapes.values()] == [(5, 1, 6, False), (6, 4, 12, False), (6, 4, 12, True),
                                          (6, 4, 12, True)]
    assert shapes["per-request"]["speculative_per_request_lengths"]
    assert bench.shapes_for("EAGLE3") is bench.SHAPES
    with pytest.raises(SystemExit, match="no draft model"):
        bench.build_models(bench.parse_args(["--algorithm", "NGRAM", "--model-path", "t",
                                             "--draft-model-path", "d"]), tmp_path)


def test_speculated_share_counts_every_round_but_plain():
    share = load_bench().speculated_share
    assert share({"plain": 1, "3/1/4": 1, "3/4/8": 2}) == 0.75
    assert share({"5/1/6": 4}) == 1.0 and share({"plain": 0, "5/1/6": 0}) is None


def test_num_steps_sets_every_shapes_depth_and_a_chains_tokens():
    """--num-steps 3 (a DFlash head with a block of 4): the chain verifies 4 tokens, the
    tree keeps its 16 nodes; without the flag the shapes are the drafter's own."""
    bench = load_bench()
    shapes = bench.with_depth(bench.shapes_for("DFLASH"), 3)
    assert [(s["speculative_num_steps"], s["speculative_eagle_topk"],
             s["speculative_num_draft_tokens"]) for s in shapes.values()] == [
        (3, 1, 4), (3, 3, 16), (3, 3, 16), (3, 3, 16)]
    assert bench.with_depth(bench.DFLASH_SHAPES, None) is bench.DFLASH_SHAPES


def test_serve_keeps_the_concurrency_and_the_prompts_order():
    """--concurrent's turn: never more than `in_flight` requests running, a new one started as
    soon as one finishes, outputs in the prompts' order; a wave when the turn fits."""
    import asyncio

    class CountingEngine:
        def __init__(self):
            self.running = self.most = 0
            self.waves = []

        async def async_generate(self, input_ids, sampling_params):
            self.running += 1
            self.most = max(self.most, self.running)
            await asyncio.sleep(0.001 * (input_ids[0] % 3))  # finishing out of order
            self.running -= 1
            return {"output_ids": input_ids[::-1]}

        def generate(self, input_ids, sampling_params):
            self.waves.append(len(input_ids))
            return [{"output_ids": p[::-1]} for p in input_ids]

    serve = load_bench().serve
    engine = CountingEngine()
    prompts = [[i, i + 100] for i in range(11)]
    outs = serve(engine, prompts, {}, in_flight=3)
    assert [o["output_ids"] for o in outs] == [p[::-1] for p in prompts]
    assert engine.most == 3 and engine.running == 0 and engine.waves == []
    assert [o["output_ids"] for o in serve(engine, prompts[:3], {}, 3)] == [
        p[::-1] for p in prompts[:3]]
    assert engine.waves == [3]
