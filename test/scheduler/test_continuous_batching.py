"""The scheduler through the Engine: batching, arrivals, prefix cache, retraction, KV pages."""

import asyncio
import threading
import time

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.testing import write_tiny_checkpoint

SMALL = dict(dtype="float32", page_size=4, precompile_token_paddings=[16, 64, 256],
             precompile_bs_paddings=[1, 2, 4, 8], max_prefill_tokens=256,
             skip_server_warmup=True)


def greedy(n, **extra):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_path=str(model_dir), **SMALL) as eng:
        yield eng


def pages_all_free(engine) -> bool:
    return engine.flush_cache() and engine.usage().all_pages_free


def random_prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def alone(engine, prompts, params):
    return [engine.generate(input_ids=p, sampling_params=q)["output_ids"]
            for p, q in zip(prompts, params, strict=True)]


def test_requests_arriving_over_time_get_the_tokens_they_get_alone(engine):
    prompts = random_prompts(0, [5, 70, 12, 130, 3, 40])  # 130 > chunk of 64: chunked prefill
    params = [greedy(n) for n in (20, 6, 15, 9, 25, 12)]
    expected = alone(engine, prompts, params)
    results = {}

    def submit(i):
        time.sleep(0.05 * i)  # later requests join while earlier ones decode
        results[i] = engine.generate(input_ids=prompts[i], sampling_params=params[i])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i]["output_ids"] for i in range(len(prompts))] == expected
    assert pages_all_free(engine)


def test_prefix_cache_reuses_pages_and_keeps_outputs(model_dir, engine):
    shared = random_prompts(1, [200])[0]
    first = shared + [7, 8, 9]
    second = shared + [11, 12]
    engine.flush_cache()
    engine.generate(input_ids=first, sampling_params=greedy(4))
    out = engine.generate(input_ids=second, sampling_params=greedy(10))
    assert out["meta_info"]["cached_tokens"] >= 192
    with Engine(model_path=str(model_dir), disable_radix_cache=True, **SMALL) as uncached:
        reference = uncached.generate(input_ids=second, sampling_params=greedy(10))
    assert reference["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == reference["output_ids"]


def test_small_pool_forces_eviction_and_retraction_yet_outputs_stay_right(model_dir, engine):
    prompts = random_prompts(2, [30, 25, 40, 20, 35, 28])
    params = [greedy(24)] * len(prompts)
    expected = alone(engine, prompts, params)
    # 64 pages of 4 tokens hold about four of these requests at full length, not six.
    with Engine(model_path=str(model_dir), max_total_tokens=256, **SMALL) as small:
        outputs = small.generate(input_ids=prompts, sampling_params=params)
        info = small.get_server_info()
        assert pages_all_free(small)
    assert [o["output_ids"] for o in outputs] == expected
    assert info["num_retractions"] > 0


def test_abort_frees_pages(engine):
    prompt = random_prompts(3, [20])[0]
    stream = engine.generate(input_ids=prompt, sampling_params=greedy(200), stream=True)
    first = next(stream)
    assert len(first["output_ids"]) == 1
    stream.close()  # the consumer walks away: the request is aborted
    deadline = time.time() + 10
    while engine.get_server_info()["num_running_reqs"] and time.time() < deadline:
        time.sleep(0.05)
    assert pages_all_free(engine)


def test_streaming_chunks_add_up_to_the_plain_output(engine):
    params = {"temperature": 0, "max_new_tokens": 12}
    plain = engine.generate(prompt="Hello there", sampling_params=params)
    chunks = list(engine.generate(prompt="Hello there", sampling_params=params, stream=True))
    assert "".join(c["text"] for c in chunks) == plain["text"]
    assert sum((c["output_ids"] for c in chunks), []) == plain["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]


def test_streaming_a_batch_tags_chunks_with_their_output_index(engine):
    params = {"temperature": 1.0, "max_new_tokens": 10, "n": 2, "seed": 3, "ignore_eos": True}
    prompts = [[5, 6, 7], [9, 10]]
    plain = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    ids: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    finished = set()
    for chunk in engine.generate(input_ids=prompts, sampling_params=params, stream=True,
                                 return_logprob=True):
        assert chunk["index"] not in finished
        ids.setdefault(chunk["index"], []).extend(chunk["output_ids"])
        logprobs.setdefault(chunk["index"], []).extend(
            lp for lp, _ in chunk["meta_info"]["output_token_logprobs"])
        if "finish_reason" in chunk["meta_info"]:
            finished.add(chunk["index"])
    assert finished == {0, 1, 2, 3}  # prompt-major: prompt 0 samples 0-1, prompt 1 samples 2-3
    assert [ids[i] for i in range(4)] == [out["output_ids"] for out in plain]
    expected = [[lp for lp, _ in out["meta_info"]["output_token_logprobs"]] for out in plain]
    assert [logprobs[i] for i in range(4)] == expected


def test_async_generate_and_async_stream(engine):
    params = greedy(8)

    async def run():
        plain = await engine.async_generate(input_ids=[5, 6, 7], sampling_params=params)
        ids = []
        async for chunk in await engine.async_generate(
            input_ids=[5, 6, 7], sampling_params=params, stream=True
        ):
            ids += chunk["output_ids"]
        return plain, ids

    plain, streamed = asyncio.run(run())
    assert streamed == plain["output_ids"]
    assert plain["output_ids"] == engine.generate(input_ids=[5, 6, 7], sampling_params=params)[
        "output_ids"]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 16,
               "ignore_eos": True, "seed": 1234}
    prompt = random_prompts(4, [9])[0]
    solo = engine.generate(input_ids=prompt, sampling_params=sampled)["output_ids"]
    again = engine.generate(input_ids=prompt, sampling_params=sampled)["output_ids"]
    others = random_prompts(5, [30, 4, 17])
    batch = engine.generate(
        input_ids=[others[0], prompt, others[1], others[2]],
        sampling_params=[greedy(5), sampled, dict(sampled, seed=9), greedy(20)],
    )
    other_seed = engine.generate(input_ids=prompt, sampling_params=dict(sampled, seed=99))
    assert solo == again == batch[1]["output_ids"]
    assert other_seed["output_ids"] != solo


def test_n_samples_differ_and_share_the_prompt(engine):
    outs = engine.generate(input_ids=[5, 6, 7],
                           sampling_params={"temperature": 1.0, "max_new_tokens": 12, "n": 3,
                                            "seed": 5, "ignore_eos": True})
    assert len(outs) == 3 and len({tuple(o["output_ids"]) for o in outs}) == 3
    repeat = engine.generate(input_ids=[5, 6, 7],
                             sampling_params={"temperature": 1.0, "max_new_tokens": 12, "n": 3,
                                              "seed": 5, "ignore_eos": True})
    assert [o["output_ids"] for o in repeat] == [o["output_ids"] for o in outs]


def test_stop_token_ids_stop_strings_and_min_new_tokens(engine):
    prompt = [5, 6, 7]
    free = engine.generate(input_ids=prompt, sampling_params=greedy(20))
    ids = free["output_ids"]
    stop_token = ids[4]
    out = engine.generate(input_ids=prompt, sampling_params=greedy(20, stop_token_ids=[stop_token]))
    assert out["output_ids"] == ids[: ids.index(stop_token) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}

    later = engine.generate(input_ids=prompt, sampling_params=greedy(
        20, stop_token_ids=[ids[0]], min_new_tokens=3))
    assert ids[0] not in later["output_ids"][:3] and len(later["output_ids"]) >= 3

    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip() and "\ufffd" not in stop:
        cut = engine.generate(input_ids=prompt, sampling_params=greedy(20, stop=[stop]))
        assert cut["text"] == text[: text.index(stop)]
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        kept = engine.generate(input_ids=prompt,
                               sampling_params=greedy(20, stop=[stop], no_stop_trim=True))
        assert kept["text"] == text[: text.index(stop) + len(stop)]


def test_logprobs_match_the_raw_distribution(engine, model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [5, 6, 7, 8]
    out = engine.generate(input_ids=prompt, sampling_params=greedy(3), return_logprob=True,
                          top_logprobs_num=3)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + out["output_ids"]])).logits[0]
    logp = torch.log_softmax(logits, -1).numpy()
    for i, (lp, token) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(logp[len(prompt) - 1 + i, token], abs=1e-4)
        top = out["meta_info"]["output_top_logprobs"][i]
        assert [t for _, t in top] == np.argsort(-logp[len(prompt) - 1 + i])[:3].tolist()


