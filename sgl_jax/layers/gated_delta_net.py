"""Gated DeltaNet: the linear-attention layer of Qwen3-Next, with an explicit recurrent state.

Per value head and token (q, k L2-normalised, q scaled by dk^-0.5, each q/k head repeated over
its r = nv/nk value heads):
    S <- S * exp(g)                       g = -exp(A_log) * softplus(a + dt_bias) <= 0
    S <- S + k (beta * (v - S^T k))^T     beta = sigmoid(b)
    o  = S^T q                            S: f32[dk, dv]
q, k and v come out of a depthwise causal conv (kernel K, no bias, then SiLU) over the
projected q|k|v channels; the layer's output is out_proj(RMSNorm(o) * norm_weight * silu(z)).

One sequence's state (`GdnState`) is its last K-1 conv inputs and S of every value head. Three
entry points move a batch of states forward: `prefill` (a chunk of a prompt, chunked rule),
`decode` (one token per sequence, recurrent rule) and `verify` (a draft tree: every node starts
from its parent's state and its state after it is returned; `select_node` commits one). A token
with valid=False leaves the state as it found it, so batches can be padded to bucketed shapes.
The rules and convs below work on one sequence; the entry points vmap them over sequences.

Parameters of one layer (nk key heads, r = nv/nk, Cg = 2*dk + r*dv conv channels per key head):
    {"w_in": [nk, Cg + r*dv + 2r, H],  per key head the rows q | k | v | z | b | a
     "conv_w": [nk, Cg, K],            per key head the channels q | k | v
     "dt_bias": [nv], "a_log": [nv], "norm": [dv], "w_out": [H, nv*dv]}
The checkpoint's in_proj_qkvz and in_proj_ba are already grouped per key head, so w_in is both
reshaped and fused into one matrix (one product streams faster than two). conv1d.weight is
q | k | v over all heads; it is regrouped per key head at load time (`ConvChannels`). Value
heads are numbered key-head-major (value head h reads key head h // r) everywhere, so every
parameter, the conv window and S split along their head axis without cutting a key head's
q, k, v, z, b, a or value heads apart; the layer reads head counts from the parameters'
shapes, so it runs unchanged on one device's share of key heads (w_out then gives a partial
sum to add across devices). Matrices keep the checkpoint's [out, in] layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers.linear import matmul_rows
from sgl_jax.layers.weights import FusedPart, WeightSpec

Params = dict[str, Any]
CHUNK_SIZE = 64
L2_EPS = 1e-6  # inside the rsqrt of q/k's L2 norm, as the reference kernels have it
# The state sums thousands of rank-one writes: keep its products in full float32 on every
# platform (XLA would otherwise take reduced-precision passes on GPU/TPU).
_einsum = partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


@dataclass(frozen=True)
class GdnConfig:
    """The shapes of one Gated DeltaNet layer; hashable so jitted functions can close over it."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_key_heads})"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {self.conv_kernel}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> GdnConfig:
        """From a Qwen3-Next `config.json`."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r}: the conv supports only silu")
        return cls(
            hidden_size=hf["hidden_size"],
            num_key_heads=hf["linear_num_key_heads"],
            num_value_heads=hf["linear_num_value_heads"],
            key_head_dim=hf["linear_key_head_dim"],
            value_head_dim=hf["linear_value_head_dim"],
            conv_kernel=hf.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        )

    @property
    def ratio(self) -> int:
        """Value heads per key head."""
        return self.num_value_heads // self.num_key_heads

    @property
    def group_channels(self) -> int:
        """Conv channels per key head: q, k and its r value heads."""
        return 2 * self.key_head_dim + self.ratio * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return self.num_key_heads * self.group_channels

    @property
    def group_rows(self) -> int:
        """Rows of w_in per key head: q | k | v | z | b | a."""
        return self.group_channels + self.ratio * (self.value_head_dim + 2)


class GdnState(NamedTuple):
    """The cache of one layer; leading batch (and node) axes as the caller stacks them."""

    conv: jax.Array  # [..., K-1, conv_dim]: the last K-1 conv inputs, oldest first, in x.dtype
    ssm: jax.Array  # f32[..., Hv, dk, dv]


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
    q, k, v, g, beta = (jnp.swapaxes(jnp.where(_expand(valid, x), x, 0.0), 1, 2)
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


def _expand(mask: jax.Array, x: jax.Array) -> jax.Array:
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


# ---------------------------------------------------------------- the layer, a batch of sequences


def prefill(
    params: Params,
    x: jax.Array,  # [B, T, H]: a chunk of each sequence's prompt, padded to T
    state: GdnState,  # [B, ...]: each sequence's state before the chunk
    valid: jax.Array,  # bool[B, T]
    *,
    config: GdnConfig,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, GdnState]:
    """The layer over prompt chunks (chunked rule): [B, T, H] and each sequence's state after
    its last valid token."""
    qkv, z, b, a = _in_proj(params, x, config)
    mixed, window = jax.vmap(causal_conv, (0, 0, None, 0))(
        qkv, state.conv, conv_taps(params, config), valid
    )
    q, k, v, g, beta = rule_inputs(params, mixed, b, a, config)
    rule = jax.vmap(partial(chunked_rule, chunk_size=chunk_size))
    o, ssm = rule(q, k, v, g, beta, state.ssm, valid)
    return _out_proj(params, o, z, config, x.dtype), GdnState(window, ssm)


def decode(
    params: Params,
    x: jax.Array,  # [B, H]: one token per sequence
    state: GdnState,  # [B, ...]
    valid: jax.Array,  # bool[B]
    *,
    config: GdnConfig,
) -> tuple[jax.Array, GdnState]:
    """The layer over one token per sequence (recurrent rule): [B, H] and the states after."""
    qkv, z, b, a = _in_proj(params, x, config)
    mixed, window = jax.vmap(conv_step, (0, 0, None, 0))(
        qkv, state.conv, conv_taps(params, config), valid
    )
    q, k, v, g, beta = rule_inputs(params, mixed, b, a, config)
    o, ssm = jax.vmap(recurrent_step)(q, k, v, g, beta, state.ssm, valid)
    return _out_proj(params, o, z, config, x.dtype), GdnState(window, ssm)


def verify(
    params: Params,
    x: jax.Array,  # [B, T, H]: each sequence's draft tree, padded to T nodes
    state: GdnState,  # [B, ...]: the committed states, the trees' roots
    parents: jax.Array,  # i32[B, T]: -1 = the root; a parent precedes its children
    valid: jax.Array,  # bool[B, T]
    *,
    config: GdnConfig,
) -> tuple[jax.Array, GdnState]:
    """The layer over draft trees, each node from its parent's state: [B, T, H] and the state
    after every node, GdnState [B, T, ...]; `select_node` commits the last accepted one."""
    qkv, z, b, a = _in_proj(params, x, config)
    mixed, windows = jax.vmap(tree_conv, (0, 0, None, 0, 0))(
        qkv, state.conv, conv_taps(params, config), parents, valid
    )
    q, k, v, g, beta = rule_inputs(params, mixed, b, a, config)
    o, ssm = jax.vmap(tree_rule)(q, k, v, g, beta, state.ssm, parents, valid)
    return _out_proj(params, o, z, config, x.dtype), GdnState(windows, ssm)


def select_node(nodes: GdnState, node: jax.Array) -> GdnState:
    """nodes [B, T, ...] from `verify`, node i32[B] -> each sequence's state after that node."""
    rows = jnp.arange(node.shape[0])
    return GdnState(*(x[rows, node] for x in nodes))


