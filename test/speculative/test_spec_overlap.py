"""Speculative rounds run a round ahead of their results, against the synchronous loop.

Each case runs the same requests on two speculative engines over the same tiny checkpoints,
one overlapped (the default) and one with `disable_overlap_schedule`: what each request emits
must be the same, token for token, and every KV page and state slot must come back. The
STANDALONE draft is a noisy copy of the target, so rounds accept runs of varying length
(the lengths the host learns a round late).
"""

import contextlib
import json

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.speculative.policy.shape_policy import PLAIN
from sgl_jax.testing import write_noisy_copy, write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft
from sgl_jax.testing.engines import every_stop_rule, printable_stop, walk_away_mid_run

# Two batch buckets: batches still change bucket as requests finish, at half the programs.
SMALL = dict(dtype="float32", page_size=4, precompile_token_paddings=[16, 64, 256],
             precompile_bs_paddings=[2, 8], max_prefill_tokens=256,
             skip_server_warmup=True)
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=3, speculative_num_draft_tokens=8)


def greedy(n, **extra):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


def random_prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def checkpoints(root, preset):
    target = write_tiny_checkpoint(root / preset, preset)
    config = json.loads((target / "config.json").read_text())
    return {"target": target, "eagle3": write_tiny_eagle3_draft(root / "eagle3", config),
            "noisy": write_noisy_copy(target, root / "noisy", relative_noise=0.03)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("llama"), "llama")


@contextlib.contextmanager
def engine_pair(paths, algorithm, draft, shape, **extra):
    """(overlapped, synchronous) speculative engines."""
    common = dict(model_path=str(paths["target"]), speculative_algorithm=algorithm,
                  speculative_draft_model_path=str(paths[draft]), **shape, **{**SMALL, **extra})
    with (Engine(**common) as overlapped,
          Engine(disable_overlap_schedule=True, **common) as sync):
        yield overlapped, sync


@pytest.fixture(scope="class", params=["chain", "tree"])
def engines(request, paths):
    """One engine pair per shape, closed when its class ends: every pair alive at once would
    hold tens of thousands of JIT code mappings in one process."""
    with engine_pair(paths, "STANDALONE", "noisy",
                     CHAIN if request.param == "chain" else TREE) as pair:
        yield pair


def all_returned(engine) -> bool:
    info = engine.get_server_info()
    return (engine.flush_cache() and engine.usage().all_pages_free
            and info.get("state_slots_in_use", 0) == 0)


def emitted(output):
    """What each request gave its caller: ids, text, why it ended; and its logprobs, each
    token's and the top ones', as (ids, values)."""
    outputs = output if isinstance(output, list) else [output]
    result = []
    for o in outputs:
        meta = o["meta_info"]
        tops = [pair for top in meta.get("output_top_logprobs") or [] for pair in top]
        logprobs = [*(meta.get("output_token_logprobs") or []), *tops]
        result.append(((o["output_ids"], o["text"], meta["finish_reason"],
                        [token for _, token in logprobs]), [value for value, _ in logprobs]))
    return result


