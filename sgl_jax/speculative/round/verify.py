"""Verification: walk each draft tree against the target's distributions at its nodes.

At a node, children are tried in index order with one uniform u in (0, 1] drawn for that node:
the first child whose accumulated target probability reaches u is accepted, and the walk moves
to it. When no child is accepted (or the node is a leaf), the bonus token is drawn from the
node's distribution with the tried children's mass removed. Together this is one inverse-CDF
draw from the target distribution with the children ordered first, so the emitted tokens are
distributed exactly as plain sampling would give them (EAGLE3.md, "Verification"). Greedy rows
have a one-hot distribution, which makes the same rule "accept the child equal to the argmax".

A chain whose drafts were sampled from a distribution q (DraftTree.child_q) is verified by
speculative sampling's rule instead: the child x is accepted when u <= p(x) / q(x), and on a
rejection the bonus is drawn from max(p - q, 0) renormalised, which again emits exactly p and
accepts more often than the rule above (1 - TV(p, q) against p(x)). A draft chosen without
a draw is the case q = one-hot(x), where both rules agree.

The thresholds relax the rule at the user's request: a child is also accepted when
u * threshold_acc <= accumulated mass, or when its own probability reaches threshold_single.
Both default to 1.0, where the rule is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from sgl_jax.layers.sampler import (
    SamplingBatch,
    any_logit_edits,
    filtered_probs,
    penalised_logits,
    row_uniform,
    vocab_argmax,
)
from sgl_jax.speculative.round.tree import DraftTree

_ACCEPT_STREAM, _BONUS_STREAM, _DRAFT_STREAM = 1, 2, 3  # apart from plain sampling's


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Verdict:
    path: jax.Array  # i32[B, S+1]: node index at each depth of the accepted path; -1 past it
    num_accepted: jax.Array  # i32[B]: accepted draft tokens a (the bonus not counted)
    tokens: jax.Array  # i32[B, S+1]: the a accepted tokens, then the bonus; 0 past them


@dataclass(frozen=True)
class AcceptThresholds:
    single: float = 1.0
    acc: float = 1.0


def verify_tree(
    tree: DraftTree,  # [B, N]
    logits: jax.Array,  # f32[B*N, V]: the target's raw logits at every node
    sampling: SamplingBatch,  # B*N rows: each node's parameters, position and suppressed ids
    *,
    num_steps: int,  # S: the deepest a path can go
    thresholds: AcceptThresholds,
) -> Verdict:
    """Accept a path in every tree. An all-greedy batch skips the vocabulary sort."""
    batch, num_nodes = tree.tokens.shape
    u_accept = _node_uniforms(sampling, _ACCEPT_STREAM).reshape(batch, num_nodes)
    u_bonus = _node_uniforms(sampling, _BONUS_STREAM).reshape(batch, num_nodes)

    def greedy(logits: jax.Array) -> Verdict:  # the logits as the rows' tokens are chosen
        best = vocab_argmax(logits).reshape(batch, num_nodes)
        child_prob = (_at_parent(best, tree.parents) == tree.tokens).astype(jnp.float32)
        path, accepted, last = _walk(tree, child_prob, u_accept, num_steps, thresholds)
        bonus = jnp.take_along_axis(best, last[:, None], axis=1)[:, 0]
        return _verdict(tree, path, accepted, bonus)

    def edited_greedy(logits: jax.Array) -> Verdict:  # biases, grammars, suppressed ids
        return greedy(penalised_logits(logits, sampling, None, None))

    def stochastic(logits: jax.Array) -> Verdict:  # raw: filtered_probs applies the edits
        probs = filtered_probs(logits, sampling, None, None).reshape(batch, num_nodes, -1)
        child_prob = _at_parents(probs, tree)
        if tree.child_q is not None:  # accepted with probability min(1, p / q)
            q = jnp.maximum(_at_parents(tree.child_q, tree), 1e-30)
            child_prob = jnp.minimum(child_prob / q, 1.0)
        path, accepted, last = _walk(tree, child_prob, u_accept, num_steps, thresholds)
        bonus = _draw_bonus(tree, probs, last, jnp.take_along_axis(u_bonus, last[:, None], 1))
        return _verdict(tree, path, accepted, bonus)

    # A greedy batch no row edits skips the edits: a pass over every node's vocabulary that
    # cost a CPU about a fifth of a 192-node round's verification.
    branch = jnp.where(jnp.all(sampling.temperature == 0),
                       any_logit_edits(sampling).astype(jnp.int32), 2)
    return jax.lax.switch(branch, (greedy, edited_greedy, stochastic), logits)


def _node_uniforms(sampling: SamplingBatch, stream: int) -> jax.Array:
    """f32[B*N] in (0, 1]: excluding 0 keeps a zero-probability child from ever matching."""
    draw = jax.vmap(lambda s, p: row_uniform(s, p, stream))
    return 1.0 - draw(sampling.seed, sampling.position)


def _at_parents(dists: jax.Array, tree: DraftTree) -> jax.Array:
    """dists f32[B, N, V] -> f32[B, N]: each node's token's mass in its parent's row."""
    at_parent = jnp.take_along_axis(dists, jnp.maximum(tree.parents, 0)[:, :, None], 1)
    return jnp.take_along_axis(at_parent, tree.tokens[:, :, None], axis=2)[..., 0]