def _in_proj(
    params: Params, x: jax.Array, config: GdnConfig  # x [..., H]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> conv inputs [..., conv_dim] (key-head-major q|k|v), z [..., Hv, dv], b and a
    [..., Hv], all in x.dtype. Head counts come from the parameters' shapes, which hold only
    this device's key heads when they are split for tensor parallelism."""
    lead, cg, r = x.shape[:-1], config.group_channels, config.ratio
    y = matmul_rows(x.reshape(-1, x.shape[-1]), params["w_in"])  # [N, nk, rows]
    y = y.reshape(*lead, *y.shape[1:])
    rv = r * config.value_head_dim
    z = y[..., cg : cg + rv].reshape(*lead, -1, config.value_head_dim)
    b = y[..., cg + rv : cg + rv + r].reshape(*lead, -1)
    a = y[..., cg + rv + r :].reshape(*lead, -1)
    return y[..., :cg].reshape(*lead, -1), z, b, a


def conv_taps(params: Params, config: GdnConfig) -> jax.Array:
    """conv_w [nk, Cg, K] -> [K, conv_dim], the layout the convs above take."""
    return params["conv_w"].reshape(-1, config.conv_kernel).T


def rule_inputs(
    params: Params,
    mixed: jax.Array,  # f32[..., conv_dim]: the conv's output
    b: jax.Array,  # [..., Hv]
    a: jax.Array,  # [..., Hv]
    config: GdnConfig,
) -> tuple[jax.Array, ...]:
    """-> q, k f32[..., Hv, dk] (normalised, q scaled), v f32[..., Hv, dv], g, beta f32[..., Hv]."""
    lead, dk = mixed.shape[:-1], config.key_head_dim
    groups = mixed.astype(jnp.float32).reshape(*lead, -1, config.group_channels)
    q, k = normalize_qk(groups[..., :dk], groups[..., dk : 2 * dk], config.ratio)
    v = groups[..., 2 * dk :].reshape(*lead, -1, config.value_head_dim)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    dt = jax.nn.softplus(a.astype(jnp.float32) + params["dt_bias"].astype(jnp.float32))
    g = -jnp.exp(params["a_log"].astype(jnp.float32)) * dt
    return q, k, v, g, beta


def normalize_qk(
    q: jax.Array, k: jax.Array, ratio: int  # f32[..., nk, dk]
) -> tuple[jax.Array, jax.Array]:
    """L2-normalise q and k, scale q by dk^-0.5, repeat each head over its `ratio` value
    heads -> f32[..., nk*ratio, dk]."""

    def unit(x):
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)

    q = unit(q) * q.shape[-1] ** -0.5
    return jnp.repeat(q, ratio, axis=-2), jnp.repeat(unit(k), ratio, axis=-2)


