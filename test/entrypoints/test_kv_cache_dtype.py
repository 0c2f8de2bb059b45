"""--kv-cache-dtype: what the pages store (auto, bfloat16, fp8), their bytes per token and the
pool a memory budget buys, fp8 pages through the Engine (the target's and a draft's), greedy
speculation equal to plain decoding over the same fp8 cache, and logits close to a float32
cache's. The backends' reads of fp8 pages are checked in test/layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.layers.gated_delta_net import GdnState
from sgl_jax.mem_cache import kv_cache
from sgl_jax.mem_cache.kv_cache import (
    allocate_kv_cache,
    kv_bytes_per_token,
    kv_cache_dtype,
    kv_pool_pages,
)
from sgl_jax.model_executor.forward_batch import Buckets, SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models.registry import get_model_impl
from sgl_jax.runtime import budget
from sgl_jax.server_args import ServerArgs
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.checkpoints import tiny_config

SMALL = dict(dtype="float32", precompile_token_paddings=[16, 64], precompile_bs_paddings=[1, 2],
             max_prefill_tokens=64, skip_server_warmup=True, page_size=4)
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1)
PROMPTS = [[5, 17, 300, 42, 8, 99, 123, 7, 64, 250, 3], [400, 12, 77]]
# One batch of two that finish together: one batch shape to compile for each program.
GREEDY = [{"temperature": 0, "max_new_tokens": 14, "ignore_eos": True}] * 2
# The tiny Llama preset: 4 layers, 2 KV heads of 64 / 4 = 16 features.
FP8_BYTES_PER_TOKEN = 2 * 4 * 2 * 16  # K and V, one byte each


@pytest.mark.parametrize("name,model_dtype,expected", [
    ("auto", jnp.float32, jnp.float32), ("auto", jnp.bfloat16, jnp.bfloat16),
    ("bfloat16", jnp.float32, jnp.bfloat16), ("fp8_e5m2", jnp.bfloat16, jnp.float8_e5m2),
    ("fp8_e4m3", jnp.float32, jnp.float8_e4m3fn)])
def test_names_map_to_page_dtypes(name, model_dtype, expected):
    assert kv_cache_dtype(name, model_dtype) == jnp.dtype(expected)


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported; choose from "
                                         "auto, bfloat16, fp8_e5m2, fp8_e4m3"):
        ServerArgs(kv_cache_dtype="fp8")
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--kv-cache-dtype", "float8"])
    assert ServerArgs.from_cli(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not one of"):
        kv_cache_dtype("int8", jnp.float32)


def test_a_hybrid_models_recurrent_states_keep_the_model_dtype():
    hf = tiny_config("qwen3_next").to_dict()
    config = get_model_impl(hf).config_from_hf(hf)
    cache = allocate_kv_cache(config, num_pages=4, page_size=4, dtype=jnp.bfloat16,
                              num_state_slots=2, kv_dtype=jnp.float8_e4m3fn)
    states = [layer for layer in cache.states if isinstance(layer, GdnState)]
    assert states and cache.k is not None
    for state in states:  # conv windows in the activation dtype, delta-rule states in f32
        assert (state.conv.dtype, state.ssm.dtype) == (jnp.bfloat16, jnp.float32)
    assert cache.k.dtype == cache.v.dtype == jnp.float8_e4m3fn


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def sized():
    """(the bytes_per_token values kv_pool_pages was called with, a spy that records them)."""
    seen = []

    def spy(**kwargs):
        seen.append(kwargs["bytes_per_token"])
        return kv_pool_pages(**kwargs)
    return seen, spy


@pytest.fixture(scope="module")
def fp8(model_dir, sized):
    """Plain decoding over fp8 pages, its pool sized through the spy."""
    seen, spy = sized
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(budget, "kv_pool_pages", spy)
        engine = Engine(model_path=str(model_dir), kv_cache_dtype="fp8_e4m3",
                        max_total_tokens=256, **SMALL)
    with engine:
        yield engine


def test_fp8_pages_cost_half_of_bfloat16s_and_a_budget_buys_twice_the_pages(fp8, monkeypatch):
    config, tp = fp8.model.config, fp8.model.tp
    fp8_bytes = kv_bytes_per_token(config, kv_cache_dtype("fp8_e4m3", jnp.float32), tp)
    bf16_bytes = kv_bytes_per_token(config, kv_cache_dtype("bfloat16", jnp.float32), tp)
    assert (fp8_bytes, bf16_bytes) == (FP8_BYTES_PER_TOKEN, 2 * FP8_BYTES_PER_TOKEN)
    monkeypatch.setattr(kv_cache, "device_memory_bytes", lambda device: 64 * 2**20)
    budget = dict(page_size=16, max_total_tokens=None, mem_fraction_static=0.5,
                  param_bytes=2**20, max_useful_tokens=10**9)
    # 31 MiB left after the weights: 126976 fp8 tokens in 7936 pages, plus the null page.
    assert kv_pool_pages(bytes_per_token=fp8_bytes, **budget) == 7936 + 1
    assert kv_pool_pages(bytes_per_token=bf16_bytes, **budget) == 3968 + 1


def test_the_engine_sizes_and_stores_fp8_pages(fp8, sized):
    assert sized[0] == [FP8_BYTES_PER_TOKEN]  # what the pool was sized with
    pages = fp8.runtime.runner.state.kv_cache
    assert pages.k.dtype == pages.v.dtype == jnp.float8_e4m3fn
    info = fp8.get_server_info()
    assert (info["kv_cache_dtype"], info["kv_pages_dtype"]) == ("fp8_e4m3", "float8_e4m3fn")
    assert info["dtype"] == "float32"  # the model computes in float32 all the same


def test_greedy_speculation_equals_plain_decoding_over_fp8_pages(fp8, model_dir):
    plain = [o["output_ids"] for o in fp8.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    with Engine(model_path=str(model_dir), kv_cache_dtype="fp8_e4m3", max_total_tokens=256,
                speculative_algorithm="STANDALONE",
                speculative_draft_model_path=str(model_dir), **CHAIN, **SMALL) as spec:
        # The draft's own cache stores the target's KV dtype too.
        draft_pages = spec.runtime.spec_runner.draft_state.kv
        assert draft_pages.k.dtype == draft_pages.v.dtype == jnp.float8_e4m3fn
        outputs = spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outputs] == plain
    rounds = sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
    accepted = sum(sum(o["meta_info"]["spec_accepted_per_position"]) for o in outputs)
    assert accepted > rounds  # the target as its own draft: rounds really accepted drafts


def prompt_logits(model, kv_dtype) -> np.ndarray:
    """f32[24, V]: the next-token logits at every position of a 24-token prompt, prefilled
    in two chunks (the second reads the first's K/V back from the pages)."""
    buckets = Buckets.automatic(max_tokens=16, max_seqs=1, context_len=64, page_size=4)
    runner = ModelRunner(model, num_pages=8, page_size=4, buckets=buckets, kv_dtype=kv_dtype)
    tokens = np.random.default_rng(3).integers(3, 500, 24).tolist()
    pages = list(range(1, 7))
    first, _ = runner.forward([SeqChunk(tokens[:12], 0, pages[:3])], all_logits=True)
    second, _ = runner.forward([SeqChunk(tokens[12:], 12, pages)], all_logits=True)
    return np.concatenate([first, second])


@pytest.fixture(scope="module")
def float32_logits(fp8):
    return prompt_logits(fp8.model, None)


# Mean KL bounds about twice what the tiny random Llama shows (bfloat16 8e-5, e4m3 0.02, e5m2
# 0.05 nats): K/V rounding error grows with fewer mantissa bits (7, 3, 2), the KL with its
# square.
@pytest.mark.parametrize("name,bound", [("bfloat16", 2e-4), ("fp8_e4m3", 0.04),
                                        ("fp8_e5m2", 0.1)])
def test_logits_over_rounded_pages_stay_close_to_float32_pages(fp8, float32_logits, name,
                                                                bound):
    logits = prompt_logits(fp8.model, kv_cache_dtype(name, jnp.float32))
    assert not np.array_equal(logits, float32_logits)  # the pages really rounded K and V
    p, q = jax.nn.log_softmax(float32_logits), jax.nn.log_softmax(logits)
    kl = np.asarray(jnp.sum(jnp.exp(p) * (p - q), axis=-1))  # KL(float32 pages || rounded)
    assert kl.mean() < bound and kl.max() < 5 * bound
