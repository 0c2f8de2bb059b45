"""The adaptive policy in the Engine and the server: greedy output equals plain decoding
whatever shapes it picks, a draft that predicts everything keeps speculating, a draft that
predicts nothing falls back to plain rounds, a draft that plain rounds leave behind catches
up exactly, requests admitted without a draft skip its prefill, nothing compiles after
warm-up, and the choices show in /get_server_info and /metrics."""

import json
import re
import time

import httpx
import jax
import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.speculative.policy.shape_policy import PLAIN, SPECULATION_MARGIN
from sgl_jax.speculative.round.program import CATCH_UP_WIDTH
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import cached_draft_keys, write_tiny_eagle3_draft
from sgl_jax.testing.server import launch_server

BASE = dict(dtype="float32", precompile_token_paddings=[16, 64], precompile_bs_paddings=[4],
            max_prefill_tokens=64, context_length=256, page_size=16)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
MAX_NEW = [40, 33, 48, 25]


def greedy(n):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(3, 500, n).tolist() for n in (5, 30, 12, 50)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    target = write_tiny_checkpoint(root / "llama", "llama")
    config = json.loads((target / "config.json").read_text())
    return {"target": target, "self": target,
            "eagle3": write_tiny_eagle3_draft(root / "eagle3", config)}


@pytest.fixture(scope="module")
def reference(paths):
    with Engine(model_path=str(paths["target"]), skip_server_warmup=True, **BASE) as engine:
        return [o["output_ids"] for o in engine.generate(
            input_ids=prompts(), sampling_params=[greedy(n) for n in MAX_NEW])]


def built_programs(engine) -> int:
    """Compilations once warm-up and the background builder (the 64-token prefill bucket)
    are done: serving must add none."""
    assert engine.runtime.builder.wait_idle(timeout=600)
    return engine.get_server_info()["num_compilations"]


def run_adaptive(paths, algorithm, draft, relative_costs=None, observed=None):
    """Serve prompts() with an adaptive engine. `observed`, a list: each prefill's results
    come back SLOW_PREFILL_S late, and the seconds the policy is told of each round go in."""
    with Engine(model_path=str(paths["target"]), speculative_algorithm=algorithm,
                speculative_draft_model_path=str(paths[draft]), **TREE, **BASE) as engine:
        compiled = built_programs(engine)
        if observed is not None:
            slow_prefills(engine.runtime.scheduler.decoding, observed)
        if relative_costs:
            price_rounds(engine.runtime.scheduler.decoding.policy, relative_costs)
        outputs = engine.generate(input_ids=prompts(),
                                  sampling_params=[greedy(n) for n in MAX_NEW])
        one = engine.generate(input_ids=prompts()[0], sampling_params=greedy(MAX_NEW[0]))
        info = engine.get_server_info()
    assert info["num_compilations"] == compiled, "a round shape compiled after warm-up"
    return [o["output_ids"] for o in outputs], one["output_ids"], info


def price_rounds(policy, relative_costs):
    """A machine where a round of each shape costs relative_costs[its num_steps] plain steps,
    at warm-up and while serving, whatever the timings measured (or kept by an earlier
    process: the executable store keeps them, so one busy run's would stay)."""
    policy.round_seconds = {(shape, bucket): 0.01 * relative_costs[shape.num_steps]
                            for shape, bucket in policy.round_seconds}
    observe, add = policy.observe, policy.add_round_seconds
    policy.observe = lambda shape, bucket, _, outcomes, **kw: observe(
        shape, bucket, policy.round_seconds[shape, bucket], outcomes, **kw)
    # drafted shapes, built in the background, are timed while serving
    policy.add_round_seconds = lambda timings, **kw: add(
        {key: 0.01 * relative_costs[key[0].num_steps] for key in timings}, **kw)


SLOW_PREFILL_S = 0.5


def slow_prefills(decoding, observed):
    launch_prefill, observe = decoding.launch_prefill, decoding.policy.observe

    def slow_launch(batch):
        pending = launch_prefill(batch)
        read = pending.result
        pending.result = lambda: (time.sleep(SLOW_PREFILL_S), read())[1]
        return pending

    def logged_observe(shape, bucket, seconds, outcomes, **kw):
        observed.append(seconds)
        return observe(shape, bucket, seconds, outcomes, **kw)

    decoding.launch_prefill, decoding.policy.observe = slow_launch, logged_observe