def _out_proj(
    params: Params,
    o: jax.Array,  # f32[..., Hv, dv]
    z: jax.Array,  # [..., Hv, dv]
    config: GdnConfig,
    dtype: Any,
) -> jax.Array:
    """The gated RMSNorm (in float32, weight as is) and out_proj -> [..., H] in dtype."""
    normed = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + config.rms_norm_eps)
    gated = normed * params["norm"].astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    flat = gated.reshape(-1, o.shape[-2] * o.shape[-1]).astype(dtype)
    return matmul_rows(flat, params["w_out"]).reshape(*o.shape[:-2], -1)


# ---------------------------------------------------------------- the layer over a state pool


class SlotLayout(NamedTuple):
    """How the server's ragged batch maps onto a pool of states (one slot per running request,
    slot 0 a null slot that nothing valid reads or writes). The batch is NB query blocks of C
    tokens; each sequence's new tokens fill consecutive blocks from a block boundary, so only
    its last block may end in padding (see `sgl_jax.layers.attention.metadata`). A decode
    batch has C = 1."""

    slot: jax.Array  # i32[NB]: the pool slot of the block's sequence (0: a padding block)
    first: jax.Array  # bool[NB]: the block is its sequence's first in this batch
    last: jax.Array  # bool[NB]: ... and its last: the state after it is written back
    fresh: jax.Array  # bool[NB]: the sequence starts here (zero state, not its slot's)
    valid: jax.Array  # bool[NB, C]: real tokens


def forward_slots(
    params: Params,
    x: jax.Array,  # [T, H], T = NB * C
    pool: GdnState,  # [S, ...]: every slot's state
    layout: SlotLayout,
    *,
    config: GdnConfig,
) -> tuple[jax.Array, GdnState]:
    """The layer over a ragged batch whose sequences keep their states in `pool`: [T, H] and
    the pool with each sequence's state after its last token written to its slot (other
    slots untouched)."""
    if layout.valid.shape[1] == 1:
        return _decode_slots(params, x, pool, layout, config)
    return _extend_slots(params, x, pool, layout, config)


def _decode_slots(params, x, pool, layout, config):
    """One token per sequence: gather the states, one recurrent step, scatter them back."""
    valid = layout.valid[:, 0]
    state = _read_slots(pool, layout.slot, layout.fresh)
    y, state = decode(params, x, state, valid, config=config)
    return y, _write_slots(pool, layout.slot, state, valid)


