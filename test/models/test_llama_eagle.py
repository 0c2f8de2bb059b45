"""The EAGLE (v1 / v2) draft head against a PyTorch reference of the EAGLE draft written here:
fc over [embedding ; feature], Llama layers (no input norm in the first), no final norm, the
target's lm_head."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sgl_jax.layers.attention import get_attention_backend
from sgl_jax.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax.model_executor.forward_batch import BatchShape, SeqChunk, build_forward_batch
from sgl_jax.models import llama_eagle
from sgl_jax.models.loader import CheckpointError, load_eagle_draft
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle_draft
from sgl_jax.testing.torch_reference import causal_self_attention, rms_norm, torch_tensors

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def target_config(tmp_path_factory):
    target = write_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama")
    return json.loads((target / "config.json").read_text())


def reference_layer(w, p, cfg, x, first):
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    a = x if first else rms_norm(x, w[p + "input_layernorm.weight"], cfg["rms_norm_eps"])
    x = x + causal_self_attention(w, p, a, heads=heads, kv_heads=kv_heads, head_dim=hd,
                                  theta=cfg.get("rope_theta", 10000.0))
    m = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def reference_draft(w, cfg, embed, ids, features):
    x = torch.cat([embed[ids], features], -1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    for i in range(cfg["num_hidden_layers"]):
        x = reference_layer(w, f"layers.{i}.", cfg, x, first=i == 0)
    return x


VARIANTS = {
    "one_layer_with_bias": {},
    "two_layers_model_prefix_own_embedding": {"num_layers": 2, "with_fc_bias": False,
                                              "with_embed": True, "model_prefix": "model."},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_eagle_draft_matches_the_pytorch_reference(variant, target_config, tmp_path):
    draft_dir = write_tiny_eagle_draft(tmp_path / "draft", target_config, **VARIANTS[variant])
    draft = load_eagle_draft(str(draft_dir), dtype="float32", progress=False)
    raw = {k.removeprefix("model."): v for k, v in
           torch_tensors(draft_dir / "model.safetensors").items()}
    cfg = json.loads((draft_dir / "config.json").read_text())
    rng = np.random.default_rng(2)
    n, hidden, vocab = 21, cfg["hidden_size"], cfg["vocab_size"]
    ids = rng.integers(0, vocab, n)
    features = rng.standard_normal((n, hidden)).astype(np.float32)
    embed_np = (rng.standard_normal((vocab, hidden)) / 4).astype(np.float32)
    embed = draft.params.get("embed", jnp.asarray(embed_np))

    shape = BatchShape(num_tokens=32, q_block=16, pages_per_seq=8, num_logits=1)
    pages = list(range(1, 1 + -(-n // PAGE_SIZE)))
    batch = build_forward_batch([SeqChunk(list(ids), 0, pages)], page_size=PAGE_SIZE,
                                shape=shape)
    padded = np.zeros((32, hidden), np.float32)
    padded[:n] = features
    cache = allocate_kv_cache(draft.config, num_pages=16, page_size=PAGE_SIZE, dtype=jnp.float32)
    run = jax.jit(lambda p, c, b, f, e: llama_eagle.forward(
        p, c, b.input_ids, b.positions, f, b.attention, config=draft.config,
        attention=get_attention_backend("native"), embed=e))
    params = {k: v for k, v in draft.params.items() if k != "embed"}
    out, _ = run(params, cache, batch, padded, embed)

    with torch.no_grad():
        embed_t = raw.get("embed_tokens.weight", torch.from_numpy(embed_np))
        expected = reference_draft(raw, cfg, embed_t, torch.tensor(ids),
                                   torch.from_numpy(features))
    np.testing.assert_allclose(np.asarray(out)[:n], expected.numpy(), atol=1e-4, rtol=1e-4)


def test_a_checkpoint_without_fc_is_not_an_eagle_draft(tmp_path):
    target = write_tiny_checkpoint(tmp_path / "t", "llama")
    with pytest.raises(CheckpointError, match="not an EAGLE draft"):
        load_eagle_draft(str(target))
