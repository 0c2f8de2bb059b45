"""The overlapped engine loop (a step ahead of its results) against the synchronous one.

Every case runs on two engines over the same tiny checkpoint, one with overlap (the
default) and one with `disable_overlap_schedule`: what each request emits must be the same
token for token, and every KV page must come back.
"""

import threading
import time

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.engines import every_stop_rule, printable_stop, walk_away_mid_run

SMALL = dict(dtype="float32", page_size=4, precompile_token_paddings=[16, 64, 256],
             precompile_bs_paddings=[1, 2, 4, 8], max_prefill_tokens=256,
             skip_server_warmup=True)


def greedy(n, **extra):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


def random_prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def engines(model_dir):
    with (Engine(model_path=str(model_dir), **SMALL) as overlapped,
          Engine(model_path=str(model_dir), disable_overlap_schedule=True, **SMALL) as sync):
        yield overlapped, sync


def pages_all_free(engine) -> bool:
    return engine.flush_cache() and engine.usage().all_pages_free


def emitted(output):
    """What a request gave its caller: ids, text, why it ended, and logprobs if asked."""
    outputs = output if isinstance(output, list) else [output]
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"],
             o["meta_info"].get("output_token_logprobs")) for o in outputs]


def both(engines, **request):
    overlapped, sync = (emitted(engine.generate(**request)) for engine in engines)
    assert overlapped == sync
    assert all(pages_all_free(engine) for engine in engines)
    return overlapped


def launches_and_reads(engine, **request) -> list[str]:
    """The order in which the engine dispatched steps and read their results back while it
    served `request`."""
    events = []
    runner = engine.runtime.scheduler.runner
    launch = runner.launch  # every step, extend or decode, is dispatched here

    def logged_launch(*args, **kwargs):
        events.append("launch")
        pending = launch(*args, **kwargs)
        read = pending.result
        pending.result = lambda: (events.append("read"), read())[1]
        return pending

    engine.runtime.call(lambda s: setattr(s.runner, "launch", logged_launch))
    try:
        engine.generate(**request)
    finally:
        engine.runtime.call(lambda s: delattr(s.runner, "launch"))
    return events


def test_the_loop_dispatches_the_next_step_before_reading_the_last(engines):
    for engine, ahead in zip(engines, (True, False), strict=True):
        events = launches_and_reads(engine, input_ids=[5, 6, 7], sampling_params=greedy(6))
        # Overlapped: launch, launch, read, launch, read, ...; synchronous: launch, read, ...
        assert (events[:3] == ["launch", "launch", "read"]) is ahead
        assert events.count("launch") == events.count("read") == 6


def test_greedy_batches_with_every_stop_rule(engines):
    prompts = random_prompts(0, [5, 70, 12, 130, 3, 40])  # 130: a chunked prefill
    first = both(engines, input_ids=prompts[0], sampling_params=greedy(24))[0]
    ids = first[0]
    stop = printable_stop(both(engines, input_ids=[40, 41], sampling_params=greedy(20))[0][1])
    params = every_stop_rule(ids, stop)  # the first ends mid-run; its next step already ran
    outputs = both(engines, input_ids=[prompts[0]] + prompts[1:-1] + [[40, 41]],
                   sampling_params=params)
    assert outputs[0][0] == ids[: ids.index(ids[5]) + 1]
    assert len(outputs[1][0]) == 9 and len(outputs[4][0]) == 1
    assert outputs[5][2] == {"type": "stop", "matched": stop}


def test_stop_string_cuts_where_it_did(engines):
    prompt = [40, 41]
    text = both(engines, input_ids=prompt, sampling_params=greedy(20))[0][1]
    stop = printable_stop(text)
    cut = both(engines, input_ids=prompt, sampling_params=greedy(20, stop=[stop]))[0]
    assert cut[1] == text[: text.index(stop)]
    assert cut[2] == {"type": "stop", "matched": stop}


def test_seeded_sampling_and_logprobs(engines):
    prompts = random_prompts(1, [9, 30, 4])
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 16,
               "ignore_eos": True, "seed": 1234}
    params = [sampled, dict(sampled, seed=7, repetition_penalty=1.3, frequency_penalty=0.5),
              greedy(12)]
    both(engines, input_ids=prompts, sampling_params=params, return_logprob=True,
         top_logprobs_num=2)