def _extend_slots(params, x, pool, layout, config):
    """Prefill chunks laid out in blocks of C tokens. Everything but the state's pass from
    block to block runs over all blocks at once: the projections, the conv (each block's
    window is the previous block's last inputs, or the sequence's saved window at its first
    block), and the chunked rule's per-chunk terms with the block as the chunk. A scan over
    the blocks then carries the state: a sequence's first block loads its slot (or zero
    when fresh), its last block stores into the pool, which rides in the scan's carry so
    that no per-block copy of the states is ever built.

    Why blocks rather than a gather into [sequences, longest chunk]: the block layout is
    what the batch already is, bucketed by token count alone, so this adds no shape to
    compile; a dense [sequences, length] view would need its own buckets for both, or
    T * T / C padded tokens. The cost is a sequential pass over T / C blocks of small
    matmuls, the same pass the chunked rule makes over its chunks."""
    num_blocks, size = layout.valid.shape
    k1 = config.conv_kernel - 1
    if size < k1:
        raise ValueError(f"query blocks of {size} tokens are shorter than the conv window "
                         f"({k1}): a window would span several blocks")
    qkv, z, b, a = _in_proj(params, x, config)
    qkv = qkv.reshape(num_blocks, size, -1)
    saved = _read_rows(pool.conv, layout.slot, layout.fresh)  # [NB, K-1, C']
    previous = jnp.concatenate([jnp.zeros_like(qkv[:1, -k1:]), qkv[:-1, -k1:]])
    windows = jnp.where(layout.first[:, None, None], saved, previous.astype(saved.dtype))
    mixed, after = jax.vmap(causal_conv, (0, 0, None, 0))(
        qkv, windows, conv_taps(params, config), layout.valid)
    q, k, v, g, beta = rule_inputs(params, mixed, b.reshape(num_blocks, size, -1),
                                   a.reshape(num_blocks, size, -1), config)
    terms = chunk_terms(q, k, v, g, beta, layout.valid)

    def block(carry, inputs):
        state, ssm_pool = carry
        terms, slot, first, last, fresh = inputs
        stored = jax.lax.dynamic_index_in_dim(ssm_pool, slot, keepdims=False)
        state = jnp.where(first, jnp.where(fresh, 0.0, stored), state)
        state, o = chunk_step(state, terms)
        ssm_pool = jax.lax.dynamic_update_index_in_dim(
            ssm_pool, jnp.where(last, state, stored), slot, 0)
        return (state, ssm_pool), o

    start = jnp.zeros(pool.ssm.shape[1:], jnp.float32)
    (_, ssm_pool), o = jax.lax.scan(
        block, (start, pool.ssm),
        (terms, layout.slot, layout.first, layout.last, layout.fresh))
    heads = o.shape[1]  # o: f32[NB, Hv, C, dv]
    o = jnp.swapaxes(o, 1, 2).reshape(num_blocks * size, heads, -1)  # [T, Hv, dv]
    y = _out_proj(params, o, z, config, x.dtype)
    return y, GdnState(_write_rows(pool.conv, layout.slot, after, layout.last), ssm_pool)


class TreeLayout(NamedTuple):
    """A verify batch over a state pool: B requests, each a draft tree of N nodes laid out
    row-major ([B * N] tokens), node 0 the root (the request's last committed token)."""

    slot: jax.Array  # i32[B]: each request's slot (0 for padding rows)
    parents: jax.Array  # i32[B, N]: -1 = the root; a parent precedes its children
    valid: jax.Array  # bool[B, N]


def verify_slots(
    params: Params,
    x: jax.Array,  # [B * N, H]
    pool: GdnState,  # [S, ...]: every slot's state
    layout: TreeLayout,
    *,
    config: GdnConfig,
) -> tuple[jax.Array, GdnState]:
    """`verify` over trees whose roots are the committed states in `pool`: [B * N, H] and the
    state after every node, GdnState [B * N, ...] (the pool's rank, so that the same
    tensor-parallel split applies). The pool is only read; `commit_node` writes it."""
    batch, n = layout.parents.shape
    root = _read_slots(pool, layout.slot, layout.slot == 0)
    y, nodes = verify(params, x.reshape(batch, n, -1), root, layout.parents, layout.valid,
                      config=config)
    return (y.reshape(batch * n, -1),
            GdnState(*(a.reshape(batch * n, *a.shape[2:]) for a in nodes)))


def commit_node(pool: GdnState, nodes: GdnState, slot: jax.Array, node: jax.Array,
                write: jax.Array) -> GdnState:
    """pool with each request's state after tree node `node` (i32[B]) written to its slot
    (i32[B]) where `write` (bool[B]); nodes GdnState [B * N, ...] from `verify_slots`."""
    batch = slot.shape[0]
    per_request = GdnState(*(a.reshape(batch, -1, *a.shape[1:]) for a in nodes))
    return _write_slots(pool, slot, select_node(per_request, node), write)


def _read_slots(pool: GdnState, slot: jax.Array, fresh: jax.Array) -> GdnState:
    """pool [S, ...], slot i32[B], fresh bool[B] -> GdnState [B, ...] (zero where fresh)."""
    return GdnState(*(_read_rows(x, slot, fresh) for x in pool))


def _read_rows(pool: jax.Array, slot: jax.Array, fresh: jax.Array) -> jax.Array:
    rows = pool[slot]
    return jnp.where(_expand(fresh, rows), 0, rows).astype(pool.dtype)


