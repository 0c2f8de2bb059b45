"""DSPARK: a DSpark head (models/dspark.py) behind the drafter interface
(drafters/interface.py).

The DFlash drafter's cache and block (drafters/dflash.py), read anchor first: a round's chain
of S drafts (S at most the block size) is slots 0..S-1 of the block, each drawn from its
lm_head logits plus the Markov term of the token drafted before it, filtered by the request's
own sampling parameters (temperature, top-k, top-p, min-p; greedy rows: the argmax). That
distribution goes to verification as q, which accepts with speculative sampling's rule
(round/verify.py). The head's own copies of the target's embedding and lm_head are used.
Trees (our extension): each slot's top-k after each of the best nodes of the slot before,
its Markov term conditioned on that parent's token (dspark.draft_candidates), chosen
without a draw, so verification sees them as one-hot; so are the chains of a masked round
(grammars), whose drafts come before the round's sampling rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend
from sgl_jax.layers.sampler import filtered_probs, penalised_logits, vocab_argmax
from sgl_jax.models import dspark
from sgl_jax.models.loader import LoadedDraft, LoadedModel
from sgl_jax.speculative.drafters.dflash import DFlashDrafter
from sgl_jax.speculative.round.program import RoundInputs, node_sampling
from sgl_jax.speculative.round.tree import DraftTree, select_tree
from sgl_jax.speculative.round.verify import draw_draft


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
        turn, each after its parent's token: a chain at top-k 1 (sampled where the round has
        sampling rows), else a tree of the best num_draft_tokens - 1 candidates."""
        roots = inputs.root_tokens
        hidden, kv = self.block(params, kv, inputs, page_table)
        hidden = hidden[:, : shape.num_steps]
        if shape.topk == 1 and inputs.sampling is not None:
            tree = self.sampled_chain(params, hidden, inputs)
        else:
            scores, tokens, parents = dspark.draft_candidates(
                params["dflash"], self.heads, hidden, roots, shape.topk)
            tree = select_tree(roots, scores, tokens, parents, shape.num_draft_tokens)
        if shape.topk == 1 and self.heads.confidence:
            tree = dataclasses.replace(tree, scores=self.confident_scores(params, hidden, tree))
        return tree, kv

    def confident_scores(self, params, hidden: jax.Array, chain: DraftTree) -> jax.Array:
        """hidden f[B, S, H] and the chain drafted from it -> f32[B, S+1]: each node's
        log-survival by the confidence head (the summed log-sigmoids of its path's
        confidence logits, each given the token before it; 0 at the root)."""
        batch, steps, width = hidden.shape
        logits = dspark.confidence_logits(params["dflash"], self.heads,
                                          hidden.reshape(batch * steps, width),
                                          chain.tokens[:, :steps].reshape(-1))
        survival = jnp.cumsum(jax.nn.log_sigmoid(logits.reshape(batch, steps)), axis=1)
        return jnp.concatenate([jnp.zeros((batch, 1), jnp.float32), survival], axis=1)

    def sampled_chain(self, params, hidden: jax.Array, inputs: RoundInputs) -> DraftTree:
        """hidden f[B, S, H] -> a chain of S drafts per row, each drawn from the distribution
        it goes to verification with (child_q [B, S+1, V]; the last node's is unused)."""
        batch, steps, _ = hidden.shape

        def draw(slot: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
            # The row's parameters at the output position of the token this slot drafts.
            depth = jnp.full((batch, 1), slot, jnp.int32)
            rows = node_sampling(inputs.sampling, depth, inputs.suppress_depth)

            def argmax(logits):  # an all-greedy round sorts no vocabulary
                best = vocab_argmax(penalised_logits(logits, rows, None, None))
                return jax.nn.one_hot(best, logits.shape[-1], dtype=jnp.float32)

            q = jax.lax.cond(jnp.all(rows.temperature == 0), argmax,
                             lambda x: filtered_probs(x, rows, None, None), logits)
            return draw_draft(q, rows), q

        tokens, q = dspark.sampled_chain(params["dflash"], self.heads, hidden,
                                         inputs.root_tokens, draw)
        chain = jnp.arange(-1, steps, dtype=jnp.int32)
        drawn = jnp.take_along_axis(q, tokens[:, :, None], axis=2)[:, :, 0]  # f32[B, S]
        scores = jnp.cumsum(jnp.log(jnp.maximum(drawn, 1e-30)), axis=1)
        return DraftTree(jnp.concatenate([inputs.root_tokens[:, None], tokens], axis=1),
                         jnp.broadcast_to(chain, (batch, steps + 1)),
                         jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1),
                         jnp.concatenate([jnp.zeros((batch, 1), jnp.float32), scores], 1))
