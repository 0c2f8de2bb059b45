"""NGRAM (model-free drafting from the text) through the Engine: greedy output equals plain
decoding token for token (a chain and a tree budget, page sizes 1 and 16, the loop one step
ahead and not, a hybrid Qwen3-Next target, retraction, a grammar), a request asked again
drafts from the answer it gave before and accepts long runs of it, text with nothing to
repeat costs no accepted tokens, and every page comes back (aborts included)."""

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.server_args import ServerArgs
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.engines import walk_away_mid_run

BASE = dict(dtype="float32", precompile_token_paddings=[16, 64, 256],
            precompile_bs_paddings=[1, 8], max_prefill_tokens=256, chunked_prefill_size=48,
            skip_server_warmup=True)
CHAIN = dict(speculative_num_steps=4, speculative_num_draft_tokens=5)
TREE = dict(speculative_num_steps=3, speculative_num_draft_tokens=8)
LENGTHS = [3, 70, 12, 130, 5, 40, 21, 9]
MAX_NEW = [17, 9, 24, 6, 30, 12, 1, 20]


def greedy(n, **extra):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("ngram")
    return {preset: write_tiny_checkpoint(root / preset, preset)
            for preset in ("llama", "qwen3_next")}


CONSTRAINED = [7, 8, 9, 10]  # a prompt whose answer a regular expression constrains
REGEX = "[ab]{3,12}"


@pytest.fixture(scope="module")
def references(targets):
    """Plain decoding's greedy output ids per preset; "constrained": the llama target's
    answer to CONSTRAINED under REGEX."""
    out = {}
    for preset, path in targets.items():
        with Engine(model_path=str(path), page_size=16, **BASE) as engine:
            batch = engine.generate(input_ids=prompts(), sampling_params=[greedy(n)
                                                                          for n in MAX_NEW])
            out[preset] = [o["output_ids"] for o in batch]
            if preset == "llama":
                out["constrained"] = engine.generate(
                    input_ids=CONSTRAINED, sampling_params=greedy(20, regex=REGEX))["output_ids"]
    return out


def pages_all_free(engine) -> bool:
    return engine.flush_cache() and engine.usage().all_pages_free


@pytest.mark.parametrize("preset, shape, page_size, overlap", [
    ("llama", CHAIN, 16, True),
    ("llama", TREE, 16, False),
    ("qwen3_next", TREE, 16, True),
])
def test_greedy_ngram_equals_plain_and_drafts_a_repeated_answer(targets, references, preset,
                                                                 shape, page_size, overlap):
    with Engine(model_path=str(targets[preset]), speculative_algorithm="NGRAM",
                page_size=page_size, disable_overlap_schedule=not overlap,
                **shape, **BASE) as engine:
        params = [greedy(n) for n in MAX_NEW]
        first = engine.generate(input_ids=prompts(), sampling_params=params)
        assert [o["output_ids"] for o in first] == references[preset]
        # The same questions again: each answer drafts from the one given before.
        again = engine.generate(input_ids=prompts(), sampling_params=params)
        assert [o["output_ids"] for o in again] == references[preset]
        long_answers = [o for o, n in zip(again, MAX_NEW, strict=True) if n >= 12]
        assert all(o["meta_info"]["spec_accept_length"] > 2 for o in long_answers), \
            [o["meta_info"]["spec_accept_length"] for o in long_answers]
        info = engine.get_server_info()
        assert info["spec_accepted_tokens"] > 0
        assert pages_all_free(engine)
        if preset == "qwen3_next":
            assert info["state_slots_in_use"] == 0


def test_retraction_grammar_and_aborts(targets, references):
    """Page size 1 and a pool too small for the batch (requests are retracted and run again),
    a regex-constrained request among them (its trees masked on the host): twice the same
    requests give plain decoding's outputs, the second time drafting from the first's
    answers; aborts mid-run and retractions give every page back."""
    with Engine(model_path=str(targets["llama"]), speculative_algorithm="NGRAM", page_size=1,
                max_total_tokens=256, **TREE, **BASE) as engine:
        params = [greedy(n) for n in MAX_NEW] + [greedy(20, regex=REGEX)]
        for _ in range(2):
            out = engine.generate(input_ids=[*prompts(), CONSTRAINED], sampling_params=params)
            assert [o["output_ids"] for o in out] == [*references["llama"],
                                                      references["constrained"]]
        info = engine.get_server_info()
        assert info["num_retractions"] > 0 and info["spec_accepted_tokens"] > 0
        assert info["spec_masked_rounds"] > 0
        walk_away_mid_run(engine, [prompts()[i] for i in (0, 2, 4)])  # 200 new tokens fit
        assert pages_all_free(engine)


def test_text_with_nothing_to_repeat_accepts_nothing(targets, references):
    """Fresh random prompts whose answers the engine has not seen: the tiny target's output
    does not repeat its prompt, so no draft token is accepted, and outputs stay exact."""
    with Engine(model_path=str(targets["llama"]), speculative_algorithm="NGRAM",
                page_size=16, **CHAIN, **BASE) as engine:
        out = engine.generate(input_ids=prompts(), sampling_params=[greedy(n)
                                                                    for n in MAX_NEW])
        assert [o["output_ids"] for o in out] == references["llama"]
        assert engine.get_server_info()["spec_accepted_tokens"] == 0
        # A request with nothing to generate never runs; none stays indexed.
        engine.generate(input_ids=[prompts()[0]], sampling_params=[{"max_new_tokens": 0}])
        assert len(engine.runtime.scheduler.decoding.proposer.index) == 0


def test_ngram_flags_are_checked_at_start_up(targets):
    path = str(targets["llama"])
    args = ServerArgs(model_path=path, speculative_algorithm="ngram")
    spec = args.speculative
    assert (spec.algorithm, spec.num_steps, spec.num_draft_tokens) == ("NGRAM", 7, 8)
    assert (spec.ngram.min_match, spec.ngram.max_match) == (1, 12)
    with pytest.raises(ValueError, match="takes no --speculative-draft-model-path"):
        ServerArgs(model_path=path, speculative_algorithm="NGRAM",
                   speculative_draft_model_path=path)
    with pytest.raises(ValueError, match="--speculative-ngram-max-match-window-size"):
        ServerArgs(model_path=path, speculative_algorithm="NGRAM",
                   speculative_ngram_max_match_window_size=0)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens must be in"):
        ServerArgs(model_path=path, speculative_algorithm="NGRAM",
                   speculative_num_draft_tokens=1000)