def _write_slots(pool: GdnState, slot: jax.Array, state: GdnState, write: jax.Array
                 ) -> GdnState:
    """pool with state[i] written to slot[i] where write[i] (bool[B])."""
    return GdnState(*(_write_rows(p, slot, s, write) for p, s in zip(pool, state, strict=True)))


def _write_rows(pool: jax.Array, slot: jax.Array, rows: jax.Array, write: jax.Array
                ) -> jax.Array:
    """pool [S, ...] with rows[i] at slot[i] where write[i]; nothing is written elsewhere,
    not even to the null slot."""
    target = jnp.where(write, slot, pool.shape[0])  # out of range: dropped
    return pool.at[target].set(rows.astype(pool.dtype), mode="drop")


# ---------------------------------------------------------------- state sizes


def state_shapes(config: GdnConfig, dtype: Any) -> GdnState:
    """One request's state in one layer, as ShapeDtypeStructs (conv window in the activation
    dtype, S in float32)."""
    return GdnState(
        conv=jax.ShapeDtypeStruct((config.conv_kernel - 1, config.conv_dim), jnp.dtype(dtype)),
        ssm=jax.ShapeDtypeStruct(
            (config.num_value_heads, config.key_head_dim, config.value_head_dim), jnp.float32
        ),
    )


def state_bytes(config: GdnConfig, dtype: Any) -> int:
    """Bytes of one request's state in one layer."""
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in state_shapes(config, dtype))


def zero_state(config: GdnConfig, batch: int, dtype: Any) -> GdnState:
    """A fresh state for `batch` sequences: GdnState [batch, ...] of zeros."""
    return GdnState(*(jnp.zeros((batch, *s.shape), s.dtype) for s in state_shapes(config, dtype)))


# ---------------------------------------------------------------- checkpoint names


def linear_attn_specs(
    config: GdnConfig, prefix: str, path: tuple[str | int, ...]
) -> dict[str, WeightSpec]:
    """The tensors of the linear-attention block of the decoder layer named `prefix`
    (e.g. "model.layers.0."), placed under `path` in the parameter pytree."""
    h, nk, nv, r = config.hidden_size, config.num_key_heads, config.num_value_heads, config.ratio
    dk, dv, k = config.key_head_dim, config.value_head_dim, config.conv_kernel
    rows, qkvz = config.group_rows, 2 * dk + 2 * r * dv
    w_in = (nk, rows, h)
    name = prefix + "linear_attn."
    return {
        name + "in_proj_qkvz.weight": WeightSpec(
            (*path, "w_in"), (nk * qkvz, h),
            FusedPart(w_in, (nk, qkvz, h), (slice(None), slice(0, qkvz))),
        ),
        name + "in_proj_ba.weight": WeightSpec(
            (*path, "w_in"), (nk * 2 * r, h),
            FusedPart(w_in, (nk, 2 * r, h), (slice(None), slice(qkvz, rows))),
        ),
        name + "conv1d.weight": WeightSpec(
            (*path, "conv_w"), (config.conv_dim, 1, k),
            ConvChannels(
                param_shape=(nk, config.group_channels, k), view=(config.conv_dim, k),
                index=(), key_head_dim=dk,
            ),
        ),
        name + "dt_bias": WeightSpec((*path, "dt_bias"), (nv,)),
        name + "A_log": WeightSpec((*path, "a_log"), (nv,)),
        name + "norm.weight": WeightSpec((*path, "norm"), (dv,)),
        name + "out_proj.weight": WeightSpec((*path, "w_out"), (h, nv * dv)),
    }


@dataclass(frozen=True)
class ConvChannels(FusedPart):
    """conv1d.weight, whose channels are q | k | v each over all heads, regrouped into
    conv_w [nk, Cg, K] with each key head's q | k | v channels together (`view` is the
    checkpoint's [conv_dim, K]; `index` is unused)."""

    key_head_dim: int = 0  # a default only because the base class's last fields have one

    def write(self, param: np.ndarray, tensor: np.ndarray) -> None:
        nk, dk = self.param_shape[0], self.key_head_dim
        flat = tensor.reshape(self.view)
        q, k, v = flat[: nk * dk], flat[nk * dk : 2 * nk * dk], flat[2 * nk * dk :]
        param[...] = np.concatenate([x.reshape(nk, -1, flat.shape[-1]) for x in (q, k, v)], 1)

    def read(self, param: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        dk, taps = self.key_head_dim, param.shape[-1]
        parts = (param[:, :dk], param[:, dk : 2 * dk], param[:, 2 * dk :])
        return np.concatenate([x.reshape(-1, taps) for x in parts]).reshape(shape)