def test_a_draft_that_predicts_everything_speculates_deepest_when_rounds_cost_alike(
        paths, reference):
    outputs, one, info = run_adaptive(paths, "STANDALONE", "self",
                                      relative_costs={0: 1, 1: 1, 3: 1})
    assert outputs == reference and one == reference[0]
    assert info["spec_adaptive"] and info["spec_shapes"] == ["plain", "1/1/2", "3/1/4", "3/2/6"]
    rounds = info["spec_rounds_by_shape"]
    assert rounds["1/1/2"] == 0 and rounds["plain"] <= 5  # plain: the probes (4, 8, 16, ...)
    assert rounds["3/1/4"] + rounds["3/2/6"] > 10 * rounds["plain"]
    assert info["spec_accept_rates"] == [1.0, 1.0, 1.0]
    assert info["spec_believed_accept_rates"]["chain"][0] > 0.9
    assert info["spec_last_choice"]["accept_length"]["3/1/4"] > 3.5
    # A wave of four run to its end: three slots freed while others ran, none taken
    # (refills.Refills), so the lone request after it is judged by its end.
    assert info["spec_freed_slots"] == {"taken": 0, "untaken": 3}
    assert info["spec_last_choice"]["judged_by"] == "batch end"


def test_a_draft_that_predicts_everything_stays_lossless_at_measured_costs(paths, reference):
    """Prefills are made slow here: a round launched behind one (the loop runs a step ahead)
    starts on the device only when the prefill ends, and is timed from there, so what the
    policy learns of a shape's cost holds no prefill."""
    observed = []
    outputs, one, info = run_adaptive(paths, "STANDALONE", "self", observed=observed)
    assert outputs == reference and one == reference[0]
    last, rates = info["spec_last_choice"], info["spec_last_choice"]["tokens_per_s"]
    best = max(rates, key=rates.get)
    # The policy's rule: the fastest shape, unless it beats plain by less than the margin
    # (then plain), or the round probes the other side.
    assert last["probe"] or last["shape"] == best or (
        last["shape"] == "plain" and rates[best] <= SPECULATION_MARGIN * rates["plain"]), last
    assert len(observed) > 20 and max(observed) < SLOW_PREFILL_S / 2, sorted(observed)[-5:]


def test_a_draft_that_predicts_nothing_falls_back_to_plain_rounds(paths, reference):
    outputs, one, info = run_adaptive(paths, "EAGLE3", "eagle3",
                                      relative_costs={0: 1, 1: 1.2, 3: 1.5})
    assert outputs == reference and one == reference[0]
    rounds = info["spec_rounds_by_shape"]
    assert rounds["plain"] > 3 * (sum(rounds.values()) - rounds["plain"])
    last = info["spec_last_choice"]
    assert last["shape"] == "plain" and last["accept_length"]["3/2/6"] < 1.5
    assert set(last["round_ms"]) == set(info["spec_shapes"])


def test_a_plain_round_after_a_drafted_one_does_not_wait_for_it(paths, reference):
    """NGRAM's plain round is the target's decode step; right after a drafted round it takes
    the lengths and the root that round leaves in the slot on the device, so it is launched
    while that round is still unread (no drain), and the output stays exact."""
    with Engine(model_path=str(paths["target"]), speculative_algorithm="NGRAM", **TREE,
                **BASE) as engine:
        compiled = built_programs(engine)
        decoding = engine.runtime.scheduler.decoding
        script = iter([decoding.spec.shape, PLAIN] * 1000)
        decoding.policy.choose = lambda requests, bucket, **_: next(script)
        plans, plan = [], decoding.plan_decode

        def logged_plan(reqs, in_flight):  # (whether a drafted round is in flight, the plan)
            behind_round = (in_flight is not None and in_flight.kind == "decode"
                            and in_flight.output.shape != PLAIN)
            plans.append((behind_round, plan(reqs, in_flight)))
            return plans[-1][1]
        decoding.plan_decode = logged_plan
        outputs = [o["output_ids"] for o in engine.generate(
            input_ids=prompts(), sampling_params=[greedy(n) for n in MAX_NEW])]
        info = engine.get_server_info()
    assert outputs == reference
    after_drafted = [p for behind_round, p in plans if behind_round
                     and p.detail.shape == PLAIN]
    assert len(after_drafted) > 10 and not any(p.settle_first for p in after_drafted)
    assert info["spec_rounds_by_shape"]["plain"] > 10
    assert info["num_compilations"] == compiled