def test_no_compilation_after_warm_up(model_dir):
    """Warm-up builds the prefills and batch bucket 1, the background builder buckets 2 and
    4; serving then compiles nothing."""
    buckets = dict(SMALL, skip_server_warmup=False, precompile_token_paddings=[16, 64],
                   precompile_bs_paddings=[1, 2, 4], max_prefill_tokens=64)
    with Engine(model_path=str(model_dir), **buckets) as eng:
        assert eng.runtime.builder.wait_idle(timeout=600)
        after_warmup = eng.get_server_info()["num_compilations"]
        prompts = random_prompts(6, [3, 40, 9, 60, 17, 1, 33])
        params = [dict(greedy(n), repetition_penalty=1.1 if n % 2 else 1.0,
                       temperature=0.0 if n % 3 else 0.7, seed=n)
                  for n in (4, 11, 7, 2, 9, 13, 5)]
        eng.generate(input_ids=prompts, sampling_params=params)
        eng.generate(input_ids=prompts[:2], sampling_params=params[:2], top_logprobs_num=2)
        assert eng.get_server_info()["num_compilations"] == after_warmup


def test_prefill_and_decode_log_lines(engine, caplog):
    with caplog.at_level("INFO", logger="sgl_jax.scheduler.scheduler"):
        engine.generate(input_ids=random_prompts(7, [10, 20]), sampling_params=greedy(45))
    prefill = [r.message for r in caplog.records if r.message.startswith("Prefill batch.")]
    decode = [r.message for r in caplog.records if r.message.startswith("Decode batch.")]
    assert prefill and "#new-seq: 2, #new-token: 30" in prefill[0]
    assert decode and "#running-req: 2" in decode[0] and "gen throughput (token/s)" in decode[0]
