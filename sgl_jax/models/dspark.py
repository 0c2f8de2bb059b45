"""DSpark draft heads (arXiv 2607.05147; DeepSpec's `Qwen3DSparkModel` layout): a DFlash
backbone (models/dflash.py: the same context keys, layers and non-causal block) with every
block slot a draft, and two small heads on its output.

config.json: DFlash's fields at the top level (`block_size`, `mask_token_id`,
`target_layer_ids`, `num_target_layers`, Qwen3's attention and MLP fields), `markov_rank` r
(0: no Markov head), `markov_head_type` ("vanilla", "gated" or "rnn"),
`enable_confidence_head` and `confidence_head_with_markov`.
Tensors: DFlash's, `embed_tokens.weight` and `lm_head.weight` [V, H] (frozen copies of the
target's), `markov_head.markov_w1.weight` [V, r] (an embedding of the previous token),
`markov_head.markov_w2.weight` [V, r] (r -> V), for "gated" `markov_head.gate_proj.{weight
[r, H + r], bias [r]}`, for "rnn" `markov_head.joint_proj.{weight [3r, 2r + H], bias [3r]}`,
and `confidence_head.proj.{weight [1, H (+ r)], bias [1]}`.

The forward. The block [x0, MASK x (B-1)] at positions s..s+B-1 (x0 the last verified token)
runs through the DFlash backbone; slot k's final-normed output h_k drafts the token at
s + 1 + k (anchor first: a block of B gives B drafts). Its logits are z_k = lm_head(h_k) +
b_k, the Markov term b_k depending on the token before it, x_{k-1} (x_{-1} = x0, then the
drafted tokens), through e_k = W1[x_{k-1}]:
- vanilla: b_k = W2 e_k (a low-rank bigram);
- gated: b_k = W2 (sigmoid(G [h_k; e_k] + g) * e_k);
- rnn: [gate | candidate | output] = J [s_{k-1}; e_k; h_k] + j, s_k = sigmoid(gate) * s_{k-1}
  + (1 - sigmoid(gate)) * tanh(candidate) (s_{-1} = 0), b_k = W2 tanh(output).
The confidence head's logit l_k = w . [h_k (; e_k)] + b predicts that draft k is accepted
given that every draft before it was (sigmoid(l_k)).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers.linear import matmul_rows
from sgl_jax.layers.sampler import vocab_top_k
from sgl_jax.layers.weights import WeightSpec
from sgl_jax.models import dflash
from sgl_jax.models.dflash import DFlashConfig

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEADS = ("vanilla", "gated", "rnn")
Params = dict[str, Any]


@dataclass(frozen=True)
class DSparkConfig:
    backbone: DFlashConfig  # the layers, block size, mask token and target layers
    vocab_size: int
    markov_rank: int  # r; 0: no Markov head
    markov_head: str | None  # one of MARKOV_HEADS; None without a Markov head
    confidence: bool  # whether the head has a confidence head
    confidence_with_markov: bool  # its features are [h_k; e_k] rather than h_k


def config_from_hf(hf: dict[str, Any]) -> DSparkConfig:
    rank = int(hf.get("markov_rank") or 0)
    head = hf.get("markov_head_type", "vanilla") if rank else None
    if head is not None and head not in MARKOV_HEADS:
        raise ValueError(f"markov_head_type {head!r} is not one of {', '.join(MARKOV_HEADS)}")
    confidence = bool(hf.get("enable_confidence_head", False))
    with_markov = confidence and bool(hf.get("confidence_head_with_markov", False))
    if with_markov and not rank:
        raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
    return DSparkConfig(backbone=dflash.config_from_hf(hf), vocab_size=int(hf["vocab_size"]),
                        markov_rank=rank, markov_head=head, confidence=confidence,
                        confidence_with_markov=with_markov)


def hf_weight_specs(config: DSparkConfig, names: Collection[str] = ()
                    ) -> dict[str, WeightSpec]:
    h, v, r = config.backbone.layer.hidden_size, config.vocab_size, config.markov_rank
    specs = dflash.hf_weight_specs(config.backbone, names)
    specs["embed_tokens.weight"] = WeightSpec(("embed",), (v, h))
    specs["lm_head.weight"] = WeightSpec(("lm_head",), (v, h))
    if r:
        specs["markov_head.markov_w1.weight"] = WeightSpec(("markov", "w1"), (v, r))
        specs["markov_head.markov_w2.weight"] = WeightSpec(("markov", "w2"), (v, r))
    if config.markov_head == "gated":
        specs["markov_head.gate_proj.weight"] = WeightSpec(("markov", "w_gate"), (r, h + r))
        specs["markov_head.gate_proj.bias"] = WeightSpec(("markov", "b_gate"), (r,))
    if config.markov_head == "rnn":
        specs["markov_head.joint_proj.weight"] = WeightSpec(("markov", "w_joint"),
                                                            (3 * r, 2 * r + h))
        specs["markov_head.joint_proj.bias"] = WeightSpec(("markov", "b_joint"), (3 * r,))
    if config.confidence:
        width = h + (r if config.confidence_with_markov else 0)
        specs["confidence_head.proj.weight"] = WeightSpec(("confidence", "w"), (1, width))
        specs["confidence_head.proj.bias"] = WeightSpec(("confidence", "b"), (1,))
    return specs


def base_logits(params: Params, config: DSparkConfig, hidden: jax.Array) -> jax.Array:
    """hidden f[N, H] (final-normed backbone output) -> f32[N, V] through the head's lm_head
    (rows padded in for sharding cut off)."""
    logits = matmul_rows(hidden, params["lm_head"], preferred_element_type=jnp.float32)
    return logits[:, : config.vocab_size]


def initial_state(config: DSparkConfig, rows: int) -> jax.Array:
    """f32[rows, r]: the rnn head's state before a block's first slot (zeros; any head)."""
    return jnp.zeros((rows, config.markov_rank), jnp.float32)


def markov_step(
    params: Params,
    config: DSparkConfig,
    hidden: jax.Array,  # f[N, H]: one slot's backbone output per row
    previous: jax.Array,  # i32[N]: the token before each row's slot
    state: jax.Array,  # f32[N, r]: the rnn head's state (unused by the others)
) -> tuple[jax.Array, jax.Array]:
    """One slot's Markov term f32[N, V] (zeros without a Markov head) and the next state."""
    if config.markov_head is None:
        return jnp.zeros((hidden.shape[0], config.vocab_size), jnp.float32), state
    p = params["markov"]
    e = p["w1"][previous].astype(jnp.float32)  # [N, r]
    h = hidden.astype(jnp.float32)
    if config.markov_head == "gated":
        gate = jax.nn.sigmoid(_affine(jnp.concatenate([h, e], -1), p["w_gate"], p["b_gate"]))
        e = gate * e
    elif config.markov_head == "rnn":
        joint = _affine(jnp.concatenate([state, e, h], -1), p["w_joint"], p["b_joint"])
        gate, candidate, output = jnp.split(joint, 3, axis=-1)
        keep = jax.nn.sigmoid(gate)
        state = keep * state + (1 - keep) * jnp.tanh(candidate)
        e = jnp.tanh(output)
    return (e @ p["w2"].astype(jnp.float32).T)[:, : config.vocab_size], state


