"""Grammars and logit_bias in the Engine, on a tiny random model that would never write the
constrained text by itself: greedy and sampled outputs match their regex or JSON schema
(checked with `re` and `jsonschema`), speculative decoding with a draft that agrees with the
unconstrained target gives exactly the tokens of plain decoding, a grammar's dead end finishes
the request with `grammar_error` and the engine goes on, and bad input is a ValueError that
names the problem."""

import json
import re

import jsonschema
import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.grammar import GrammarCompiler, fill_bitmasks, fill_tree_bitmasks
from sgl_jax.model_executor.model_runner import decode_columns
from sgl_jax.sampling_params import SamplingParams
from sgl_jax.scheduler.req import Req
from sgl_jax.scheduler.slot_table import SlotTable
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.tokenizer import ENDOFTEXT_ID, TINY_VOCAB_SIZE, write_tiny_tokenizer
from sgl_jax.tokenizer.detokenizer import IncrementalDetokenizer

BASE = dict(dtype="float32", precompile_token_paddings=[16, 64], precompile_bs_paddings=[1, 4],
            max_prefill_tokens=64, context_length=256, page_size=16, skip_server_warmup=True)
# The target as its own draft: every unconstrained draft token is the target's argmax, so a
# round that ignored the grammar (or the bias) below the root would commit different tokens.
SELF_DRAFT = dict(speculative_algorithm="STANDALONE", speculative_num_steps=3,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=4)
SELF_DRAFT_TREE = {**SELF_DRAFT, "speculative_num_steps": 2, "speculative_eagle_topk": 2,
                   "speculative_num_draft_tokens": 5}
REGEXES = [r"\d{4}-\d{2}-\d{2}", r"(red|green|blue) (cat|dog)s?", r"[a-z]{3,8}@[a-z]{3,6}\.com"]
SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"enum": ["alpha", "beta"]},
                         "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("constrained") / "llama", "llama"))


@pytest.fixture(scope="module")
def engines(target):
    with Engine(model_path=target, **BASE) as plain, Engine(
            model_path=target, speculative_draft_model_path=target, **SELF_DRAFT,
            **BASE) as spec:
        yield plain, spec


def prompts(count):
    rng = np.random.default_rng(7)
    return [rng.integers(3, 500, n).tolist() for n in (9, 23, 14, 31)[:count]]


def constrained(temperature=0.0, **grammar):
    return {"temperature": temperature, "max_new_tokens": 48, "seed": 5, **grammar}


def run(engine, params):
    return engine.generate(input_ids=prompts(len(params)), sampling_params=params)


def test_regex_outputs_match_and_speculation_commits_the_same_tokens(engines):
    plain, spec = engines
    params = [constrained(regex=r) for r in REGEXES] + [constrained(1.0, regex=REGEXES[2])]
    expected = run(plain, params)
    for out, p in zip(expected, params, strict=True):
        assert re.fullmatch(p["regex"], out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}
    got = run(spec, params)
    assert [o["output_ids"] for o in got[:3]] == [o["output_ids"] for o in expected[:3]]
    assert re.fullmatch(REGEXES[2], got[3]["text"])  # sampled: exact in law, not in tokens
    assert spec.get_server_info()["spec_masked_rounds"] > 0


def test_json_schema_outputs_validate_and_speculation_commits_the_same_tokens(engines):
    plain, spec = engines
    params = [constrained(json_schema=json.dumps(SCHEMA)), constrained(1.0, json_schema=SCHEMA)]
    expected = run(plain, params)
    for out in expected:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert run(spec, params[:1])[0]["output_ids"] == expected[0]["output_ids"]


def test_a_tree_masked_node_by_node_commits_the_tokens_of_plain_decoding(target, engines):
    """Trees branch: each node's mask must follow its own path, not its neighbour's."""
    plain, _ = engines
    params = [constrained(regex=REGEXES[1]), constrained(json_schema=json.dumps(SCHEMA))]
    expected = run(plain, params)
    with Engine(model_path=target, speculative_draft_model_path=target, **SELF_DRAFT_TREE,
                **BASE) as tree:
        assert [o["output_ids"] for o in run(tree, params)] == \
            [o["output_ids"] for o in expected]
        assert tree.get_server_info()["spec_masked_rounds"] > 0


