"""The offline Engine: input forms, outputs, stopping, validation and KV page accounting."""

import json

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.entrypoints.native_api import model_info
from sgl_jax.testing import write_tiny_checkpoint

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
# Few buckets and no warm-up keep compilation (about 2 s a shape on CPU) out of test time.
SMALL = dict(dtype="float32", precompile_token_paddings=[16, 64],
             precompile_bs_paddings=[1, 2, 4, 8], max_prefill_tokens=64, skip_server_warmup=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_path=str(model_dir), page_size=4, **SMALL) as eng:
        yield eng


def all_pages_free(engine) -> bool:
    """No request holds a page: after dropping the prefix cache every page is free."""
    return engine.flush_cache() and engine.usage().all_pages_free


def test_single_prompt_gives_a_dict_and_batch_a_list(engine):
    single = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    batch = engine.generate(input_ids=[[5, 6, 7], [9, 10]], sampling_params=GREEDY)
    assert isinstance(single, dict) and isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"]
    assert len(single["output_ids"]) == 8
    assert single["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert single["meta_info"]["prompt_tokens"] == 3
    assert single["meta_info"]["completion_tokens"] == 8
    assert all_pages_free(engine)


def test_text_prompt_is_tokenized_and_output_detokenized(engine):
    out = engine.generate(prompt="Hello world", sampling_params=GREEDY)
    ids = engine.tokenizer("Hello world").input_ids
    from_ids = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["output_ids"] == from_ids["output_ids"]
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_batching_does_not_change_outputs(engine):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (3, 17, 9, 30, 1)]
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    params = [dict(GREEDY, max_new_tokens=n) for n in (8, 3, 8, 5, 8)]
    together = engine.generate(input_ids=prompts, sampling_params=params)
    for solo, joint, p in zip(alone, together, params, strict=True):
        assert joint["output_ids"] == solo[: p["max_new_tokens"]]
    assert all_pages_free(engine)


def test_eos_stops_generation(model_dir, tmp_path):
    with Engine(model_path=str(model_dir), **SMALL) as eng:
        free_run = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]
    # Make the third greedy token an EOS token through generation_config.json.
    stop_token = free_run[2]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_token}))
    with Engine(model_path=str(tmp_path), **SMALL) as eng:
        params = dict(GREEDY, ignore_eos=False)
        out = eng.generate(input_ids=[5, 6, 7], sampling_params=params)
        ignored = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert out["output_ids"] == free_run[: free_run.index(stop_token) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    assert ignored["output_ids"] == free_run


def test_zero_new_tokens(engine):
    out = engine.generate(input_ids=[5, 6], sampling_params=dict(GREEDY, max_new_tokens=0))
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({}, ValueError, "exactly one of prompt and input_ids"),
        ({"prompt": "hi", "input_ids": [1]}, ValueError, "exactly one"),
        ({"input_ids": [1], "sampling_params": {"top_q": 1}}, ValueError, "top_q"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, ValueError, "top_p"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, ValueError, "temperature"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -2}}, ValueError,
         "max_new_tokens"),
        ({"input_ids": [1, 99999], "sampling_params": GREEDY}, ValueError, "99999"),
        ({"input_ids": [[1], [2]], "sampling_params": [GREEDY]}, ValueError,
         "1 sampling_params for 2 prompts"),
        ({"input_ids": [1] * 500, "sampling_params": dict(GREEDY, max_new_tokens=20)},
         ValueError, r"prompt \(500 tokens\) \+ max_new_tokens \(20\) = 520 exceeds the "
         r"context length \(512\)"),
    ],
)
def test_invalid_requests_raise_before_running(engine, kwargs, error, message):
    with pytest.raises(error, match=message):
        engine.generate(**kwargs)
    assert all_pages_free(engine)


def test_request_larger_than_the_kv_pool_is_refused(model_dir):
    with Engine(model_path=str(model_dir), page_size=4, max_total_tokens=32, **SMALL) as e:
        with pytest.raises(ValueError, match="= 40 tokens exceeds the KV pool \\(32 tokens\\)"):
            e.generate(input_ids=[1] * 20, sampling_params=dict(GREEDY, max_new_tokens=20))
        assert all_pages_free(e)


def test_unknown_engine_argument_is_rejected(model_dir):
    with pytest.raises(TypeError, match="not_a_flag"):
        Engine(model_path=str(model_dir), not_a_flag=1)


def test_shutdown_engine_refuses_work(model_dir):
    eng = Engine(model_path=str(model_dir), **SMALL)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(input_ids=[1], sampling_params=GREEDY)


def test_drain_aborts_what_outlasts_it_and_refuses_new_requests(model_dir):
    """What the HTTP server does on SIGTERM: a request still running when the window ends
    ends with an abort saying why, new ones are refused, and no page stays held."""
    with Engine(model_path=str(model_dir), **SMALL) as eng:
        long = eng.generate(input_ids=[5, 6, 7], stream=True,
                            sampling_params={**GREEDY, "max_new_tokens": 500})
        first = next(long)  # running
        assert eng.drain(timeout_s=0) == 1
        with pytest.raises(RuntimeError, match="shutting down"):
            eng.generate(input_ids=[1], sampling_params=GREEDY)
        last = [first, *long][-1]["meta_info"]
        assert last["finish_reason"] == {"type": "abort",
                                         "message": "the server is shutting down"}
        assert last["completion_tokens"] < 500
        assert eng.drain(timeout_s=0) == 0  # nothing left: it returns at once
        assert all_pages_free(eng)


def test_server_and_model_info_name_the_dtype_that_runs(model_dir):
    with Engine(model_path=str(model_dir), **{**SMALL, "dtype": "auto"}) as engine:
        assert engine.get_server_info()["dtype"] == "float32"  # what auto means on CPU
        assert model_info(engine, "m")["dtype"] == "float32"


def test_a_second_engine_loads_its_programs_and_a_changed_flag_builds_them(model_dir,
                                                                           tmp_path):
    """Programs built by one engine are kept (executable store under the compilation cache
    directory): the next engine with the same flags traces none and answers the same; one
    with a changed flag loads none."""
    settings = dict(SMALL, skip_server_warmup=False, precompile_bs_paddings=[1, 2],
                    precompile_token_paddings=[16], max_prefill_tokens=16, page_size=4,
                    compilation_cache_dir=str(tmp_path))
    prompts = [[5, 6, 7], [9, 10]]

    def start(**changes):
        with Engine(model_path=str(model_dir), **{**settings, **changes}) as eng:
            assert eng.wait_for_programs(timeout=600)
            outputs = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                             sampling_params=GREEDY)]
            programs = eng.runtime.runner.sampling_programs
            return outputs, programs.traced, programs.loaded

    first, traced, _ = start()
    assert traced == 3  # prefill 16, decode 1 and 2
    assert start() == (first, 0, 3)
    assert start(context_length=512)[1:] == (3, 0)