def confidence_logits(
    params: Params,
    config: DSparkConfig,
    hidden: jax.Array,  # f[N, H]
    previous: jax.Array,  # i32[N]: the token before each row's slot
) -> jax.Array:
    """f32[N]: each draft's logit of being accepted once every draft before it was."""
    features = hidden.astype(jnp.float32)
    if config.confidence_with_markov:
        features = jnp.concatenate(
            [features, params["markov"]["w1"][previous].astype(jnp.float32)], -1)
    p = params["confidence"]
    return _affine(features, p["w"], p["b"])[:, 0]


def teacher_forced_logits(
    params: Params,
    config: DSparkConfig,
    hidden: jax.Array,  # f[NB, B, H]: each block's slots
    previous: jax.Array,  # i32[NB, B]: the token before each slot (x0, then the block's own)
) -> tuple[jax.Array, jax.Array]:
    """Every slot's draft logits f32[NB, B, V] and confidence logits f32[NB, B] when the
    tokens before the slots are known (training, and the logits of drafted tokens): the
    rnn head's state runs along each block."""
    num_blocks, block, width = hidden.shape
    base = base_logits(params, config, hidden.reshape(-1, width)).reshape(num_blocks, block, -1)

    def step(state, slot):
        h, prev = slot
        bias, state = markov_step(params, config, h, prev, state)
        return state, bias

    _, bias = jax.lax.scan(step, initial_state(config, num_blocks),
                           (hidden.swapaxes(0, 1), previous.swapaxes(0, 1)))
    logits = base + bias.swapaxes(0, 1)
    if not config.confidence:
        return logits, jnp.zeros((num_blocks, block), jnp.float32)
    confidence = confidence_logits(params, config, hidden.reshape(-1, width),
                                   previous.reshape(-1)).reshape(num_blocks, block)
    return logits, confidence


