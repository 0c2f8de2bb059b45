"""Training DFlash heads (models/dflash.py) with the published objective, target frozen.

Each row of a batch gets `num_anchors` random anchors among the positions whose next token is
an assistant token. The block of anchor a is [token a, MASK x (B-1)] at positions a..a+B-1;
it sees the context (the target's captured states, through fc and hidden_norm, as serving
writes them) strictly before a, and the whole block non-causally, but no other block: what
serving runs when a is the last verified token. Block position k (1..B-1) learns token a + k
by cross-entropy weighted exp(-(k-1)/gamma), so the early positions, which every accepted
draft needs, weigh most.

The block forward is the serving one (`dflash.block_forward`) with `anchored_attention` in
place of the paged cache; context keys and values come from `dflash.context_keys_values`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers.weights import checkpoint_tensors
from sgl_jax.models import dflash, llama
from sgl_jax.models.dflash import DFlashConfig
from sgl_jax.models.loader import LoadedModel, load_params
from sgl_jax.parallel import TensorParallel
from sgl_jax.training.draft import INIT_STD, ArraySource, save_head
from sgl_jax.training.objective import Batch
from sgl_jax.training.target import target_outputs
from sgl_jax.training.ttt import StepCache

DEFAULT_LAYERS = 5  # the published b16 heads' depth
DEFAULT_BLOCK = 16
DEFAULT_GAMMA = 7.0
_MASKED = -1e30
_TARGET_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "rope_scaling", "rope_parameters", "max_position_embeddings", "vocab_size")


class BlockLoss(NamedTuple):
    total: jax.Array  # f32[]: the objective (DFlash: the weighted cross-entropy)
    losses: jax.Array  # f32[S]: mean cross-entropy of each drafting slot (DFlash: 1..B-1)
    accuracies: jax.Array  # f32[S]: how often the slot's argmax is the token
    counts: jax.Array  # i32[S]: slots scored
    accepted: jax.Array  # f32[]: mean leading correct drafts per anchor (greedy acceptance)
    # f32[2, 2, G, B, K, 3]: DSpark's confidence head against a sampler's and greedy
    # acceptance (calibration.confidence_bins each)
    confidence_bins: jax.Array | None = None


# --------------------------------------------------------------------------- the head


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` target layers spread evenly from layer 1 to layer L-3 (z-lab's choice:
    Qwen3-8B's 36 layers give [1, 9, 17, 25, 33])."""
    last = max(num_target_layers - 3, 1)
    return sorted({int(round(x)) for x in np.linspace(1, last, count)})


