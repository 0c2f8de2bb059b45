"""DSpark's training objective against a reference written here from its definition: per
slot the cross-entropy of the Markov-corrected logits (teacher-forced: the true token before
each slot), their L1 distance from the target's distribution, and the confidence head's BCE
against clamp(1 - TV / 2, 0, 1); 0.1 CE + 0.9 TV + 1.0 BCE, each averaged over scored slots
weighted exp(-k / gamma)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import torch

from sgl_jax.models.loader import load_dspark_draft
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.dspark import write_tiny_dspark_draft
from sgl_jax.testing.torch_reference import dspark_heads, torch_tensors
from sgl_jax.training import dspark as dspark_lib

BLOCKS, BLOCK, GAMMA = 3, 5, 4.0


def reference_objective(w, cfg, hidden, tokens, target_logits, scored):
    """The objective and per-slot (CE, TV, BCE) [A, B] from their definitions, block by block."""
    ce, tv, bce, logit = (torch.zeros(scored.shape) for _ in range(4))
    for a in range(hidden.shape[0]):
        logits, confidence = dspark_heads(w, cfg, hidden[a], tokens[a, :-1])
        logit[a] = confidence
        for k in range(hidden.shape[1]):
            draft = torch.softmax(logits[k], -1)
            ce[a, k] = -torch.log(draft[tokens[a, k + 1]])
            tv[a, k] = (draft - torch.softmax(target_logits[a, k], -1)).abs().sum()
            accepted = float(torch.clamp(1 - tv[a, k] / 2, 0, 1))
            bce[a, k] = torch.nn.functional.binary_cross_entropy_with_logits(
                confidence[k], torch.tensor(accepted))
    weights = torch.exp(-torch.arange(BLOCK) / GAMMA) * scored
    mean = lambda x: (weights * x).sum() / weights.sum()  # noqa: E731
    return 0.1 * mean(ce) + 0.9 * mean(tv) + 1.0 * mean(bce), (ce, tv, bce, logit)


def test_slot_scores_and_objective_match_the_definition(tmp_path):
    """With an rnn head (its state along each block); the heads themselves are checked one
    by one in test/models/test_dspark.py."""
    target = write_tiny_checkpoint(tmp_path / "target", "qwen3")
    path = write_tiny_dspark_draft(tmp_path / "head", json.loads(
        (target / "config.json").read_text()), markov_head="rnn", block_size=BLOCK)
    draft = load_dspark_draft(str(path), dtype="float32", progress=False)
    cfg = json.loads((path / "config.json").read_text())
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((BLOCKS, BLOCK, cfg["hidden_size"])).astype(np.float32)
    tokens = rng.integers(cfg["vocab_size"], size=(BLOCKS, BLOCK + 1)).astype(np.int32)
    target_logits = (2 * rng.standard_normal((BLOCKS, BLOCK, cfg["vocab_size"]))
                     ).astype(np.float32)
    scored = rng.random((BLOCKS, BLOCK)) < 0.8

    nll, tv, bce, _, confidence = dspark_lib.slot_scores(
        draft.params, draft.config, jnp.asarray(hidden), jnp.asarray(tokens),
        jnp.asarray(target_logits))
    total = dspark_lib.weighted_objective(nll, tv, bce, jnp.asarray(scored), gamma=GAMMA,
                                          confidence=True)
    with torch.no_grad():
        expected, parts = reference_objective(
            torch_tensors(path / "model.safetensors"), cfg, torch.from_numpy(hidden),
            torch.from_numpy(tokens).long(), torch.from_numpy(target_logits),
            torch.from_numpy(scored))
    for ours, theirs in zip((nll, tv, bce, confidence), parts, strict=True):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(total), float(expected), rtol=1e-5)

    # The confidence target is held fixed: no gradient reaches the draft's logits through it.
    def bce_only(hidden):
        _, _, bce, _, _ = dspark_lib.slot_scores(draft.params, draft.config, hidden,
                                                 jnp.asarray(tokens), jnp.asarray(target_logits))
        return bce.sum()

    grad = jax.grad(bce_only)(jnp.asarray(hidden))
    confidence_w = np.asarray(draft.params["confidence"]["w"])[0, : cfg["hidden_size"]]
    np.testing.assert_allclose(np.asarray(grad), np.broadcast_to(
        np.asarray(grad)[..., :1] / confidence_w[0] * confidence_w, grad.shape),
        rtol=1e-4, atol=1e-6)
