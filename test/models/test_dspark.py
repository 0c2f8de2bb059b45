"""A DSpark head against PyTorch references of its heads and of the DFlash backbone
(torch_reference.dspark_heads, dflash_block_hidden): every block slot drafts, anchor
first (slot k the token after position s + k); z_k = lm_head(h_k) plus the Markov term of the
token before the slot (vanilla: W2 W1[x]; gated: W2 (sigmoid(G [h; e] + g) * e); rnn: a gated
state along the block), the confidence logit w . [h_k; e_k] + b. Config errors are refused."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sgl_jax.layers.attention import get_attention_backend
from sgl_jax.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax.model_executor.forward_batch import kv_slots, window_metadata
from sgl_jax.models import dflash, dspark
from sgl_jax.models.loader import CheckpointError, load_dspark_draft
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.dflash import write_tiny_dflash_draft
from sgl_jax.testing.dspark import write_tiny_dspark_draft
from sgl_jax.testing.torch_reference import dflash_block_hidden, dspark_heads, torch_tensors

PAGE_SIZE = 4
CONTEXT, BLOCK = 13, 8


@pytest.fixture(scope="module")
def target_config(tmp_path_factory):
    target = write_tiny_checkpoint(tmp_path_factory.mktemp("target"), "qwen3")
    return json.loads((target / "config.json").read_text())


def block_hidden(draft, features, block_ids):
    """Our backbone's block output [B, H] over the context in a paged cache."""
    config = draft.config.backbone
    cache = allocate_kv_cache(config.layer, num_pages=16, page_size=PAGE_SIZE,
                              dtype=jnp.float32)
    page_table = jnp.arange(1, 9, dtype=jnp.int32)[None]
    positions = jnp.arange(CONTEXT, dtype=jnp.int32)
    cache = dflash.context_kv(draft.params, cache, jnp.asarray(features), positions,
                              kv_slots(page_table, positions[None], PAGE_SIZE)[0], config=config)
    metadata = window_metadata(page_table, jnp.array([CONTEXT]), jnp.array([BLOCK]), BLOCK,
                               PAGE_SIZE, dflash.full_block_mask(1, BLOCK))
    out, _ = dflash.block_forward(draft.params, cache, jnp.asarray(block_ids),
                                  CONTEXT + jnp.arange(BLOCK), metadata, config=config,
                                  attention=get_attention_backend("native"),
                                  embed=draft.params["embed"])
    return out


def tiny_head(target_config, tmp_path, markov_head):
    """A random head's folder, the loaded head and its config.json."""
    path = write_tiny_dspark_draft(tmp_path / "dspark", target_config, markov_head=markov_head,
                                   block_size=BLOCK)
    draft = load_dspark_draft(str(path), dtype="float32", progress=False)
    return path, draft, json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("markov_head", ["vanilla", "gated", "rnn", None])
def test_block_logits_and_confidences_match_the_reference(target_config, tmp_path,
                                                          markov_head):
    path, draft, cfg = tiny_head(target_config, tmp_path, markov_head)
    rng = np.random.default_rng(4)
    vocab = cfg["vocab_size"]
    features = rng.standard_normal((CONTEXT, 2 * cfg["hidden_size"])).astype(np.float32)
    anchor = int(rng.integers(vocab))
    block_ids = np.array([anchor] + [cfg["mask_token_id"]] * (BLOCK - 1))
    drafted = rng.integers(vocab, size=BLOCK - 1)
    previous = np.concatenate([[anchor], drafted])  # slot 0 follows the anchor itself

    hidden = block_hidden(draft, features, block_ids)
    logits, confidence = dspark.teacher_forced_logits(
        draft.params, draft.config, hidden[None], jnp.asarray(previous)[None])
    assert logits.shape == (1, BLOCK, vocab)  # a block of B drafts B tokens

    w = torch_tensors(path / "model.safetensors")
    with torch.no_grad():
        reference_hidden = dflash_block_hidden(
            w, cfg, torch.from_numpy(features), torch.from_numpy(block_ids),
            w["embed_tokens.weight"])
        expected, expected_confidence = dspark_heads(w, cfg, reference_hidden,
                                                        torch.from_numpy(previous))
    np.testing.assert_allclose(np.asarray(logits[0]), expected.numpy(), atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(confidence[0]), expected_confidence.numpy(),
                               atol=2e-4, rtol=2e-4)
    base = reference_hidden @ w["lm_head.weight"].T
    markov_term = np.abs(expected.numpy() - base.numpy()).max()
    assert (markov_term > 1e-2) == (markov_head is not None)  # an ignored term cannot pass


def test_bad_heads_are_refused(target_config, tmp_path):
    with pytest.raises(CheckpointError, match="not a DSpark draft"):
        load_dspark_draft(str(write_tiny_dflash_draft(tmp_path / "dflash", target_config)))
    path = write_tiny_dspark_draft(tmp_path / "d", target_config)
    hf = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="markov_head_type 'lstm' is not one of vanilla"):
        dspark.config_from_hf({**hf, "markov_head_type": "lstm"})
    with pytest.raises(ValueError, match="confidence_head_with_markov needs a Markov head"):
        dspark.config_from_hf({**hf, "markov_rank": 0})
    del hf["mask_token_id"]
    with pytest.raises(ValueError, match="needs mask_token_id"):
        dspark.config_from_hf(hf)


def reference_candidates(w, cfg, hidden, anchor, topk):
    """{path (tokens from slot 0): summed log-probabilities} of every candidate, each path's
    logits recomputed from its own tokens (the Markov term, the rnn state along the path):
    the anchor's K best children, then the K best children of each of the K best of the slot
    before."""
    def children(path):
        logits, _ = dspark_heads(w, cfg, hidden[: len(path) + 1],
                                 torch.tensor([anchor, *path]))
        steps, tokens = torch.log_softmax(logits[len(path)], -1).topk(topk)
        return [(path + (int(t),), float(s)) for s, t in zip(steps, tokens, strict=True)]

    frontier = children(())
    found = dict(frontier)
    for _ in range(1, hidden.shape[0]):
        grown = [(child, found[path] + step)
                 for path, _ in frontier for child, step in children(path)]
        found.update(grown)
        frontier = sorted(grown, key=lambda item: -item[1])[:topk]
    return found


@pytest.mark.parametrize("markov_head,topk", [("rnn", 3), ("gated", 1)])
def test_tree_candidates_follow_their_parents_tokens(target_config, tmp_path, markov_head,
                                                     topk):
    path, draft, cfg = tiny_head(target_config, tmp_path, markov_head)
    rng = np.random.default_rng(6)
    steps, anchor = 4, int(rng.integers(cfg["vocab_size"]))
    hidden = rng.standard_normal((steps, cfg["hidden_size"])).astype(np.float32)
    scores, tokens, parents = (np.asarray(x)[0] for x in dspark.draft_candidates(
        draft.params, draft.config, jnp.asarray(hidden)[None], jnp.array([anchor]), topk))
    assert len(scores) == topk + (steps - 1) * topk * topk

    def path_of(node):
        return () if node < 0 else path_of(int(parents[node])) + (int(tokens[node]),)

    ours = {path_of(node): float(score) for node, score in enumerate(scores)}
    with torch.no_grad():
        expected = reference_candidates(torch_tensors(path / "model.safetensors"), cfg,
                                        torch.from_numpy(hidden), anchor, topk)
    assert ours.keys() == expected.keys()
    np.testing.assert_allclose([ours[p] for p in expected], list(expected.values()),
                               rtol=1e-4, atol=1e-4)