def both(engines, **request):
    """Both engines emit the same tokens; log-probabilities agree to float32 rounding (a row
    that ran one round past its finish can put its batch in a larger bucket)."""
    overlapped, sync = (emitted(engine.generate(**request)) for engine in engines)
    assert [exact for exact, _ in overlapped] == [exact for exact, _ in sync]
    for (_, got), (_, want) in zip(overlapped, sync, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert all(all_returned(engine) for engine in engines)
    return [exact for exact, _ in overlapped]


class TestSharedEnginePairs:
    """Cases on the module's STANDALONE pair, chain and tree."""

    def test_a_round_is_dispatched_before_the_last_one_is_read(self, engines):
        for engine, ahead in zip(engines, (True, False), strict=True):
            events = []
            spec = engine.runtime.spec_runner
            launch = spec.round

            def logged_round(*args, launch=launch, events=events, **kwargs):
                events.append("launch")
                pending = launch(*args, **kwargs)
                read = pending.result
                pending.result = lambda: (events.append("read"), read())[1]
                return pending

            engine.runtime.call(lambda s, spec=spec, logged=logged_round: setattr(spec, "round",
                                                                                logged))
            try:
                engine.generate(input_ids=[5, 6, 7], sampling_params=greedy(20))
            finally:
                engine.runtime.call(lambda s, spec=spec: delattr(spec, "round"))
            assert (events[:3] == ["launch", "launch", "read"]) is ahead
            assert events.count("launch") == events.count("read") >= 3


    def test_greedy_batches_with_every_stop_rule(self, engines):
        prompts = random_prompts(0, [5, 70, 12, 130, 3, 40])  # 130: a chunked prefill
        ids = both(engines, input_ids=prompts[0], sampling_params=greedy(24))[0][0]
        text = both(engines, input_ids=[40, 41], sampling_params=greedy(20))[0][1]
        stop = printable_stop(text)
        params = every_stop_rule(ids, stop)  # the first ends inside an accepted run
        outputs = both(engines, input_ids=[prompts[0]] + prompts[1:-1] + [[40, 41]],
                       sampling_params=params)
        assert outputs[0][0] == ids[: ids.index(ids[5]) + 1]
        assert len(outputs[1][0]) == 9 and len(outputs[4][0]) == 1
        assert outputs[5][2] == {"type": "stop", "matched": stop}
        assert outputs[5][1] == text[: text.index(stop)]


    def test_seeded_sampling_and_logprobs(self, engines):
        sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 16,
                   "ignore_eos": True, "seed": 1234}
        params = [sampled, dict(sampled, seed=7, temperature=0.7), greedy(12)]
        both(engines, input_ids=random_prompts(1, [9, 30, 4]), sampling_params=params,
             return_logprob=True, top_logprobs_num=2)


    def test_grammar_constrained_requests(self, engines):
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        params = [greedy(40, json_schema=schema), greedy(30), greedy(40, regex="[ab]{3,12}")]
        both(engines, input_ids=random_prompts(2, [6, 11, 8]), sampling_params=params)


    def test_aborts_mid_run_return_every_page(self, engines):
        for engine in engines:
            walk_away_mid_run(engine, random_prompts(4, [20, 7, 33]))
            assert all_returned(engine)


def test_retraction_in_a_small_pool(paths):
    prompts = random_prompts(3, [30, 25, 40, 20, 35, 28])
    params = [greedy(24)] * len(prompts)
    with engine_pair(paths, "STANDALONE", "noisy", TREE, max_total_tokens=256) as pair:
        both(pair, input_ids=prompts, sampling_params=params)
        assert all(e.get_server_info()["num_retractions"] > 0 for e in pair)


def test_plain_streaks_and_catch_ups(paths):
    """EAGLE3 with the policy scripted to mix plain streaks (drafts left behind, then caught
    up, some at the catch-up's width) with speculative rounds. Without warm-up the menu is
    plain and the flags' shape, compiled when first used."""
    shape = dict(speculative_num_steps=3, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=6)
    results = []
    for overlap in (True, False):
        with Engine(model_path=str(paths["target"]), speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=str(paths["eagle3"]),
                    disable_overlap_schedule=not overlap, **shape, **SMALL) as engine:
            policy = engine.runtime.scheduler.decoding.policy
            assert engine.runtime.spec_runner.defers_draft  # plain rounds leave the draft behind
            script = iter(([PLAIN] * 3 + [engine.runtime.spec_runner.shape] * 2 + [PLAIN] * 10
                           + [engine.runtime.spec_runner.shape]) * 100)
            policy.choose = lambda records, bucket, script=script, **_: next(script)
            results.append(emitted(engine.generate(
                input_ids=random_prompts(5, [5, 30, 12, 50]),
                sampling_params=[greedy(n) for n in (40, 33, 48, 25)])))
            assert engine.get_server_info()["spec_rounds_by_shape"]["plain"] > 20
            assert all_returned(engine)
    assert results[0] == results[1]


def test_hybrid_target(tmp_path):
    """Qwen3-Next keeps a recurrent state per request: rounds that commit it a round ahead
    of the host give what the synchronous loop gives, and every state slot comes back."""
    paths = checkpoints(tmp_path, "qwen3_next")
    with engine_pair(paths, "EAGLE3", "eagle3", TREE, max_total_tokens=256) as pair:
        both(pair, input_ids=random_prompts(6, [30, 25, 40, 20, 35, 28]),
             sampling_params=[greedy(12)] * 6)