def _at_parent(values: jax.Array, parents: jax.Array) -> jax.Array:
    """values [B, N] -> [B, N]: each node's parent's value (the root gets its own)."""
    return jnp.take_along_axis(values, jnp.maximum(parents, 0), axis=1)


def _walk(
    tree: DraftTree,
    child_prob: jax.Array,  # f32[B, N]: p_parent(node's token) for every non-root node
    u: jax.Array,  # f32[B, N]: the uniform drawn at each node
    num_steps: int,
    thresholds: AcceptThresholds,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # path i32[B, S+1], accepted i32[B], last i32[B]
    batch, _ = tree.tokens.shape
    current = jnp.zeros(batch, jnp.int32)
    stopped = jnp.zeros(batch, bool)
    path = [current]
    for _ in range(num_steps):
        is_child = tree.parents == current[:, None]  # bool[B, N]
        mass = jnp.where(is_child, child_prob, 0.0)
        reach = jnp.cumsum(mass, axis=1)
        u_here = jnp.take_along_axis(u, current[:, None], axis=1)
        hit = is_child & ((u_here * thresholds.acc <= reach) | (mass >= thresholds.single))
        found = hit.any(axis=1) & ~stopped
        current = jnp.where(found, jnp.argmax(hit, axis=1).astype(jnp.int32), current)
        path.append(jnp.where(found, current, -1))
        stopped |= ~found
    path = jnp.stack(path, axis=1)
    return path, jnp.sum(path[:, 1:] >= 0, axis=1).astype(jnp.int32), current


def _draw_bonus(
    tree: DraftTree,
    probs: jax.Array,  # f32[B, N, V]
    last: jax.Array,  # i32[B]: the node the walk stopped at
    u: jax.Array,  # f32[B, 1] in (0, 1]
) -> jax.Array:  # i32[B]
    """Inverse CDF over the last node's distribution without its (rejected) children, or, for
    a sampled chain, over max(p - q, 0) where the walk rejected a child. Should rounding
    leave no mass, the most likely token is taken."""
    batch = probs.shape[0]
    rows = jnp.arange(batch)[:, None]
    residual = jnp.take_along_axis(probs, last[:, None, None], axis=1)[:, 0]  # f32[B, V]
    if tree.child_q is not None:
        rejected_q = jnp.take_along_axis(tree.child_q, last[:, None, None], axis=1)[:, 0]
        has_child = jnp.any(tree.parents == last[:, None], axis=1)
        residual = jnp.where(has_child[:, None], jnp.maximum(residual - rejected_q, 0.0),
                             residual)
    rejected = jnp.where(tree.parents == last[:, None], tree.tokens, probs.shape[2])
    residual = residual.at[rows, rejected].set(0.0, mode="drop")
    drawn = inverse_cdf(residual, u[:, 0])
    total = jnp.sum(residual, axis=1, keepdims=True)
    fallback = vocab_argmax(jnp.take_along_axis(probs, last[:, None, None], 1)[:, 0])
    return jnp.where(total[:, 0] > 0, drawn, fallback)


def draw_draft(q: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """i32[B]: each row's draft token drawn from q f32[B, V] with the uniform of the row's
    (seed, position) on a stream of its own: independent of verification's draws, as exact
    speculative sampling needs."""
    return inverse_cdf(q, _node_uniforms(sampling, _DRAFT_STREAM))


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """weights f32[B, V] >= 0 (any positive total), u f32[B] in (0, 1] -> i32[B]: the first
    index whose cumulative weight reaches u * total; a zero-weight index is never taken."""
    cdf = jnp.cumsum(weights, axis=1)
    drawn = jnp.sum(cdf < u[:, None] * cdf[:, -1:], axis=1).astype(jnp.int32)
    return jnp.minimum(drawn, weights.shape[1] - 1)


def _verdict(tree: DraftTree, path: jax.Array, accepted: jax.Array, bonus: jax.Array) -> Verdict:
    """Emitted tokens: those of path[1..a], then the bonus at index a."""
    path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path[:, 1:], 0), axis=1)
    index = jnp.arange(path.shape[1] - 1)[None, :]
    tokens = jnp.where(index < accepted[:, None], path_tokens, 0)
    tokens = jnp.concatenate([tokens, jnp.zeros_like(bonus)[:, None]], axis=1)
    tokens = tokens.at[jnp.arange(tokens.shape[0]), accepted].set(bonus)
    return Verdict(path=path, num_accepted=accepted, tokens=tokens)
