"""The delta rule (recurrent, chunked, over a draft tree) and the causal conv, on one
sequence; `layer` vmaps them over a batch."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

CHUNK_SIZE = 64
# The state sums thousands of rank-one writes: keep its products in full float32 on every
# platform (XLA would otherwise take reduced-precision passes on GPU/TPU).
_einsum = partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


# ---------------------------------------------------------------- the delta rule, one sequence


def recurrent_step(
    q: jax.Array,  # f32[Hv, dk], normalised and scaled
    k: jax.Array,  # f32[Hv, dk], normalised
    v: jax.Array,  # f32[Hv, dv]
    g: jax.Array,  # f32[Hv], log decay <= 0
    beta: jax.Array,  # f32[Hv]
    state: jax.Array,  # f32[Hv, dk, dv]
    valid: jax.Array,  # bool[]
) -> tuple[jax.Array, jax.Array]:
    """One token: decay, then the delta write. Returns o f32[Hv, dv] and the state after it
    (the state unchanged when not valid)."""
    decayed = state * jnp.exp(g)[:, None, None]
    delta = beta[:, None] * (v - _einsum("hkv,hk->hv", decayed, k))  # [Hv, dv]
    new = decayed + k[:, :, None] * delta[:, None, :]
    new = jnp.where(valid, new, state)
    return _einsum("hkv,hk->hv", new, q), new


def recurrent_rule(
    q: jax.Array,  # f32[T, Hv, dk]
    k: jax.Array,  # f32[T, Hv, dk]
    v: jax.Array,  # f32[T, Hv, dv]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # f32[T, Hv]
    state: jax.Array,  # f32[Hv, dk, dv]
    valid: jax.Array,  # bool[T]
) -> tuple[jax.Array, jax.Array]:
    """Token by token over a sequence: o f32[T, Hv, dv] and the final state."""

    def step(s, token):
        *qkvgb, ok = token
        o, s = recurrent_step(*qkvgb, s, ok)
        return s, o

    state, o = jax.lax.scan(step, state, (q, k, v, g, beta, valid))
    return o, state


def chunked_rule(
    q: jax.Array,  # f32[T, Hv, dk], normalised and scaled
    k: jax.Array,  # f32[T, Hv, dk], normalised
    v: jax.Array,  # f32[T, Hv, dv]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # f32[T, Hv]
    state: jax.Array,  # f32[Hv, dk, dv]
    valid: jax.Array,  # bool[T]
    *,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """The recurrent rule computed a chunk at a time with matmuls (prefill): o f32[T, Hv, dv]
    and the final state (see `chunk_terms` and `chunk_step`)."""
    num_tokens, _, dv = v.shape
    size = min(chunk_size, num_tokens)
    pad = -num_tokens % size
    n = (num_tokens + pad) // size

    def chunks(x):  # [T, ...] -> [N, C, ...], padded with invalid tokens
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(n, size, *x.shape[1:])

    terms = chunk_terms(*(chunks(x) for x in (q, k, v, g, beta, valid)))
    state, o = jax.lax.scan(chunk_step, state, terms)
    o = jnp.swapaxes(o, 1, 2).reshape(n * size, -1, dv)
    return o[:num_tokens], state


class ChunkTerms(NamedTuple):
    """What the chunked rule needs of each chunk besides the state entering it, computed for
    all chunks at once; leading axes [N, Hv] (chunks, value heads), then C tokens."""

    u: jax.Array  # f32[N, Hv, C, dv]
    w: jax.Array  # f32[N, Hv, C, dk]
    attn: jax.Array  # f32[N, Hv, C, C]
    q_read: jax.Array  # f32[N, Hv, C, dk]
    k_write: jax.Array  # f32[N, Hv, C, dk]
    chunk_decay: jax.Array  # f32[N, Hv]


def chunk_terms(
    q: jax.Array,  # f32[N, C, Hv, dk]: N chunks of C tokens, normalised and scaled
    k: jax.Array,  # f32[N, C, Hv, dk]
    v: jax.Array,  # f32[N, C, Hv, dv]
    g: jax.Array,  # f32[N, C, Hv]
    beta: jax.Array,  # f32[N, C, Hv]
    valid: jax.Array,  # bool[N, C]
) -> ChunkTerms:
    """Within a chunk, with c_t the cumulative log decay from the chunk start through token t
    and S the state entering the chunk, token i writes v_new_i = u_i - w_i S into the state,
    where (I + A) u = beta v, (I + A) w = beta exp(c) k and A_ij = beta_i (k_i . k_j)
    exp(c_i - c_j) for j < i: solving that unit-lower-triangular system (the UT transform)
    folds the chunk's sequential delta writes into matmuls. Then
        o_i = exp(c_i) q_i S + sum_{j <= i} (q_i . k_j) exp(c_i - c_j) v_new_j
        S  <- exp(c_last) S + sum_j exp(c_last - c_j) k_j v_new_j^T
    Everything but the pass of S from chunk to chunk (`chunk_step`) is computed here."""
    size = valid.shape[-1]
    # Invalid tokens become identities on the state: no decay (g = 0) and no write
    # (beta = 0); their q, k, v are zeroed so that garbage in them cannot leak.
    q, k, v, g, beta = (jnp.swapaxes(jnp.where(expand_mask(valid, x), x, 0.0), 1, 2)
                        for x in (q, k, v, g, beta))  # [N, Hv, C, ...]
    cum = jnp.cumsum(g, axis=-1)  # f32[N, Hv, C]
    causal = jnp.tril(jnp.ones((size, size), bool))  # j <= i
    gap = cum[..., :, None] - cum[..., None, :]  # f32[N, Hv, C, C]: log decay from j to i
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, gap, 0.0)), 0.0)  # no exp of a gap > 0
    strict = jnp.tril(jnp.ones((size, size), bool), -1)
    a = jnp.where(strict, beta[..., None] * _einsum("nhid,nhjd->nhij", k, k) * decay, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(cum))[..., None] * k], axis=-1)
    solved = jax.lax.linalg.triangular_solve(
        a, rhs, left_side=True, lower=True, unit_diagonal=True
    )
    dv = v.shape[-1]
    return ChunkTerms(
        u=solved[..., :dv],
        w=solved[..., dv:],
        attn=_einsum("nhid,nhjd->nhij", q, k) * decay,
        q_read=q * jnp.exp(cum)[..., None],  # reads the state entering the chunk
        k_write=k * jnp.exp(cum[..., -1:] - cum)[..., None],  # writes decayed to the chunk end
        chunk_decay=jnp.exp(cum[..., -1]),
    )


def chunk_step(state: jax.Array, terms: ChunkTerms) -> tuple[jax.Array, jax.Array]:
    """One chunk (`terms` of one chunk, no N axis) from the state entering it, f32[Hv, dk, dv]:
    the state after it and o f32[Hv, C, dv]."""
    v_new = terms.u - _einsum("hcd,hdv->hcv", terms.w, state)
    o = (_einsum("hcd,hdv->hcv", terms.q_read, state)
         + _einsum("hij,hjv->hiv", terms.attn, v_new))
    state = (state * terms.chunk_decay[:, None, None]
             + _einsum("hcd,hcv->hdv", terms.k_write, v_new))
    return state, o


def tree_rule(
    q: jax.Array,  # f32[T, Hv, dk]
    k: jax.Array,  # f32[T, Hv, dk]
    v: jax.Array,  # f32[T, Hv, dv]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # f32[T, Hv]
    state: jax.Array,  # f32[Hv, dk, dv]: the committed state, the tree's root
    parents: jax.Array,  # i32[T]: -1 = the root; a parent precedes its children
    valid: jax.Array,  # bool[T]
) -> tuple[jax.Array, jax.Array]:
    """A draft tree: every token starts from its parent's state. Returns o f32[T, Hv, dv] and
    each token's state after it, f32[T, Hv, dk, dv] (its parent's when not valid)."""

    def step(states, token):
        t, parent, *qkvgb, ok = token
        o, new = recurrent_step(*qkvgb, _node(states, state, parent), ok)
        return states.at[t].set(new), o

    tokens = (jnp.arange(len(parents)), parents, q, k, v, g, beta, valid)
    states, o = jax.lax.scan(step, jnp.zeros((len(parents), *state.shape), state.dtype), tokens)
    return o, states


def _node(nodes: jax.Array, root: jax.Array, parent: jax.Array) -> jax.Array:
    """The state after node `parent` (i32[]), or the root's when parent < 0."""
    return jnp.where(parent < 0, root, nodes[jnp.maximum(parent, 0)])