def dflash_hf_config(target_hf: dict[str, Any], overrides: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """A head's config.json in the z-lab layout: Qwen3 layers as wide as the target (its
    rotary settings), DEFAULT_LAYERS of them, a block of DEFAULT_BLOCK; the mask token is
    the last id of the target's vocabulary. `overrides` win (dflash_config keys included)."""
    overrides = dict(overrides or {})
    dflash_overrides = overrides.pop("dflash_config", {})
    config = {k: target_hf[k] for k in _TARGET_FIELDS if target_hf.get(k) is not None}
    rope = target_hf.get("rope_parameters") or {}
    config["rope_theta"] = target_hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    config.update({"architectures": [dflash.ARCHITECTURE], "model_type": "qwen3",
                   "num_hidden_layers": DEFAULT_LAYERS, "hidden_act": "silu",
                   "tie_word_embeddings": False, "block_size": DEFAULT_BLOCK,
                   "num_target_layers": target_hf["num_hidden_layers"]})
    config.update(overrides)
    layers = config["num_hidden_layers"]
    config.setdefault("layer_types", ["full_attention"] * layers)
    config["dflash_config"] = {
        "mask_token_id": target_hf["vocab_size"] - 1,
        "target_layer_ids": default_target_layer_ids(target_hf["num_hidden_layers"], layers),
        **dflash_overrides}
    return config


def initial_tensors(config: DFlashConfig, seed: int) -> dict[str, np.ndarray]:
    """A fresh head's checkpoint tensors: the final norm at zero, so the first logits are all
    zero (a uniform guess; a norm at one puts the mask token's own embedding through the
    target's lm_head, a confident wrong guess whose gradients swamp the first steps); other
    norms at one, matrices N(0, INIT_STD)."""
    rng = np.random.default_rng(seed)
    tensors = {name: (np.ones(spec.shape, np.float32) if name.endswith("norm.weight") else
                      (INIT_STD * rng.standard_normal(spec.shape)).astype(np.float32))
               for name, spec in dflash.hf_weight_specs(config).items()}
    tensors["norm.weight"] = np.zeros_like(tensors["norm.weight"])
    return tensors


def place_head(config: DFlashConfig, tensors: dict[str, np.ndarray], dtype: Any,
               tp: TensorParallel) -> dict[str, Any]:
    """Checkpoint tensors -> the head's parameter pytree on the mesh, through the loader."""
    return load_params(ArraySource(tensors), dflash.hf_weight_specs(config), dtype,
                       config=config.layer, tp=tp, progress=False, what="the DFlash head")


def export_head(path: str | Path, hf_config: dict[str, Any], params: dict[str, Any],
                dtype: str = "bfloat16") -> Path:
    """config.json + model.safetensors in the z-lab layout (`params`: host arrays)."""
    config = dflash.config_from_hf(hf_config)
    return save_head(path, hf_config,
                     checkpoint_tensors(params, dflash.hf_weight_specs(config)), dtype)


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AnchoredBlocks:
    """Attention metadata of a training batch's blocks: row r's block j is anchored at
    anchors[r, j]; `context` target positions per row."""

    anchors: jax.Array  # i32[R, A]
    context: int
    block_size: int


jax.tree_util.register_dataclass(AnchoredBlocks, data_fields=["anchors"],
                                 meta_fields=["context", "block_size"])


def anchored_attention(
    q: jax.Array,  # [R*A*B, n_heads, hd]: the blocks' queries, row-major
    k: jax.Array,  # [R*A*B, n_kv, hd]: the blocks' own keys
    v: jax.Array,
    layer_kv: tuple[jax.Array, jax.Array],  # context keys, values [R*C, n_kv, hd]
    metadata: AnchoredBlocks,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """An `AttentionBackend` for training: a block query sees its row's context before its
    anchor and every key of its own block (within `sliding_window` positions when set)."""
    anchors = metadata.anchors
    rows, num_anchors = anchors.shape
    width, num_kv, hd = metadata.block_size, k.shape[1], k.shape[2]
    groups = q.shape[1] // num_kv
    queries = q.reshape(rows, num_anchors, width, num_kv, groups, hd)
    context_k, context_v = (x.reshape(rows, metadata.context, num_kv, hd) for x in layer_kv)
    block_k, block_v = (x.reshape(rows, num_anchors, width, num_kv, hd) for x in (k, v))
    to_context = jnp.einsum("rabngd,rcnd->rngabc", queries, context_k,
                            preferred_element_type=jnp.float32) * scale
    to_block = jnp.einsum("rabngd,raknd->rngabk", queries, block_k,
                          preferred_element_type=jnp.float32) * scale
    query_pos = anchors[:, :, None] + jnp.arange(width)  # i32[R, A, B]
    context_pos = jnp.arange(metadata.context)
    sees_context = context_pos[None, None, None, :] < anchors[:, :, None, None]  # [R, A, 1, C]
    sees_block = jnp.ones((1, 1, width, width), bool)
    if sliding_window is not None:
        sees_context &= query_pos[..., None] - context_pos < sliding_window
        sees_block &= (jnp.arange(width)[:, None] - jnp.arange(width)) < sliding_window
    to_context = jnp.where(sees_context[:, None, None], to_context, _MASKED)
    to_block = jnp.where(sees_block[:, None, None], to_block, _MASKED)
    probs = jax.nn.softmax(jnp.concatenate([to_context, to_block], -1), -1).astype(q.dtype)
    out = (jnp.einsum("rngabc,rcnd->rabngd", probs[..., : metadata.context], context_v)
           + jnp.einsum("rngabk,raknd->rabngd", probs[..., metadata.context:], block_v))
    return out.reshape(q.shape), layer_kv


# --------------------------------------------------------------------------- the objective


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int
                   ) -> tuple[jax.Array, jax.Array]:
    """Up to `num_anchors` distinct random anchors per row among positions whose next token is
    an assistant token: anchors i32[R, A] and whether each is real bool[R, A]."""
    eligible = jnp.pad(loss_mask[:, 1:], ((0, 0), (0, 1)))  # bool[R, T]
    scores = jnp.where(eligible, jax.random.uniform(key, loss_mask.shape), -1.0)
    chosen, anchors = jax.lax.top_k(scores, num_anchors)
    return anchors.astype(jnp.int32), chosen >= 0


def block_hidden(params, embed: jax.Array, features: jax.Array, input_ids: jax.Array,
                 anchors: jax.Array, *, config: DFlashConfig) -> jax.Array:
    """The final-normed block states f[R, A, B, H] of blocks anchored at `anchors` i32[R, A],
    over each row's context `features` f[R, T, F] and tokens `input_ids` i32[R, T]."""
    rows, length = input_ids.shape
    width = config.block_size
    positions = jnp.arange(length, dtype=jnp.int32)
    context = dflash.context_keys_values(params, features.reshape(rows * length, -1),
                                         jnp.tile(positions, rows), config)
    first = jnp.take_along_axis(input_ids, anchors, axis=1)  # i32[R, A]
    blocks = jnp.full((*anchors.shape, width), config.mask_token_id, jnp.int32)
    blocks = blocks.at[..., 0].set(first)
    block_pos = anchors[..., None] + jnp.arange(width, dtype=jnp.int32)
    hidden, _ = dflash.block_forward(
        params, StepCache(tuple(context)), blocks.reshape(-1), block_pos.reshape(-1),
        AnchoredBlocks(anchors, length, width), config=config, attention=anchored_attention,
        embed=embed)
    return hidden.reshape(*anchors.shape, width, -1)


class DFlashObjective:
    frozen: tuple[str, ...] = ()

    def __init__(self, config: DFlashConfig, target: LoadedModel, *, num_anchors: int,
                 gamma: float = DEFAULT_GAMMA):
        self.config, self.target_config = config, target.config
        self.num_anchors, self.gamma = num_anchors, gamma

    def target(self, target: LoadedModel, target_params, batch: Batch) -> jax.Array:
        """f[R, T, F]: the captured layers' outputs (the target's logits are not needed)."""
        return target_outputs(target, target_params, batch.input_ids,
                              self.config.capture_layers).features

    def loss(self, draft_params, target_params, features, batch: Batch, key
             ) -> tuple[jax.Array, BlockLoss]:
        anchors, real = sample_anchors(key, batch.loss_mask, self.num_anchors)
        hidden = block_hidden(draft_params, target_params["embed"],
                              features.astype(draft_params["fc"].dtype), batch.input_ids,
                              anchors, config=self.config)
        labels, scored = self._labels(batch, anchors, real)
        nll, hits = jax.lax.map(lambda row: self._row_scores(target_params, *row),
                                (hidden[:, :, 1:], labels))  # f32, bool [R, A, B-1]
        return self._reduce(nll, hits, scored)

    def _labels(self, batch: Batch, anchors, real):
        """The token each block position 1..B-1 learns i32[R, A, B-1], and whether it is
        scored (a real anchor, an assistant token inside the row)."""
        length = batch.input_ids.shape[1]
        at = anchors[..., None] + jnp.arange(1, self.config.block_size)
        inside = at < length
        at = jnp.minimum(at, length - 1)
        rows = jnp.arange(at.shape[0])[:, None, None]
        return batch.input_ids[rows, at], real[..., None] & inside & batch.loss_mask[rows, at]

    def _row_scores(self, target_params, hidden, labels):
        """One row's cross-entropy and hits f32, bool [A, B-1] through the target's head
        (a row at a time keeps the logits [A, B-1, V] of one row alive)."""
        shape = labels.shape
        logits = llama.compute_logits(target_params, hidden.reshape(-1, hidden.shape[-1]),
                                      self.target_config)
        flat = labels.reshape(-1)
        nll = (jax.nn.logsumexp(logits, -1)
               - jnp.take_along_axis(logits, flat[:, None], -1)[:, 0])
        return nll.reshape(shape), (jnp.argmax(logits, -1) == flat).reshape(shape)

    def _reduce(self, nll, hits, scored) -> tuple[jax.Array, BlockLoss]:
        positions = jnp.arange(self.config.block_size - 1, dtype=jnp.float32)
        weights = jnp.exp(-positions / self.gamma) * scored  # f32[R, A, B-1]
        total = jnp.sum(weights * nll) / jnp.maximum(jnp.sum(weights), 1e-9)
        return total, block_metrics(total, nll, hits, scored)


def block_metrics(total: jax.Array, nll: jax.Array, hits: jax.Array, scored: jax.Array
                  ) -> BlockLoss:
    """The metrics of drafted block slots, each f32/bool[R, A, S]: per slot the mean
    cross-entropy and accuracy over scored slots, and greedy acceptance (drafts counted until
    the first miss or the first unscored one)."""
    counts = jnp.sum(scored, axis=(0, 1))
    denominator = jnp.maximum(counts, 1).astype(jnp.float32)
    losses = jnp.sum(jnp.where(scored, nll, 0.0), axis=(0, 1)) / denominator
    accuracies = jnp.sum(scored & hits, axis=(0, 1)) / denominator
    leading = jnp.sum(jnp.cumprod(scored & hits, axis=-1), axis=-1)  # [R, A]
    anchored = scored[..., 0]
    accepted = (jnp.sum(jnp.where(anchored, leading, 0))
                / jnp.maximum(jnp.sum(anchored), 1).astype(jnp.float32))
    return BlockLoss(total, losses, accuracies, counts.astype(jnp.int32), accepted)