def draft_candidates(
    params: Params,
    config: DSparkConfig,
    hidden: jax.Array,  # f[NB, S, H]: each block's first S slots
    anchors: jax.Array,  # i32[NB]: each block's last verified token
    topk: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Candidate draft nodes, each slot's logits conditioned on its parent's token (the
    Markov term, the rnn state along the path): the anchor's K best children at slot 0, then
    at each later slot the K best children of each of the K best nodes of the slot before
    (EAGLE-2's frontier), a node scored by its path's summed log-probabilities. Returns
    scores f32[NB, C], tokens i32[NB, C] and parents i32[NB, C] (-1: the anchor; a child j of
    frontier node i of a slot at that slot's offset + i*K + j), C = K + (S-1) K^2, in the
    order select_tree takes. At K = 1: the chain of each slot's argmax after the one before."""
    num_blocks, steps, width = hidden.shape
    base = base_logits(params, config, hidden.reshape(-1, width)).reshape(num_blocks, steps, -1)

    def children(h, logits, previous, state):
        """Each of the rows' K best next tokens: log-probabilities and tokens [rows, K], and
        the rows' state after this slot."""
        bias, state = markov_step(params, config, h, previous, state)
        scores, tokens = vocab_top_k(jax.nn.log_softmax(logits + bias, -1), topk)
        return scores, tokens, state

    first_scores, first_tokens, state = children(hidden[:, 0], base[:, 0], anchors,
                                                 initial_state(config, num_blocks))
    rows = num_blocks * topk
    frontier = (first_scores, jnp.broadcast_to(jnp.arange(topk, dtype=jnp.int32),
                                               (num_blocks, topk)),
                first_tokens, jnp.repeat(state, topk, axis=0), jnp.int32(topk))

    def grow(frontier, slot):
        scores, ids, tokens, state, offset = frontier
        h, logits = slot
        child_scores, child_tokens, state = children(
            jnp.repeat(h, topk, axis=0), jnp.repeat(logits, topk, axis=0), tokens.reshape(rows),
            state)
        child_scores = (scores.reshape(rows, 1) + child_scores).reshape(num_blocks, -1)
        child_tokens = child_tokens.reshape(num_blocks, -1)
        best_scores, best = jax.lax.top_k(child_scores, topk)  # [NB, K] of K*K
        parent_row = jnp.arange(num_blocks)[:, None] * topk + best // topk
        nxt = (best_scores, (offset + best).astype(jnp.int32),
               jnp.take_along_axis(child_tokens, best, 1), state[parent_row.reshape(-1)],
               offset + topk * topk)
        return nxt, (child_scores, child_tokens, jnp.repeat(ids, topk, axis=1))

    _, later = jax.lax.scan(grow, frontier, (hidden[:, 1:].swapaxes(0, 1),
                                             base[:, 1:].swapaxes(0, 1)))

    def candidates(first, deeper):  # deeper: [S-1, NB, K*K]
        return jnp.concatenate([first, jnp.moveaxis(deeper, 0, 1).reshape(num_blocks, -1)], 1)

    return (candidates(first_scores, later[0]), candidates(first_tokens, later[1]),
            candidates(jnp.full((num_blocks, topk), -1, jnp.int32), later[2]))


def sampled_chain(
    params: Params,
    config: DSparkConfig,
    hidden: jax.Array,  # f[NB, S, H]: each block's first S slots
    anchors: jax.Array,  # i32[NB]: each block's last verified token
    draw: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
    """A chain drawn slot by slot: `draw(slot, logits f32[NB, V])` returns each row's token
    i32[NB] and the distribution f32[NB, V] it was drawn from, the logits being the slot's
    backbone logits plus the Markov term of the token drawn before it. Returns the tokens
    i32[NB, S] and those distributions f32[NB, S, V]."""
    num_blocks, steps, width = hidden.shape
    base = base_logits(params, config, hidden.reshape(-1, width)).reshape(num_blocks, steps, -1)

    def step(carry, slot):
        previous, state = carry
        index, h, logits = slot
        bias, state = markov_step(params, config, h, previous, state)
        token, q = draw(index, logits + bias)
        return (token, state), (token, q)

    _, (tokens, q) = jax.lax.scan(
        step, (anchors, initial_state(config, num_blocks)),
        (jnp.arange(steps), hidden.swapaxes(0, 1), base.swapaxes(0, 1)))
    return tokens.swapaxes(0, 1), q.swapaxes(0, 1)


def _affine(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """x f32[N, in] @ weight[out, in].T + bias[out], in float32."""
    return x @ weight.astype(jnp.float32).T + bias.astype(jnp.float32)
