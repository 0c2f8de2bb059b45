"""The draft models behind one interface, and the EAGLE-2 tree they grow.

- `Eagle3Draft`: the EAGLE3 head. Its KV slot j holds the pair (target features of token j,
  token j+1) at position j, so after an extend its last output already predicts the first draft
  token; later steps feed back its own pre-norm output in place of the target features.
- `EagleDraft`: an EAGLE v1 / v2 head, paired the same way but fed the target's final hidden
  state, with fc applied at every step and the target's lm_head for logits.
- `NextnDraft`: Qwen3-Next's own multi-token-prediction layer, paired as EAGLE's head is,
  fed the target's final-norm hidden state and, at later steps, its own normed output.
- `StandaloneDraft` (standalone.py): an ordinary small model with the target's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from sgl_jax.layers import gated_delta_net
from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, ModelCache
from sgl_jax.layers.sampler import vocab_top_k
from sgl_jax.model_executor.forward_batch import window_metadata
from sgl_jax.models import llama, llama_eagle, llama_eagle3, qwen3_next_mtp
from sgl_jax.models.config import ModelConfig
from sgl_jax.models.loader import LoadedDraft, LoadedModel
from sgl_jax.speculative.config import TreeShape
from sgl_jax.speculative.tree import DraftTree, ancestor_mask, node_depths, select_tree

Params = dict[str, Any]


class DraftModel(Protocol):
    cache_config: ModelConfig  # shapes of the draft's own paged KV cache
    params: Params  # everything its forward needs, shared target arrays included
    uses_target_features: bool  # consumes target hidden states (EAGLE, EAGLE3)
    feature_source: str  # "aux": the captured layers (EAGLE3); "final": the last hidden state
    root_in_window: bool  # the root token is re-run in every draft window
    recurrent: bool  # keeps a recurrent state per request (a hybrid STANDALONE draft)

    def forward(self, params: Params, kv: ModelCache, tokens: jax.Array,
                positions: jax.Array, inputs: jax.Array | None, metadata: AttentionMetadata,
                *, from_target: bool) -> tuple[jax.Array, ModelCache]: ...

    def logits(self, params: Params, hidden: jax.Array) -> jax.Array: ...

    def to_target(self, params: Params, draft_ids: jax.Array) -> jax.Array: ...


class Eagle3Draft:
    uses_target_features = True
    feature_source = "aux"
    root_in_window = False
    recurrent = False

    def __init__(self, draft: LoadedDraft, target: LoadedModel, attention: AttentionBackend):
        config, own = draft.config, draft.params
        target_params = target.params
        self.config = config
        self.cache_config = config.layer
        self.attention = attention
        self.params = {
            "layer": {k: v for k, v in own.items() if k not in ("embed", "lm_head")},
            "embed": own.get("embed", target_params["embed"]),
            "lm_head": own.get("lm_head", target_head(target)),
        }

    def forward(self, params, kv, tokens, positions, inputs, metadata, *, from_target):
        return llama_eagle3.forward(
            params["layer"], kv, tokens, positions, inputs, metadata, config=self.config,
            attention=self.attention, embed=params["embed"], from_target=from_target,
        )

    def logits(self, params, hidden):
        return llama_eagle3.compute_logits(params["layer"], hidden, self.config,
                                           params["lm_head"])

    def to_target(self, params, draft_ids):
        return llama_eagle3.draft_to_target_ids(draft_ids, params["layer"])


class EagleDraft:
    uses_target_features = True
    feature_source = "final"
    root_in_window = False
    recurrent = False

    def __init__(self, draft: LoadedDraft, target: LoadedModel, attention: AttentionBackend):
        own, target_params = draft.params, target.params
        self.config = self.cache_config = draft.config
        self.attention = attention
        self.params = {
            "layers": {k: v for k, v in own.items() if k != "embed"},
            "embed": own.get("embed", target_params["embed"]),
            "lm_head": target_head(target),
        }

    def forward(self, params, kv, tokens, positions, inputs, metadata, *, from_target):
        return llama_eagle.forward(params["layers"], kv, tokens, positions, inputs, metadata,
                                   config=self.config, attention=self.attention,
                                   embed=params["embed"])

    def logits(self, params, hidden):
        return target_head_logits(params["lm_head"], hidden, self.config.vocab_size)

    def to_target(self, params, draft_ids):
        return draft_ids


class NextnDraft(EagleDraft):
    """Qwen3-Next's own multi-token-prediction module (models/qwen3_next_mtp.py), paired
    as an EAGLE head is: slot j holds (the target's final-norm hidden state at j, token j+1),
    and later draft steps feed back the module's normed output."""

    def __init__(self, draft: LoadedDraft, target: LoadedModel, attention: AttentionBackend):
        self.config = self.cache_config = draft.config
        self.attention = attention
        self.params = {"mtp": draft.params, "embed": target.params["embed"],
                       "lm_head": target_head(target)}

    def forward(self, params, kv, tokens, positions, inputs, metadata, *, from_target):
        return qwen3_next_mtp.forward(params["mtp"], kv, tokens, positions, inputs, metadata,
                                      config=self.config, attention=self.attention,
                                      embed=params["embed"])


def target_head(target: LoadedModel) -> jax.Array:
    """The target's lm_head [V', H] (its embedding when the two are tied)."""
    tied = target.config.tie_word_embeddings
    return target.params["embed"] if tied else target.params["lm_head"]


def target_head_logits(lm_head: jax.Array, hidden: jax.Array, vocab_size: int) -> jax.Array:
    """f32[N, V]: the target's lm_head [V', H] over hidden f[N, H] (V' > V when the table is
    padded for sharding: those rows are dropped)."""
    logits = llama.matmul_rows(hidden, lm_head, preferred_element_type=jnp.float32)
    return logits[:, :vocab_size]


def grow_tree(
    draft: DraftModel,
    params: Params,
    kv: ModelCache,
    root_tokens: jax.Array,  # i32[B]: the last committed token of each request
    root_hidden: jax.Array | None,  # f[B, H]: EAGLE3's output at the root pair, fed forward
    root_logits: jax.Array | None,  # f32[B, Vd]: EAGLE3's prediction of the first draft token
    prefix_lens: jax.Array,  # i32[B]: draft KV entries already valid (the committed tokens)
    page_table: jax.Array,  # i32[B, P]
    active: jax.Array,  # bool[B]: padding rows write nothing
    *,
    shape: TreeShape,
    page_size: int,
    state_slots: jax.Array | None = None,  # i32[B]: a recurrent draft's state slots
) -> tuple[DraftTree, ModelCache]:
    """EAGLE-2 drafting: expand the best `topk` nodes by `topk` children for `num_steps`
    levels, then keep the best N-1 candidates by cumulative log-probability.

    Each step re-runs all frontier nodes so far in one window with an ancestor mask (a node
    sees the committed prefix, its ancestors and itself); re-running keeps the attention to
    "prefix + window" and costs a few extra rows of a one-layer draft.
    """
    steps, k = shape.num_steps, shape.topk
    batch = root_tokens.shape[0]
    window = _Window.start(root_tokens, draft.root_in_window)
    if root_logits is None:  # the root's prediction comes from running it
        hidden, kv = _run_window(draft, params, kv, window, prefix_lens, page_table, active,
                                 page_size, state_slots)
        root_logits = draft.logits(params, hidden[:, 0])
    scores, ids = vocab_top_k(jax.nn.log_softmax(root_logits, axis=-1), k)  # [B, K]
    tokens = draft.to_target(params, ids)
    candidates = [(scores, tokens, jnp.full((batch, k), -1, jnp.int32))]
    frontier = _Frontier(
        candidate=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k)),
        scores=scores, tokens=tokens,
        window_parent=jnp.full((batch, k), 0 if draft.root_in_window else -1, jnp.int32),
        inputs=None if root_hidden is None else jnp.repeat(root_hidden[:, None], k, axis=1),
    )
    num_candidates = k
    for step in range(1, steps):
        window = window.append(frontier)
        hidden, kv = _run_window(draft, params, kv, window, prefix_lens, page_table, active,
                                 page_size, state_slots)
        frontier_hidden = hidden[:, -k:]  # [B, K, H]
        logp = jax.nn.log_softmax(draft.logits(params, frontier_hidden.reshape(batch * k, -1)))
        child_logp, child_ids = vocab_top_k(logp.reshape(batch, k, -1), k)  # [B, K, K]
        child_scores = (frontier.scores[:, :, None] + child_logp).reshape(batch, k * k)
        child_tokens = draft.to_target(params, child_ids).reshape(batch, -1)
        child_parents = jnp.repeat(frontier.candidate, k, axis=1)
        candidates.append((child_scores, child_tokens, child_parents))
        if step < steps - 1:
            fed_back = frontier_hidden if draft.uses_target_features else None
            frontier = _next_frontier(child_scores, child_tokens, fed_back, num_candidates,
                                      window.size - k, k)
        num_candidates += k * k
    scores, tokens, parents = (jnp.concatenate(part, axis=1)
                               for part in zip(*candidates, strict=True))
    tree = select_tree(root_tokens, scores, tokens, parents, shape.num_draft_tokens)
    return tree, kv


