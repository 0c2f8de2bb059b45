"""The draft networks behind one interface (`DraftModel`); the EAGLE-2 tree they grow is
round/draft_growth.py's.

- `Eagle3Draft`: the EAGLE3 head. Its KV slot j holds the pair (target features of token j,
  token j+1) at position j, so after an extend its last output already predicts the first draft
  token; later steps feed back its own pre-norm output in place of the target features.
- `EagleDraft`: an EAGLE v1 / v2 head, paired the same way but fed the target's final hidden
  state, with fc applied at every step and the target's lm_head for logits.
- `NextnDraft`: Qwen3-Next's own multi-token-prediction layer, paired as EAGLE's head is,
  fed the target's final-norm hidden state and, at later steps, its own normed output.
- `StandaloneDraft` (drafters/standalone.py): an ordinary small model with the target's vocabulary.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend, AttentionMetadata, ModelCache
from sgl_jax.models import llama, llama_eagle, llama_eagle3, qwen3_next_mtp
from sgl_jax.models.config import ModelConfig
from sgl_jax.models.loader import LoadedDraft, LoadedModel

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