def test_a_draft_that_would_not_pay_even_alone_is_given_up_in_a_plain_streak(paths,
                                                                            reference):
    """A few drafted rounds teach the policy that the head predicts nothing; in the plain
    streak that follows, the drafts that fall CATCH_UP_WIDTH behind are given up instead of
    caught up (no catch-up runs), the requests finish without a draft, and the output is
    the plain engine's."""
    with Engine(model_path=str(paths["target"]), speculative_algorithm="EAGLE3",
                speculative_draft_model_path=str(paths["eagle3"]), **TREE, **BASE) as engine:
        compiled = built_programs(engine)
        scheduler, spec = engine.runtime.scheduler, engine.runtime.spec_runner
        policy = scheduler.decoding.policy
        price_rounds(policy, {0: 1, 1: 1.2, 3: 1.5})  # what pays_alone weighs acceptance at
        script = iter([spec.shape] * 3 + [PLAIN] * 1000)
        policy.choose = lambda requests, bucket, **_: next(script)
        policy.admits_draft = lambda *_, **__: True
        widths = catch_up_widths(spec)
        outputs = [o["output_ids"] for o in engine.generate(
            input_ids=prompts(), sampling_params=[greedy(n) for n in MAX_NEW])]
        info = engine.get_server_info()
    assert outputs == reference
    assert not any(widths)  # (a bucket timed while serving runs a catch-up of no tokens)
    assert info["spec_finished_requests"] == {"with_draft": 0, "without_draft": len(MAX_NEW)}
    assert info["spec_rounds_by_shape"][spec.shape.name] == 3
    assert info["num_compilations"] == compiled


def catch_up_widths(spec) -> list[int]:
    """The tokens of every catch-up row the runner runs from now on (filled as they run)."""
    widths = []
    catch_up = spec.catch_up
    spec.catch_up = lambda rows, padded: (
        widths.extend(len(r.next_tokens) for r in rows), catch_up(rows, padded))[1]
    return widths


def test_a_draft_left_behind_by_plain_rounds_catches_up_exactly(paths, reference):
    """Plain streaks (one longer than a catch-up's width) between speculative rounds: the
    draft's cache afterwards holds what a draft kept in step by every round holds."""
    def run(adaptive):
        with Engine(model_path=str(paths["target"]), speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=str(paths["eagle3"]),
                    speculative_adaptive=adaptive, **TREE, **BASE) as engine:
            compiled = built_programs(engine)
            scheduler, spec = engine.runtime.scheduler, engine.runtime.spec_runner
            if adaptive:  # else the flags' shape every round: the draft kept in step
                script = iter(([PLAIN] * 3 + [spec.shape] * 2 + [PLAIN] * (CATCH_UP_WIDTH + 2)
                               + [scheduler.decoding.policy.shapes[1]]) * 100)
                scheduler.decoding.policy.choose = lambda requests, bucket, **_: next(script)
                # every request drafts, and keeps its draft through plain streaks, whatever
                # the warmup's timings on a busy machine say
                scheduler.decoding.policy.admits_draft = lambda *_, **__: True
                scheduler.decoding.policy.pays_alone = lambda record: True
            widths = catch_up_widths(spec)
            outputs = [o["output_ids"] for o in engine.generate(
                input_ids=prompts(), sampling_params=[greedy(n) for n in MAX_NEW])]
            keys = [cached_draft_keys(engine, p + o) for p, o in zip(prompts(), outputs,
                                                                     strict=True)]
            assert engine.get_server_info()["num_compilations"] == compiled
        return outputs, keys, widths

    outputs, keys, widths = run(adaptive=True)
    in_step_outputs, in_step_keys, no_widths = run(adaptive=False)
    assert outputs == reference == in_step_outputs
    assert not no_widths and max(widths) == CATCH_UP_WIDTH and min(widths) < CATCH_UP_WIDTH
    for prompt, output, got, want in zip(prompts(), outputs, keys, in_step_keys, strict=True):
        # by the finish every token but the last CATCH_UP_WIDTH + 1 has been caught up; the
        # cache holds full pages
        caught_up = min(len(prompt) + len(output) - 1 - CATCH_UP_WIDTH, len(got))
        assert len(got) == len(want) and caught_up > len(prompt)
        np.testing.assert_allclose(got[:caught_up], want[:caught_up], atol=1e-5)