@dataclass(frozen=True)
class _Frontier:
    """The nodes expanded at the next step."""

    candidate: jax.Array  # i32[B, K]: their candidate indices
    scores: jax.Array  # f32[B, K]: cumulative log-probabilities
    tokens: jax.Array  # i32[B, K]
    window_parent: jax.Array  # i32[B, K]: their parents' window indices (-1 = outside)
    inputs: jax.Array | None  # f[B, K, H]: their parents' outputs (EAGLE3)


def _next_frontier(child_scores, child_tokens, frontier_hidden, candidate_offset,
                   window_offset, k) -> _Frontier:
    """The best k children (by cumulative score) of the frontier just run."""
    scores, best = jax.lax.top_k(child_scores, k)  # [B, K]
    parent = best // k  # which frontier node each came from
    return _Frontier(
        candidate=(candidate_offset + best).astype(jnp.int32),
        scores=scores,
        tokens=jnp.take_along_axis(child_tokens, best, axis=1),
        window_parent=(window_offset + parent).astype(jnp.int32),
        inputs=(None if frontier_hidden is None
                else jnp.take_along_axis(frontier_hidden, parent[:, :, None], axis=1)),
    )


@dataclass(frozen=True)
class _Window:
    """The draft tokens run together in one step: [root,] then the frontiers, depth by depth."""

    tokens: jax.Array  # i32[B, W]
    parents: jax.Array  # i32[B, W]: window index of each node's parent, -1 = none
    inputs: jax.Array | None  # f[B, W, H]: hidden state fed with each token (EAGLE3)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def start(cls, root_tokens: jax.Array, with_root: bool) -> _Window:
        width = 1 if with_root else 0
        batch = root_tokens.shape[0]
        return cls(root_tokens[:, None][:, :width], jnp.full((batch, width), -1, jnp.int32),
                   None)

    def append(self, frontier: _Frontier) -> _Window:
        inputs = frontier.inputs
        if inputs is not None and self.inputs is not None:
            inputs = jnp.concatenate([self.inputs, inputs], axis=1)
        return _Window(jnp.concatenate([self.tokens, frontier.tokens], axis=1),
                       jnp.concatenate([self.parents, frontier.window_parent], axis=1), inputs)


def _run_window(draft, params, kv, window: _Window, prefix_lens, page_table, active,
                page_size, state_slots=None) -> tuple[jax.Array, ModelCache]:
    """hidden f[B, W, H] of every window node; a node at depth d sits at prefix_len + d
    counted from the first node after the committed prefix."""
    batch, width = window.tokens.shape
    positions = prefix_lens[:, None] + node_depths(window.parents)
    metadata = window_metadata(page_table, prefix_lens, jnp.where(active, width, 0), width,
                               page_size, ancestor_mask(window.parents))
    inputs = None if window.inputs is None else window.inputs.reshape(batch * width, -1)
    extra = {}
    if draft.recurrent:  # each window node from its parent's state; the pools stay as they are
        extra["tree"] = gated_delta_net.TreeLayout(
            jnp.where(active, state_slots, 0), window.parents,
            jnp.broadcast_to(active[:, None], window.parents.shape))
    hidden, kv = draft.forward(params, kv, window.tokens.reshape(-1), positions.reshape(-1),
                               inputs, metadata, from_target=False, **extra)
    return hidden.reshape(batch, width, -1), kv
