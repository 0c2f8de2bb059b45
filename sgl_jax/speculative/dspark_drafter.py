"""DSPARK: a DSpark head (models/dspark.py) behind the drafter interface (drafter.py).

The DFlash drafter's cache and block (dflash_drafter.py), read anchor first: a round's chain
of S drafts (S at most the block size) is slots 0..S-1 of the block, each the argmax of its
lm_head logits plus the Markov term of the token drafted before it. The head's own copies of
the target's embedding and lm_head are used. Verification is exact whatever the drafts are;
the drafts are deterministic, so a sampled request's rejection step sees them as one-hot.
Trees (our extension): each slot's top-k after each of the best nodes of the slot before,
its Markov term conditioned on that parent's token (dspark.draft_candidates).
"""

from __future__ import annotations

import dataclasses

from sgl_jax.layers.attention import AttentionBackend
from sgl_jax.models import dspark
from sgl_jax.models.loader import LoadedDraft, LoadedModel
from sgl_jax.speculative.dflash_drafter import DFlashDrafter
from sgl_jax.speculative.tree import select_tree


class DSparkDrafter(DFlashDrafter):
    def __init__(self, draft: LoadedDraft, target: LoadedModel, attention: AttentionBackend,
                 *, page_size: int):
        super().__init__(dataclasses.replace(draft, config=draft.config.backbone), target,
                         attention, page_size=page_size)
        self.heads: dspark.DSparkConfig = draft.config
        self.params["embed"] = draft.params["embed"]
        del self.params["lm_head"]  # the head's own, inside params["dflash"]

    def propose(self, params, kv, inputs, page_table, state_slots, hints, *, shape):
        """One block per row at its root's position; its first num_steps slots drafted in
        turn, each after its parent's token: a chain at top-k 1, else a tree of the best
        num_draft_tokens - 1 candidates."""
        roots = inputs.root_tokens
        hidden, kv = self.block(params, kv, inputs, page_table)
        scores, tokens, parents = dspark.draft_candidates(
            params["dflash"], self.heads, hidden[:, : shape.num_steps], roots, shape.topk)
        return select_tree(roots, scores, tokens, parents, shape.num_draft_tokens), kv