def test_requests_admitted_without_a_draft_skip_its_prefill_and_stay_lossless(
        paths, reference):
    """Prefills of requests without a draft leave the draft's cache as it was; rounds that
    mix them with drafted requests stay lossless and show them to the policy as None; the
    prefix cache serves their pages to requests without a draft only."""
    def generate(engine, max_new):
        outputs = engine.generate(input_ids=prompts(),
                                  sampling_params=[greedy(n) for n in max_new])
        return ([o["output_ids"] for o in outputs],
                [o["meta_info"]["cached_tokens"] for o in outputs])

    with Engine(model_path=str(paths["target"]), speculative_algorithm="EAGLE3",
                speculative_draft_model_path=str(paths["eagle3"]), **TREE, **BASE) as engine:
        compiled = built_programs(engine)
        scheduler, spec = engine.runtime.scheduler, engine.runtime.spec_runner
        policy = scheduler.decoding.policy
        policy.admits_draft = lambda bucket, rid, *_: False
        policy.pays_alone = lambda record: True  # a draft is kept through plain streaks
        # Past the null page 0, which padding rows write (the timing rounds of shapes built
        # in the background run while serving).
        before = jax.device_get(spec.draft_state.kv)
        firsts, _ = generate(engine, [1] * 4)  # prefill only
        unchanged = jax.tree.map(lambda a, b: np.array_equal(a[1:], b[1:]), before,
                                 jax.device_get(spec.draft_state.kv))
        assert all(jax.tree.leaves(unchanged)), "a prefill without drafts ran the draft"

        order = []  # admission order: the 2nd and 4th prompts get a draft
        policy.admits_draft = lambda bucket, rid, *_: (
            order.append(rid) if rid not in order else None, order.index(rid) % 2 == 1)[1]
        script = iter(([spec.shape] * 2 + [PLAIN] * 3 + [policy.shapes[1]]) * 100)
        seen = []
        policy.choose = lambda records, bucket, **_: (seen.append(records), next(script))[1]
        outputs, mixed_cached = generate(engine, MAX_NEW)
        policy.admits_draft = lambda bucket, rid, *_: False
        del policy.choose  # the policy's own choice: plain, with no row drafted
        round_programs = []  # the speculative engine's own round programs
        spec.round = lambda *args, **kw: round_programs.append(args) or type(spec).round(
            spec, *args, **kw)
        undrafted, undrafted_cached = generate(engine, MAX_NEW)
        del spec.round
        policy.admits_draft = lambda bucket, rid, *_: True
        drafted, drafted_cached = generate(engine, MAX_NEW)
        info = engine.get_server_info()
    assert firsts == [r[:1] for r in reference] and outputs == reference
    # rounds where no request has a draft are the target's decode steps, and as lossless
    assert undrafted == reference and not round_programs
    assert info["num_compilations"] == compiled
    mixed_rounds = [r for r in seen if None in r and any(x is not None for x in r)]
    assert len(mixed_rounds) > 5
    assert info["spec_rounds_by_shape"]["3/2/6"] > 5
    assert info["spec_finished_requests"] == {"with_draft": 6, "without_draft": 10}
    assert info["spec_rounds_by_shape"]["plain"] > max(MAX_NEW)
    # prompts of 5, 30, 12 and 50 tokens, pages of 16: the drafted 2nd and 4th find no page
    # whose draft slots they can trust; requests without a draft reuse the target's pages
    assert mixed_cached == [0, 0, 0, 0] and undrafted_cached == [0, 16, 0, 48]
    # the drafted 2nd and 4th recomputed those pages with their draft: the tree took their
    # copies (no request read its own), so drafted requests now reuse them too
    assert drafted == reference and drafted_cached == [0, 16, 0, 48]


def test_a_slot_freed_with_requests_queued_is_taken(paths, reference):
    """Two running, two queued (MAX_NEW 40, 33 | 48, 25): the 2nd and then the 1st finish,
    each letting a queued request in; the 4th finishes with the 3rd still running and
    nothing queued, and its slot stays free until the end."""
    with Engine(model_path=str(paths["target"]), speculative_algorithm="NGRAM",
                max_running_requests=2, **TREE, **BASE) as engine:
        outputs = engine.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in
                                                                       MAX_NEW])
        info = engine.get_server_info()
    assert [o["output_ids"] for o in outputs] == reference
    assert info["spec_freed_slots"] == {"taken": 2, "untaken": 1}


def test_forcing_the_flags_shape_turns_the_policy_off(paths, reference):
    with Engine(model_path=str(paths["target"]), speculative_algorithm="EAGLE3",
                speculative_draft_model_path=str(paths["eagle3"]), speculative_adaptive=False,
                **TREE, **BASE) as engine:
        outputs = engine.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in
                                                                       MAX_NEW])
        info = engine.get_server_info()
    assert [o["output_ids"] for o in outputs] == reference
    assert not info["spec_adaptive"] and info["spec_shapes"] == ["3/2/6"]
    assert info["spec_rounds_by_shape"]["plain"] == 0  # only grammar batches go plain