def expand_mask(mask: jax.Array, x: jax.Array) -> jax.Array:
    """mask [*lead] -> [*lead, 1, ...] with x's rank, to broadcast against x [*lead, ...]."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


# ---------------------------------------------------------------- the causal conv, one sequence


def conv_step(
    x: jax.Array,  # [C]: this token's conv input
    window: jax.Array,  # [K-1, C]: the inputs before it, oldest first
    weight: jax.Array,  # [K, C]: taps, the last one on the current token
    valid: jax.Array,  # bool[]
) -> tuple[jax.Array, jax.Array]:
    """SiLU(depthwise conv) of one token: f32[C], and the window after it (unchanged when not
    valid)."""
    taps = jnp.concatenate([window, x[None].astype(window.dtype)])  # [K, C]
    y = jax.nn.silu(jnp.sum(taps.astype(jnp.float32) * weight.astype(jnp.float32), axis=0))
    return y, jnp.where(valid, taps[1:], window)


def causal_conv(
    x: jax.Array,  # [T, C]
    window: jax.Array,  # [K-1, C]
    weight: jax.Array,  # [K, C]
    valid: jax.Array,  # bool[T]
) -> tuple[jax.Array, jax.Array]:
    """SiLU(depthwise causal conv) over a sequence continuing `window`: f32[T, C] and the window
    after its last valid token. Invalid tokens are skipped: a valid token's taps are the valid
    inputs before it, then the window."""
    k1, num_tokens = window.shape[0], x.shape[0]
    rows = jnp.concatenate([window, x.astype(window.dtype)])  # [K-1+T, C]
    token_rows = k1 + jnp.arange(num_tokens)
    # Row of the last valid token at or before t (the window's last row when none is).
    last = jax.lax.cummax(jnp.where(valid, token_rows, k1 - 1))
    # Each row's predecessor: the window's rows run in order, then each token follows the last
    # valid token before it.
    before = jnp.concatenate([jnp.arange(k1) - 1, jnp.array([k1 - 1]), last[:-1]])
    taps = [token_rows]  # taps[j]: the row j inputs back
    for _ in range(k1):
        taps.append(before[taps[-1]])
    y = sum(rows[taps[j]].astype(jnp.float32) * weight[k1 - j].astype(jnp.float32)
            for j in range(k1 + 1))
    path = [last[-1]]  # the window after the last valid token, newest first
    for _ in range(k1 - 1):
        path.append(before[path[-1]])
    return jax.nn.silu(y), rows[jnp.stack(path[::-1])]


def tree_conv(
    x: jax.Array,  # [T, C]
    window: jax.Array,  # [K-1, C]: the committed window, the tree's root
    weight: jax.Array,  # [K, C]
    parents: jax.Array,  # i32[T]: -1 = the root; a parent precedes its children
    valid: jax.Array,  # bool[T]
) -> tuple[jax.Array, jax.Array]:
    """The conv over a draft tree: each token's taps are the inputs along its ancestor path,
    then the committed window. Returns f32[T, C] and each token's window after it,
    [T, K-1, C] (its parent's when not valid)."""

    def step(windows, token):
        t, parent, xt, ok = token
        y, after = conv_step(xt, _node(windows, window, parent), weight, ok)
        return windows.at[t].set(after), y

    tokens = (jnp.arange(len(parents)), parents, x, valid)
    windows, y = jax.lax.scan(step, jnp.zeros((len(parents), *window.shape), window.dtype), tokens)
    return y, windows
