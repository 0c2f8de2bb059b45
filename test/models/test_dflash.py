"""A DFlash draft head against a PyTorch reference of the DFlash forward written here: the
context c = hidden_norm(fc(target features)) gives every layer's keys and values for the
committed tokens (k_norm(k_proj(c)) with RoPE, v_proj(c)); the block [token, MASK ...] runs
through Qwen3 layers whose queries see all of that context and, non-causally, the whole
block (a sliding layer of window W: only keys less than W positions behind the query); norm,
the target's lm_head at block positions 1..B-1. Context keys are written once into the paged
cache, the block runs over it. Config and layout errors are refused."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sgl_jax.layers.attention import get_attention_backend
from sgl_jax.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax.model_executor.forward_batch import kv_slots, window_metadata
from sgl_jax.models import dflash
from sgl_jax.models.loader import CheckpointError, load_dflash_draft
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.dflash import write_tiny_dflash_draft
from sgl_jax.testing.torch_reference import dflash_block_hidden, torch_tensors

PAGE_SIZE = 4
CONTEXT, BLOCK = 13, 8
# Positions run 0..20: a window of 5 hides most of the context from every block query and,
# from the block's later queries, its first keys too.
SLIDING = (["sliding_attention", "full_attention"], 5)


@pytest.fixture(scope="module")
def target_config(tmp_path_factory):
    target = write_tiny_checkpoint(tmp_path_factory.mktemp("target"), "qwen3")
    return json.loads((target / "config.json").read_text())


@pytest.mark.parametrize("layer_types,sliding_window", [(None, None), SLIDING],
                         ids=["full", "sliding"])
def test_block_logits_match_the_reference(target_config, tmp_path, layer_types,
                                          sliding_window):
    path = write_tiny_dflash_draft(tmp_path / "dflash", target_config, num_layers=2,
                                   block_size=BLOCK, target_layer_ids=(0, 2),
                                   layer_types=layer_types, sliding_window=sliding_window)
    draft = load_dflash_draft(str(path), dtype="float32", progress=False)
    config = draft.config
    assert config.capture_layers == (1, 3) and config.block_size == BLOCK
    assert config.sliding_windows == ((sliding_window, None) if layer_types else (None, None))
    cfg = json.loads((path / "config.json").read_text())
    rng = np.random.default_rng(3)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    features = rng.standard_normal((CONTEXT, 2 * h)).astype(np.float32)
    embed = (rng.standard_normal((vocab, h)) / 4).astype(np.float32)
    lm_head = (rng.standard_normal((vocab, h)) / 4).astype(np.float32)
    block_ids = np.array([int(rng.integers(vocab))] + [config.mask_token_id] * (BLOCK - 1))

    cache = allocate_kv_cache(config.layer, num_pages=16, page_size=PAGE_SIZE,
                              dtype=jnp.float32)
    page_table = jnp.arange(1, 9, dtype=jnp.int32)[None]  # 32 tokens
    positions = jnp.arange(CONTEXT, dtype=jnp.int32)
    cache = dflash.context_kv(draft.params, cache, jnp.asarray(features), positions,
                              kv_slots(page_table, positions[None], PAGE_SIZE)[0],
                              config=config)
    metadata = window_metadata(page_table, jnp.array([CONTEXT]), jnp.array([BLOCK]), BLOCK,
                               PAGE_SIZE, dflash.full_block_mask(1, BLOCK))
    out, _ = dflash.block_forward(draft.params, cache, jnp.asarray(block_ids),
                                  CONTEXT + jnp.arange(BLOCK), metadata, config=config,
                                  attention=get_attention_backend("native"),
                                  embed=jnp.asarray(embed))
    logits = np.asarray(out)[1:] @ lm_head.T

    w = torch_tensors(path / "model.safetensors")
    inputs = [torch.from_numpy(a) for a in (features, block_ids, embed, lm_head)]
    with torch.no_grad():
        expected = (dflash_block_hidden(w, cfg, *inputs[:3])[1:] @ inputs[3].T).numpy()
        unwindowed = (dflash_block_hidden(w, cfg, *inputs[:3], windows=False)[1:]
                      @ inputs[3].T).numpy()
    np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=2e-4)
    if sliding_window is not None:  # so an ignored window could not pass
        assert np.abs(expected - unwindowed).max() > 1e-2


def test_bad_heads_are_refused(target_config, tmp_path):
    target = write_tiny_checkpoint(tmp_path / "t", "qwen3")
    with pytest.raises(CheckpointError, match="not a DFlash draft"):
        load_dflash_draft(str(target))
    path = write_tiny_dflash_draft(tmp_path / "d", target_config)
    hf = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"layers \[1\] are sliding_attention, but "
                                         "config.json's sliding_window is None"):
        dflash.config_from_hf({**hf, "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\] are not"):
        dflash.config_from_hf({**hf, "layer_types": ["full_attention", "chunked_attention"]})
    with pytest.raises(ValueError, match="layer_types lists 1 layers"):
        dflash.config_from_hf({**hf, "layer_types": ["full_attention"]})
    del hf["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="needs mask_token_id"):
        dflash.config_from_hf(hf)