def test_tree_bitmasks_equal_a_fresh_matcher_walked_down_each_path(tmp_path):
    tokenizer = write_tiny_tokenizer(tmp_path)
    grammars = GrammarCompiler(tokenizer, TINY_VOCAB_SIZE, [ENDOFTEXT_ID])
    grammar = ("regex", "[ab][cd]x")
    matcher = grammars.constraint(*grammar)
    a, b, c, d, x = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcdx")
    # root -> a -> c, root -> b, root -> x (forbidden) -> c
    tokens = np.array([0, a, b, x, c, c], np.int32)
    parents = np.array([-1, 0, 0, 0, 1, 3], np.int32)
    words = -(-TINY_VOCAB_SIZE // 32)
    got = np.zeros((6, words), np.int32)
    fill_tree_bitmasks(matcher, tokens, parents, got)
    for node, path in enumerate([[], [a], [b], None, [a, c], None]):
        if path is None:  # the grammar forbids the path: every id, never reached
            assert (got[node] == -1).all()
            continue
        fresh = grammars.constraint(*grammar)
        assert all(fresh.consume_token(t) for t in path)
        expected = np.zeros((1, words), np.int32)
        fill_bitmasks([(fresh, 0)], expected)
        assert (got[node] == expected[0]).all(), node
    after = np.zeros((1, words), np.int32)
    fill_bitmasks([(matcher, 0)], after)  # the matcher was rolled back to the root
    assert (after[0] == got[0]).all()


def test_a_model_that_loves_a_digit_still_ends_its_json(engines):
    """A bias toward '1' would write the number forever; the number bounds end it (19
    integer digits), the JSON completes, and speculation commits the same tokens."""
    plain, spec = engines
    one = plain.tokenizer.encode("1", add_special_tokens=False)[0]
    schema = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"],
              "additionalProperties": False}
    params = [{**constrained(json_schema=json.dumps(schema)), "logit_bias": {str(one): 30.0},
               "max_new_tokens": 64}]
    out = run(plain, params)[0]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}, out["text"]
    number = json.loads(out["text"])["n"]
    assert out["text"].startswith('{"n": ' + "1" * 19) and number >= 1e18
    assert run(spec, params)[0]["output_ids"] == out["output_ids"]


def test_ebnf_output_is_in_the_language(engines):
    plain, _ = engines
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    out = run(plain, [constrained(ebnf=grammar)])[0]
    assert re.fullmatch(r"\((\d|x)(,(\d|x))*\)", out["text"]), out["text"]


def test_logit_bias_moves_greedy_choices_and_speculation_follows(engines):
    plain, spec = engines
    free = run(plain, [{"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}])[0]
    first = free["output_ids"][0]
    params = [{"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, **bias}
              for bias in ({"logit_bias": {str(first): -100}}, {"logit_bias": {"77": 100}},
                           {"logit_bias": {str(t): -5.0 for t in free["output_ids"][:6]}})]
    biased = run(plain, params)
    assert biased[0]["output_ids"][0] != first
    assert biased[1]["output_ids"] == [77] * 12
    assert biased[2]["output_ids"] != free["output_ids"]
    assert [o["output_ids"] for o in run(spec, params)] == [o["output_ids"] for o in biased]


def test_a_completed_grammar_ends_the_output_even_before_min_new_tokens(engines):
    plain, _ = engines
    out = run(plain, [{**constrained(regex="yes|no"), "min_new_tokens": 8}])[0]
    assert out["text"] in ("yes", "no")
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}


def test_a_dead_end_allows_only_eos_and_finishes_with_grammar_error(tmp_path):
    tokenizer = write_tiny_tokenizer(tmp_path)
    grammars = GrammarCompiler(tokenizer, TINY_VOCAB_SIZE, [ENDOFTEXT_ID])
    params = SamplingParams(regex="yes", max_new_tokens=8)
    req = Req("r", [5], params, 0, frozenset([ENDOFTEXT_ID]), 64,
              IncrementalDetokenizer(tokenizer, prompt_ids=[5]),
              grammar=grammars.constraint(*params.grammar), slot=0)
    no = tokenizer.encode("no", add_special_tokens=False)[0]
    assert not req.grammar.consume_token(no)  # the matcher is now at a dead end
    table = SlotTable(1, decode_columns(4, 16), TINY_VOCAB_SIZE)
    table.join(req)
    sampling, _ = table.sampling_rows([req], np.array([0], np.int32), np.array([0], np.int32), 1)
    (row,) = sampling.allowed.view(np.uint32)
    allowed = [i for i in range(TINY_VOCAB_SIZE) if row[i // 32] >> (i % 32) & 1]
    assert allowed == [ENDOFTEXT_ID]
    req.append_tokens([ENDOFTEXT_ID])
    assert req.finish_reason["type"] == "grammar_error"
    assert "dead end" in req.finish_reason["message"]


def test_the_engine_goes_on_after_a_bad_grammar(engines):
    plain, _ = engines
    with pytest.raises(ValueError):
        plain.generate(input_ids=prompts(1)[0], sampling_params={"regex": "(unclosed"})
    assert re.fullmatch(REGEXES[0], run(plain, [constrained(regex=REGEXES[0])])[0]["text"])


@pytest.mark.parametrize("params, message", [
    ({"regex": "[a-"}, "invalid regex"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": '{"type": "nonsense"}'}, "invalid json_schema"),
    ({"ebnf": "root ::= missing"}, "invalid ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "one at a time"),
    ({"logit_bias": {"600": 1.0}}, "outside the vocabulary"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "at most 300"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"),
])
def test_bad_grammars_and_biases_are_named(engines, params, message):
    plain, _ = engines
    with pytest.raises(ValueError, match=message):
        plain.generate(input_ids=prompts(1)[0], sampling_params=params)
