"""DFlash training (training/dflash.py): the block states the objective trains on are the ones
a PyTorch implementation of the published objective computes (each block sees the context
strictly before its anchor and its own block, nothing else); the weighted loss is its
cross-entropy; the CLI trains a head that loads as a z-lab head does."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sgl_jax.models.config import dense_config_from_hf
from sgl_jax.models.loader import load_dflash_draft
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.dflash import write_tiny_dflash_draft
from sgl_jax.testing.torch_reference import torch_block_forward, torch_tensors
from sgl_jax.training import dflash as dflash_lib
from sgl_jax.training.objective import Batch

ROWS, LENGTH, ANCHORS, BLOCK = 2, 24, 5, 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("target")
    return json.loads((write_tiny_checkpoint(root, "qwen3") / "config.json").read_text())


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    path = write_tiny_dflash_draft(tmp_path_factory.mktemp("dflash"), target, block_size=BLOCK)
    return target, load_dflash_draft(str(path), dtype="float32", progress=False), path


@pytest.mark.parametrize("windows", [None, 6], ids=["full", "sliding"])
def test_block_states_match_the_published_objective_in_torch(target, windows, tmp_path):
    """With a sliding layer of window 6 a block query at p sees keys after p - 6 only."""
    layer_types = None if windows is None else ["sliding_attention", "full_attention"]
    path = write_tiny_dflash_draft(tmp_path, target, block_size=BLOCK, layer_types=layer_types,
                                   sliding_window=windows)
    draft = load_dflash_draft(str(path), dtype="float32", progress=False)
    rng = np.random.default_rng(0)
    h = target["hidden_size"]
    features = rng.standard_normal((ROWS, LENGTH, 2 * h)).astype(np.float32)
    ids = rng.integers(0, target["vocab_size"] - 1, (ROWS, LENGTH)).astype(np.int32)
    anchors = np.stack([rng.choice(LENGTH - 1, ANCHORS, replace=False)
                        for _ in range(ROWS)]).astype(np.int32)
    embed = rng.standard_normal((target["vocab_size"], h)).astype(np.float32)
    hidden = dflash_lib.block_hidden(draft.params, jnp.asarray(embed), jnp.asarray(features),
                                     jnp.asarray(ids), jnp.asarray(anchors),
                                     config=draft.config)
    weights = torch_tensors(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    for row in range(ROWS):
        blocks = torch.full((ANCHORS, BLOCK), draft.config.mask_token_id)
        blocks[:, 0] = torch.from_numpy(ids[row, anchors[row]])
        expected = torch_block_forward(weights, config, torch.from_numpy(features[row]),
                                        torch.from_numpy(embed)[blocks],
                                        torch.from_numpy(anchors[row]).long())
        np.testing.assert_allclose(np.asarray(hidden[row]), expected.detach().numpy(),
                                   rtol=2e-4, atol=2e-5)


def test_anchors_are_distinct_and_next_to_assistant_tokens():
    mask = np.zeros((2, 16), bool)
    mask[0, 5:9] = True  # eligible anchors 4..7
    mask[1, 15] = True  # eligible anchor 14 only
    anchors, real = dflash_lib.sample_anchors(jax.random.key(0), jnp.asarray(mask), 6)
    anchors, real = np.asarray(anchors), np.asarray(real)
    assert sorted(anchors[0][real[0]]) == [4, 5, 6, 7]
    assert anchors[1][real[1]].tolist() == [14]


def test_the_loss_weighs_block_positions_by_gamma(head):
    """Total = sum_k w_k * CE_k / sum_k w_k over scored positions, w_k = exp(-(k-1)/gamma),
    CE through the target's head against the row's tokens a + k."""
    target, draft, _ = head
    rng = np.random.default_rng(1)
    h, vocab = target["hidden_size"], target["vocab_size"]
    target_params = {"embed": jnp.asarray(rng.standard_normal((vocab, h)), jnp.float32),
                     "lm_head": jnp.asarray(rng.standard_normal((vocab, h)), jnp.float32)}
    target_model = SimpleNamespace(config=dense_config_from_hf(
        {**target, "tie_word_embeddings": False}))
    objective = dflash_lib.DFlashObjective(draft.config, target_model, num_anchors=ANCHORS,
                                           gamma=2.0)
    features = jnp.asarray(rng.standard_normal((ROWS, LENGTH, 2 * h)), jnp.float32)
    ids = rng.integers(0, vocab, (ROWS, LENGTH)).astype(np.int32)
    mask = np.zeros((ROWS, LENGTH), bool)
    mask[:, 6:20] = True
    batch = Batch(jnp.asarray(ids), jnp.asarray(mask))
    key = jax.random.key(3)
    total, result = objective.loss(draft.params, target_params, features, batch, key)
    anchors, real = (np.asarray(x) for x in dflash_lib.sample_anchors(key, batch.loss_mask,
                                                                      ANCHORS))
    hidden = np.array(dflash_lib.block_hidden(draft.params, target_params["embed"], features,
                                                batch.input_ids, jnp.asarray(anchors),
                                                config=draft.config))
    logits = torch.from_numpy(hidden[:, :, 1:]) @ torch.from_numpy(
        np.array(target_params["lm_head"])).T  # [R, A, B-1, V]; writable copies for torch
    num, den = 0.0, 0.0
    for r in range(ROWS):
        for j in range(ANCHORS):
            for k in range(1, BLOCK):
                at = anchors[r, j] + k
                if not real[r, j] or at >= LENGTH or not mask[r, at]:
                    continue
                ce = torch.nn.functional.cross_entropy(logits[r, j, k - 1][None],
                                                       torch.tensor([ids[r, at]]).long())
                w = np.exp(-(k - 1) / 2.0)
                num, den = num + w * float(ce), den + w
    np.testing.assert_allclose(float(total), num / den, rtol=1e-5)
    assert int(result.counts.sum()) > 0