def test_the_server_shows_its_choices(paths):
    flags = ["--model-path", str(paths["target"]), "--dtype", "float32",
             "--precompile-token-paddings", "64", "--precompile-bs-paddings", "1",
             "--max-prefill-tokens", "64", "--context-length", "256", "--enable-metrics",
             "--served-model-name", "tiny", "--speculative-algorithm", "EAGLE3",
             "--speculative-draft-model-path", str(paths["eagle3"]),
             "--speculative-num-steps", "2"]
    with launch_server(flags) as server:
        reply = httpx.post(f"{server.base_url}/generate", json={
            "input_ids": prompts()[1], "sampling_params": greedy(30)}, timeout=120)
        assert reply.status_code == 200
        info = httpx.get(f"{server.base_url}/get_server_info").json()
        assert info["speculative_adaptive"] is True and info["spec_adaptive"] is True
        assert sum(info["spec_rounds_by_shape"].values()) >= 10
        metrics = httpx.get(f"{server.base_url}/metrics").text
    assert re.search(r'^sgl_jax_spec_rounds_by_shape\{model_name="tiny",shape="plain"\} '
                     r'[1-9][0-9.]*$', metrics, re.M)
    # What the policy believed when it last chose a shape for drafted requests, for each shape
    # it weighed: those timed by then (a CPU server builds the larger shapes' programs in the
    # background). The request may have been admitted without a draft (the random head's
    # chains judged not to pay at this machine's measured round costs): then no choice was made.
    believed = set(re.findall(r'^sgl_jax_spec_believed_round_ms\{model_name="tiny",'
                              r'shape="([^"]+)"\} ', metrics, re.M))
    last = info["spec_last_choice"]
    assert (last is not None and set(last["round_ms"]) <= believed) or (last is None
                                                                      and not believed)
    assert info["spec_last_choice"] is not None or info["spec_finished_requests"] == {
        "with_draft": 0, "without_draft": 1}
    assert re.search(r'^sgl_jax_spec_believed_accept_rate\{depth="1",family="chain",'
                     r'model_name="tiny"\} ', metrics, re.M)
    finished = re.findall(r'^sgl_jax_spec_finished_requests\{draft="(with|without)_draft",'
                          r'model_name="tiny"\} ([0-9.]+)$', metrics, re.M)
    assert len(finished) == 2 and sum(float(n) for _, n in finished) == 1
    # one request alone frees no slot another could take
    assert re.search(r'^sgl_jax_spec_freed_slots\{fate="untaken",model_name="tiny"\} 0\.0$',
                     metrics, re.M)


def test_drafted_shapes_are_built_in_the_background(paths, reference, tmp_path):
    """Warm-up builds and times only the plain-round programs of the smallest bucket: the
    menu's drafted shapes go to the background builder (the policy takes each once built
    and timed), and the answers meanwhile equal plain decoding's. On a first start the
    builder compiles them; a second start's builder loads them from the store."""
    # A context length of its own: programs no other test left in JAX's own cache, whose
    # executables could not be kept (model_executor/programs.py).
    settings = dict(model_path=str(paths["target"]), speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=str(paths["eagle3"]),
                    compilation_cache_dir=str(tmp_path), **TREE, **{**BASE,
                                                                    "context_length": 320})

    def timed_at_warm_up(engine) -> set[str]:  # before any request: warm-up's timings
        return {shape.name for shape, _ in engine.runtime.spec_runner.round_seconds}

    with Engine(**settings) as engine:
        assert timed_at_warm_up(engine) == {PLAIN.name}
        outputs = engine.generate(input_ids=prompts(),
                                  sampling_params=[greedy(n) for n in MAX_NEW])
        assert engine.wait_for_programs(timeout=600)
        spec = engine.runtime.spec_runner
        # A plain round is the target's decode step: no round program of its own.
        drafted = [s for s in spec.shapes if s != PLAIN]
        assert all(spec.rounds[s].traced == 1 for s in drafted)
        assert spec.plain_is_decode_step and not spec.rounds[PLAIN].traced
    assert [o["output_ids"] for o in outputs] == reference
    with Engine(**settings) as engine:
        spec = engine.runtime.spec_runner
        assert timed_at_warm_up(engine) == {PLAIN.name}
        assert engine.wait_for_programs(timeout=600)
        assert all(spec.rounds[s].loaded == 1 and not spec.rounds[s].traced
                   for s in drafted), {s.name: spec.rounds[s].traced for s in spec.shapes}
