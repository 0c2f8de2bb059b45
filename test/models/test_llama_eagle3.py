"""The EAGLE3 draft head against a PyTorch reference written here from the EAGLE3 checkpoint
notes, its checkpoint spellings, and the target-layer capture convention."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

from sgl_jax.layers.attention import get_attention_backend
from sgl_jax.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax.model_executor.forward_batch import BatchShape, SeqChunk, aligned, build_forward_batch
from sgl_jax.models import llama_eagle3
from sgl_jax.models.loader import CheckpointError, load_eagle3_draft, load_model
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft
from sgl_jax.testing.torch_reference import causal_self_attention, rms_norm, torch_tensors

PAGE_SIZE = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama")


@pytest.fixture(scope="module")
def target_config(target_dir):
    return json.loads((target_dir / "config.json").read_text())


# ---------------------------------------------------------------------- PyTorch reference


def reference_draft(w, cfg, embed, lm_head, ids, g):
    """EAGLE3 draft over one sequence from scratch: token t's input is
    concat(input_layernorm(embed(ids[t])), hidden_norm(g[t])); causal attention over the
    sequence; residual g; MLP; logits = lm_head(norm(h)). Returns (h [T, H], logits)."""
    p = "midlayer."
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = cfg.get("rope_theta", 10000.0)
    a = torch.cat([rms_norm(embed[ids], w[p + "input_layernorm.weight"]),
                   rms_norm(g, w[p + "hidden_norm.weight"])], -1)
    h = g + causal_self_attention(w, p, a, heads=heads, kv_heads=kv_heads, head_dim=hd,
                                  theta=theta)
    x = rms_norm(h, w[p + "post_attention_layernorm.weight"])
    gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return h, rms_norm(h, w["norm.weight"]) @ lm_head.T


# ---------------------------------------------------------------------- our draft, paged


def run_draft(draft, embed, ids, features, prefix_len, pages, cache, from_target):
    shape = BatchShape(num_tokens=aligned(len(ids), 16) if len(ids) > 1 else 1,
                       q_block=16 if len(ids) > 1 else 1, pages_per_seq=len(pages),
                       num_logits=1)
    batch = build_forward_batch([SeqChunk(list(ids), prefix_len, pages)], page_size=PAGE_SIZE,
                                shape=shape)
    padded = np.zeros((shape.num_tokens, features.shape[1]), np.float32)
    padded[: len(ids)] = features
    hidden, cache = llama_eagle3.forward(
        draft.params, cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
        jnp.asarray(padded), batch.attention, config=draft.config,
        attention=get_attention_backend("native"), embed=embed, from_target=from_target)
    return np.asarray(hidden[: len(ids)]), cache


VARIANTS = {
    "specforge": {"draft_vocab_size": 100},
    "layers0_spelling": {"draft_vocab_size": 100, "layer_prefix": "layers.0.",
                         "d2t_name": "draft_id_to_target_id", "rope_theta": 500000.0},
    "own_embedding": {"draft_vocab_size": 100, "with_embed": True},
    "target_lm_head": {"with_lm_head": False},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_matches_the_pytorch_reference(variant, target_dir, target_config, tmp_path):
    draft_dir = write_tiny_eagle3_draft(tmp_path / "draft", target_config, **VARIANTS[variant])
    draft = load_eagle3_draft(str(draft_dir), dtype="float32", progress=False)
    target = load_model(str(target_dir), dtype="float32", progress=False)
    raw = torch_tensors(draft_dir / "model.safetensors")
    raw = {k.replace("layers.0.", "midlayer."): v for k, v in raw.items()}
    target_raw = torch_tensors(target_dir / "model.safetensors")
    embed_t = raw.get("embed_tokens.weight", target_raw["model.embed_tokens.weight"])
    lm_head_t = raw.get("lm_head.weight", target_raw["lm_head.weight"])
    embed = draft.params.get("embed", target.params["embed"])
    lm_head = draft.params.get("lm_head", target.params["lm_head"])
    cfg = json.loads((draft_dir / "config.json").read_text())

    rng = np.random.default_rng(1)
    n, hidden = 19, cfg["hidden_size"]
    ids = rng.integers(0, cfg["vocab_size"], n + 1)
    features = rng.standard_normal((n, 3 * hidden)).astype(np.float32)

    # Draft-extend over n tokens from target features, then one step fed its own output.
    pages = list(range(1, 1 + -(-(n + 1) // PAGE_SIZE)))
    cache = allocate_kv_cache(draft.config.layer, num_pages=16, page_size=PAGE_SIZE,
                              dtype=jnp.float32)
    h, cache = run_draft(draft, embed, ids[:n], features, 0, pages, cache, from_target=True)
    h_next, _ = run_draft(draft, embed, ids[n:], h[-1:], n, pages, cache, from_target=False)
    logits = np.asarray(llama_eagle3.compute_logits(draft.params, jnp.asarray(
        np.concatenate([h, h_next])), draft.config, lm_head))

    with torch.no_grad():
        g = torch.from_numpy(features) @ raw["fc.weight"].T
        h_ref, _ = reference_draft(raw, cfg, embed_t, lm_head_t, torch.tensor(ids[:n]), g)
        g_all = torch.cat([g, h_ref[-1:]])
        _, logits_ref = reference_draft(raw, cfg, embed_t, lm_head_t, torch.tensor(ids), g_all)
    np.testing.assert_allclose(h, h_ref.numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(logits, logits_ref.numpy(), atol=ATOL, rtol=0)
    assert logits.shape[1] == VARIANTS[variant].get("draft_vocab_size", cfg["vocab_size"])


def test_d2t_maps_the_draft_vocabulary_onto_its_target_ids(target_config, tmp_path):
    draft_dir = write_tiny_eagle3_draft(tmp_path, target_config, draft_vocab_size=50, seed=3)
    draft = load_eagle3_draft(str(draft_dir), dtype="float32", progress=False)
    t2d = load_file(str(draft_dir / "model.safetensors"))["t2d"]
    mapped = np.asarray(llama_eagle3.draft_to_target_ids(jnp.arange(50), draft.params))
    np.testing.assert_array_equal(mapped, np.flatnonzero(t2d))
    assert draft.params["d2t"].dtype == jnp.int32 and "t2d" not in draft.params


def test_a_draft_without_rope_theta_uses_10000(target_config, tmp_path):
    draft_dir = write_tiny_eagle3_draft(tmp_path, {**target_config, "rope_theta": 5e5})
    config = load_eagle3_draft(str(draft_dir), dtype="float32", progress=False).config
    assert config.layer.rope.theta == 10000.0


def test_one_layer_llama_config_counts_as_a_draft():
    assert llama_eagle3.is_eagle3_draft({"architectures": ["LlamaForCausalLM"],
                                         "num_hidden_layers": 1})
    assert not llama_eagle3.is_eagle3_draft({"architectures": ["LlamaForCausalLM"],
                                             "num_hidden_layers": 4})


def test_loading_errors_are_named(target_dir, target_config, tmp_path):
    with pytest.raises(CheckpointError, match="is not an EAGLE3 draft"):
        load_eagle3_draft(str(target_dir), progress=False)
    draft_dir = write_tiny_eagle3_draft(tmp_path / "a", target_config, draft_vocab_size=50)
    files = load_file(str(draft_dir / "model.safetensors"))
    del files["d2t"]
    from safetensors.numpy import save_file
    save_file(files, str(draft_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="no d2t mapping"):
        load_eagle3_draft(str(draft_dir), progress=False)
    bad_aux = write_tiny_eagle3_draft(tmp_path / "b", target_config, aux_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="must name 3 layers"):
        load_eagle3_draft(str(bad_aux), progress=False)


# ---------------------------------------------------------------------- capture convention


def test_capture_layers_default_and_aux_ids_name_the_same_states():
    default = llama_eagle3.Eagle3Config(layer=None, draft_vocab_size=1, target_hidden_size=1,
                                        aux_layer_ids=None)
    specforge = llama_eagle3.Eagle3Config(layer=None, draft_vocab_size=1, target_hidden_size=1,
                                          aux_layer_ids=(1, 15, 28))
    assert llama_eagle3.target_capture_layers(32, default) == (2, 16, 29)  # Llama-3.1-8B
    assert llama_eagle3.target_capture_layers(32, specforge) == (2, 16, 29)
    hybrid = llama_eagle3.Eagle3Config(layer=None, draft_vocab_size=1, target_hidden_size=1,
                                       aux_layer_ids=(3, 23, 47))  # Qwen3-Coder-Next card
    assert llama_eagle3.target_capture_layers(48, hybrid) == (4, 24, 48)
    with pytest.raises(ValueError, match="do not fit"):
        llama_eagle3.target_capture_layers(8, specforge)


@pytest.mark.parametrize("aux_layer_ids", [None, [0, 1, 2]])
def test_captured_states_are_the_target_layer_outputs_transformers_reports(
        aux_layer_ids, target_dir, target_config, tmp_path):
    """hidden_states[i + 1] of transformers is the output of layer i: the state captured for
    aux id i (and, by default, for layers 2, L//2, L-3 it is hidden_states[2, L//2, L-3])."""
    draft_dir = write_tiny_eagle3_draft(tmp_path, target_config, aux_layer_ids=aux_layer_ids)
    draft = load_eagle3_draft(str(draft_dir), dtype="float32", progress=False)
    num_layers = target_config["num_hidden_layers"]
    layers = llama_eagle3.target_capture_layers(num_layers, draft.config)
    expected_layers = ((2, num_layers // 2, num_layers - 3) if aux_layer_ids is None
                       else tuple(i + 1 for i in aux_layer_ids))
    assert layers == expected_layers

    from sgl_jax.model_executor.model_runner import ModelRunner

    target = load_model(str(target_dir), dtype="float32", progress=False)
    runner = ModelRunner(target, num_pages=32, page_size=PAGE_SIZE, capture_layers=layers)
    ids = list(np.random.default_rng(2).integers(3, 500, 11))
    _, captured = runner.forward([SeqChunk(ids, 0, [1, 2, 3])], all_logits=True)
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer, ours in zip(layers, captured, strict=True):
        np.testing.assert_allclose(np.asarray(ours)[: len(ids)], states[layer][0].numpy(),
                                   atol=ATOL, rtol=0)
