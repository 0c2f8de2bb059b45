"""Compiled programs and the process's memory mappings: an Engine gives its programs back at
shutdown, so engines built one after another in one process never pile up mappings (XLA:CPU
maps every compiled kernel apart and crashes past vm.max_map_count), a warm-up that would
come near the limit says so first, and a speculative server on a CPU compiles a larger batch
bucket only when a batch first needs it."""

import json
import logging

import numpy as np
import pytest

from sgl_jax import Engine, process_maps
from sgl_jax.process_maps import WarmupForecast, mapping_count, resident_bytes
from sgl_jax.speculative import spec_warmup
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft

pytestmark = pytest.mark.skipif(mapping_count() is None, reason="needs Linux's /proc")

TREE = dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=4,
            speculative_num_draft_tokens=8)
SMALL = dict(dtype="float32", precompile_token_paddings=[16], precompile_bs_paddings=[1],
             max_prefill_tokens=16, chunked_prefill_size=16)
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("maps")
    target = write_tiny_checkpoint(root / "llama", "llama")
    config = json.loads((target / "config.json").read_text())
    return target, write_tiny_eagle3_draft(root / "llama-eagle3", config)


def tree_engine(paths, **extra) -> Engine:
    target, draft = paths
    return Engine(model_path=str(target), speculative_draft_model_path=str(draft), **TREE,
                  **SMALL, **extra)


def test_six_tree_engines_in_a_row_give_their_mappings_and_memory_back(paths):
    """Each engine warms up (programs built ahead of their first call, then loaded from the
    store): the process after the sixth shutdown holds no more mappings or resident memory
    than after the first, give or take 10% (it held 370 mappings more per engine before
    shutdown cleared JAX's tracing caches: 1850 more by the sixth)."""
    outputs, after = [], []
    for _ in range(6):
        before = mapping_count()
        engine = tree_engine(paths)
        outputs.append(engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY)
                       ["output_ids"])
        in_use = mapping_count()
        engine.shutdown()  # `engine` still names it: shutdown alone must let go
        after.append((mapping_count(), resident_bytes()))
        assert in_use - before > 300  # the compiled programs took mappings...
    (first_maps, first_rss), (last_maps, last_rss) = after[0], after[-1]
    assert last_maps <= 1.1 * first_maps, after  # ...and gave them back
    assert last_rss <= 1.1 * first_rss, after
    assert all(out == outputs[0] for out in outputs)


def test_a_warmup_that_would_come_near_the_limit_warns(paths, monkeypatch, caplog):
    # A limit just above today's count: the first compiled programs project past it.
    monkeypatch.setattr(process_maps, "mapping_limit", lambda: mapping_count() + 200)
    with caplog.at_level(logging.WARNING, logger="sgl_jax.process_maps"):
        tree_engine(paths).shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.name == "sgl_jax.process_maps"]
    assert len(warnings) == 2  # the target's decode steps, then the speculative programs
    assert "vm.max_map_count" in warnings[0] and "--precompile-bs-paddings" in warnings[0]


def test_the_forecast_projects_the_mean_cost_of_the_programs_so_far(caplog):
    forecast = WarmupForecast(10, limit=10**9)
    forecast.start, forecast.done = 1000, 3
    assert forecast.projected(1300) == 1300 + 100 * 7
    with caplog.at_level(logging.WARNING, logger="sgl_jax.process_maps"):
        forecast.compiled()  # far from a limit of 10**9: quiet
    assert not caplog.records


def test_a_cpu_server_builds_a_larger_bucket_once_a_batch_needs_it(paths):
    """Warm-up on a CPU builds and times the smallest batch bucket only; the first batch of
    six has bucket 8 built on the background builder, then bucket 2 (meanwhile the requests
    run as the built buckets allow: one at a time, then padded to 8 even once only two are
    left), and a batch that then runs in bucket 8 times it between rounds, with padding rows
    that leave the running requests untouched: a draft that predicts everything (the target
    itself) still gives exactly plain greedy decoding."""
    target, _ = paths
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (3, 20, 7, 12, 5, 9)]
    buckets = dict(SMALL, precompile_bs_paddings=[1, 2, 8], precompile_token_paddings=[16, 64],
                   max_prefill_tokens=64)
    with Engine(model_path=str(target), skip_server_warmup=True, **buckets) as engine:
        plain = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                          sampling_params=GREEDY)]
    with Engine(model_path=str(target), speculative_algorithm="STANDALONE",
                speculative_draft_model_path=str(target), speculative_num_steps=3,
                speculative_eagle_topk=1, **buckets) as engine:
        runtime = engine.runtime
        timed = runtime.spec_runner.round_seconds
        assert {bucket for _, bucket in timed} == {1}
        # Every request drafts and every round takes the chain, whatever timings a busy
        # machine measured (the bucket is still timed first: the decoder asks before).
        policy = runtime.scheduler.decoding.policy
        policy.admits_draft = lambda *_, **__: True
        policy.choose = lambda *_, **__: runtime.spec_runner.shape
        outputs = [[o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                             sampling_params=GREEDY)]]
        assert runtime.builder.wait_idle(timeout=600)
        assert all(spec_warmup.bucket_built(runtime.spec_runner, size) for size in (2, 8))
        outputs.append([o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                                 sampling_params=GREEDY)])
        assert {bucket for _, bucket in timed} >= {1, 8}
        rounds = engine.get_server_info()["spec_rounds_by_shape"]
    assert outputs == [plain, plain]
    assert rounds["3/1/4"] >= 3 and rounds["plain"] == 0