def test_grammar_constrained_requests(engines):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [greedy(40, json_schema=schema), greedy(30), greedy(40, regex="[ab]{3,12}")]
    both(engines, input_ids=random_prompts(2, [6, 11, 8]), sampling_params=params)


def test_retraction_in_a_small_pool(model_dir, engines):
    prompts = random_prompts(3, [30, 25, 40, 20, 35, 28])
    params = [greedy(24)] * len(prompts)
    expected = emitted(engines[1].generate(input_ids=prompts, sampling_params=params))
    for overlap in (True, False):
        with Engine(model_path=str(model_dir), max_total_tokens=256,
                    disable_overlap_schedule=not overlap, **SMALL) as small:
            assert emitted(small.generate(input_ids=prompts, sampling_params=params)) == expected
            assert small.get_server_info()["num_retractions"] > 0
            assert pages_all_free(small)


def test_aborts_mid_run_free_every_page(engines):
    for engine in engines:
        walk_away_mid_run(engine, random_prompts(4, [20, 7, 33]))
        assert pages_all_free(engine)


def test_requests_arriving_while_others_decode(engines):
    prompts = random_prompts(5, [5, 70, 12, 130, 3, 40])
    params = [greedy(n) for n in (20, 6, 15, 9, 25, 12)]
    results = []
    for engine in engines:
        outputs = {}

        def submit(i, engine=engine, outputs=outputs):
            time.sleep(0.02 * i)
            outputs[i] = engine.generate(input_ids=prompts[i], sampling_params=params[i])

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.append([outputs[i]["output_ids"] for i in range(len(prompts))])
        assert pages_all_free(engine)
    assert results[0] == results[1]


def test_hybrid_model_with_state_slots_and_retraction(tmp_path):
    """Qwen3-Next keeps a recurrent state per request slot: a run that retracts (states
    freed, recomputed) gives the same tokens overlapped and not, and frees every slot."""
    path = write_tiny_checkpoint(tmp_path / "next", "qwen3_next")
    prompts = random_prompts(6, [30, 25, 40, 20, 35, 28])
    params = [greedy(20)] * len(prompts)
    results = []
    for overlap in (True, False):
        with Engine(model_path=str(path), max_total_tokens=256,
                    disable_overlap_schedule=not overlap, **SMALL) as engine:
            results.append(emitted(engine.generate(input_ids=prompts, sampling_params=params)))
            info = engine.get_server_info()
            assert info["num_retractions"] > 0 and info["state_slots_in_use"] == 0
            assert pages_all_free(engine)
    assert results[0] == results[1]


def test_scheduler_phases_count_each_step_and_the_time_waiting_for_work(engines):
    """/get_server_info's scheduler_phases: three prompts of known lengths add three prefill
    rows and a decode row for each token after the first; the seconds are the engine
    thread's own, so they fit in the wall time between the two reads, and a pause with
    nothing to run counts as idle."""
    def phases(engine):
        return engine.get_server_info()["scheduler_phases"]

    for engine in engines:
        # The clock starts before the first read: the engine's next idle wait begins as that
        # read returns, before this thread would see it.
        start = time.perf_counter()
        before = phases(engine)
        engine.generate(input_ids=random_prompts(6, [5, 9, 13]), sampling_params=greedy(6))
        time.sleep(0.3)
        after, wall = phases(engine), time.perf_counter() - start
        added = {kind: {key: after[kind][key] - before[kind][key] for key in after[kind]}
                 for kind in ("prefill", "decode")}
        idle = after["idle_s"] - before["idle_s"]
        assert added["prefill"]["rows"] == 3 and added["prefill"]["steps"] >= 1
        assert added["decode"]["rows"] == 3 * 5 and added["decode"]["steps"] >= 5
        busy = [added[kind][key] for kind in added for key in ("launch_s", "settle_s")]
        assert all(seconds > 0 for seconds in busy)
        assert 0.25 < idle and sum(busy) + idle < wall
