"""Training DSpark heads (models/dspark.py) with DeepSpec's objective, target frozen.

The blocks are DFlash's (training/dflash.py: the same random anchors, attention and
backbone), read anchor first: slot k (0..B-1) of the block anchored at a learns token
a + 1 + k. Its logits z_k are the lm_head logits plus the Markov term of the true token before
it (teacher forcing; the anchor's own token before slot 0). Over scored slots, weighted
w_k = exp(-k / gamma):
- CE: the cross-entropy of z_k against the token;
- TV: || softmax(z_k) - p_k ||_1, p_k the target's own next-token distribution at a + k;
- BCE: the confidence logit l_k against c_k = clamp(1 - TV_k / 2, 0, 1), held fixed (the
  chance that a draft from z_k is accepted by a sampler of p_k);
total = 0.1 CE + 0.9 TV + 1.0 BCE (the BCE term only with a confidence head). The head's
embed_tokens and lm_head are frozen copies of the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers.weights import checkpoint_tensors
from sgl_jax.models import dspark
from sgl_jax.models.dspark import DSparkConfig
from sgl_jax.models.loader import LoadedModel, load_params
from sgl_jax.parallel import TensorParallel
from sgl_jax.training import dflash as dflash_lib
from sgl_jax.training.calibration import confidence_bins
from sgl_jax.training.dflash import BlockLoss
from sgl_jax.training.draft import INIT_STD, ArraySource, save_head, target_output_rows
from sgl_jax.training.objective import Batch
from sgl_jax.training.target import TargetOutputs, target_outputs

DEFAULT_GAMMA = 4.0  # DeepSpec's loss_decay_gamma
CE_WEIGHT, TV_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0
# DeepSpec's shipped heads: a block of 7, a rank-256 vanilla Markov head, a confidence head
# reading the Markov embedding too.
DEFAULTS = {"block_size": 7, "markov_rank": 256, "markov_head_type": "vanilla",
            "enable_confidence_head": True, "confidence_head_with_markov": True}
_BACKBONE_FIELDS = ("mask_token_id", "target_layer_ids")  # DFlash keeps them in dflash_config


def dspark_hf_config(target_hf: dict[str, Any], overrides: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """A head's config.json in DeepSpec's layout: DFlash's (dflash_hf_config) with its
    fields at the top level, DEFAULTS, then `overrides`."""
    overrides = dict(overrides or {})
    backbone = {k: overrides.pop(k) for k in _BACKBONE_FIELDS if k in overrides}
    config = dflash_lib.dflash_hf_config(target_hf, {**DEFAULTS, **overrides,
                                                     "dflash_config": backbone})
    config.update(config.pop("dflash_config"), architectures=[dspark.ARCHITECTURE])
    if not config["markov_rank"]:
        config.pop("markov_head_type", None)
        config["confidence_head_with_markov"] = False
    return config


def initial_tensors(config: DSparkConfig, target: LoadedModel, seed: int
                    ) -> dict[str, np.ndarray]:
    """A fresh head's tensors: the backbone's as DFlash starts it, the target's embedding
    and output rows copied, the heads N(0, INIT_STD) with zero biases."""
    tensors = dflash_lib.initial_tensors(config.backbone, seed)
    vocab = config.vocab_size
    tensors["embed_tokens.weight"] = np.asarray(target.params["embed"], np.float32)[:vocab]
    tensors["lm_head.weight"] = target_output_rows(target)
    rng = np.random.default_rng(seed + 1)
    for name, spec in dspark.hf_weight_specs(config).items():
        if name.startswith(("markov_head.", "confidence_head.")):
            tensors[name] = (np.zeros(spec.shape, np.float32) if name.endswith(".bias") else
                             (INIT_STD * rng.standard_normal(spec.shape)).astype(np.float32))
    return tensors


def place_head(config: DSparkConfig, tensors: dict[str, np.ndarray], dtype: Any,
               tp: TensorParallel) -> dict[str, Any]:
    """Checkpoint tensors -> the head's parameter pytree on the mesh, through the loader."""
    return load_params(ArraySource(tensors), dspark.hf_weight_specs(config), dtype,
                       config=config.backbone.layer, tp=tp, progress=False,
                       what="the DSpark head")


def export_head(path: str | Path, hf_config: dict[str, Any], params: dict[str, Any],
                dtype: str = "bfloat16") -> Path:
    """config.json + model.safetensors in DeepSpec's layout (`params`: host arrays)."""
    config = dspark.config_from_hf(hf_config)
    return save_head(path, hf_config,
                     checkpoint_tensors(params, dspark.hf_weight_specs(config)), dtype)


class DSparkObjective:
    frozen = ("embed", "lm_head")

    def __init__(self, config: DSparkConfig, *, num_anchors: int,
                 gamma: float = DEFAULT_GAMMA):
        self.config, self.num_anchors, self.gamma = config, num_anchors, gamma

    def target(self, target: LoadedModel, target_params, batch: Batch) -> TargetOutputs:
        """The captured layers' outputs f[R, T, F] and next-token logits f32[R, T, V]."""
        return target_outputs(target, target_params, batch.input_ids,
                              self.config.backbone.capture_layers)

    def loss(self, draft_params, target_params, outputs: TargetOutputs, batch: Batch, key
             ) -> tuple[jax.Array, BlockLoss]:
        anchors, real = dflash_lib.sample_anchors(key, batch.loss_mask, self.num_anchors)
        dtype = draft_params["fc"].dtype
        hidden = dflash_lib.block_hidden(
            draft_params, draft_params["embed"].astype(dtype), outputs.features.astype(dtype),
            batch.input_ids, anchors, config=self.config.backbone)  # f[R, A, B, H]
        width = self.config.backbone.block_size
        length = batch.input_ids.shape[1]
        at = anchors[..., None] + jnp.arange(width + 1)  # positions a .. a + B
        inside = at[..., 1:] < length
        at = jnp.minimum(at, length - 1)
        rows = jnp.arange(at.shape[0])[:, None, None]
        tokens = batch.input_ids[rows, at]  # i32[R, A, B + 1]
        scored = real[..., None] & inside & batch.loss_mask[rows, at[..., 1:]]
        scores = jax.lax.map(
            lambda row: slot_scores(draft_params, self.config, row[0], row[1],
                                    row[3][row[2]]),  # one row's [A, B, V] logits at a time
            (hidden, tokens, at[..., :-1], outputs.logits))
        nll, tv, bce, hits, confidence = scores
        total = weighted_objective(nll, tv, bce, scored, gamma=self.gamma,
                                   confidence=self.config.confidence)
        metrics = dflash_lib.block_metrics(total, nll, hits, scored)
        if not self.config.confidence:
            return total, metrics
        # Judged against both acceptances: a sampler's (the head's target) and greedy's.
        outcomes = (jnp.clip(1 - tv / 2, 0.0, 1.0), hits.astype(jnp.float32))
        return total, metrics._replace(confidence_bins=jnp.stack(
            [confidence_bins(confidence, outcome, scored) for outcome in outcomes]))


def slot_scores(
    params,
    config: DSparkConfig,
    hidden: jax.Array,  # f[A, B, H]: blocks' slot outputs
    tokens: jax.Array,  # i32[A, B + 1]: each block's anchor token, then the B it learns
    target_logits: jax.Array,  # f[A, B, V]: the target's next-token logits at a .. a + B - 1
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each slot's cross-entropy, total variation from the target's distribution and
    confidence BCE f32[A, B], whether its argmax is the token bool[A, B], and its confidence
    logit f32[A, B]."""
    logits, confidence = dspark.teacher_forced_logits(params, config, hidden, tokens[:, :-1])
    labels = tokens[:, 1:]
    log_draft = jax.nn.log_softmax(logits, -1)
    target_probs = jax.nn.softmax(target_logits.astype(jnp.float32), -1)
    nll = -jnp.take_along_axis(log_draft, labels[..., None], -1)[..., 0]
    tv = jnp.sum(jnp.abs(jnp.exp(log_draft) - target_probs), -1)
    accepted = jax.lax.stop_gradient(jnp.clip(1 - tv / 2, 0.0, 1.0))
    bce = jax.nn.softplus(confidence) - confidence * accepted
    return nll, tv, bce, jnp.argmax(logits, -1) == labels, confidence


def weighted_objective(nll: jax.Array, tv: jax.Array, bce: jax.Array, scored: jax.Array, *,
                       gamma: float, confidence: bool) -> jax.Array:
    """0.1 CE + 0.9 TV (+ 1.0 BCE with a confidence head), each the mean over scored slots
    [..., B] weighted exp(-k / gamma) by slot k."""
    weights = jnp.exp(-jnp.arange(nll.shape[-1], dtype=jnp.float32) / gamma) * scored
    norm = jnp.maximum(jnp.sum(weights), 1e-9)
    total = (CE_WEIGHT * jnp.sum(weights * nll) + TV_WEIGHT * jnp.sum(weights * tv)) / norm
    if confidence:
        total = total + CONFIDENCE_WEIGHT * jnp.sum(weights * bce) / norm
    return total
