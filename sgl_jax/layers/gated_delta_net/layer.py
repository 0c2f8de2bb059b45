"""The layer over a batch of sequences: `prefill` (chunked rule), `decode` (recurrent rule) and
`verify` (a draft tree), with the projections around the rules."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers.gated_delta_net.config import GdnConfig, GdnState, Params
from sgl_jax.layers.gated_delta_net.rules import (
    CHUNK_SIZE,
    causal_conv,
    chunked_rule,
    conv_step,
    recurrent_step,
    tree_conv,
    tree_rule,
)
from sgl_jax.layers.linear import matmul_rows

L2_EPS = 1e-6  # inside the rsqrt of q/k's L2 norm, as the reference kernels have it


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
    qkv, z, b, a = in_proj(params, x, config)
    mixed, window = jax.vmap(causal_conv, (0, 0, None, 0))(
        qkv, state.conv, conv_taps(params, config), valid
    )
    q, k, v, g, beta = rule_inputs(params, mixed, b, a, config)
    rule = jax.vmap(partial(chunked_rule, chunk_size=chunk_size))
    o, ssm = rule(q, k, v, g, beta, state.ssm, valid)
    return out_proj(params, o, z, config, x.dtype), GdnState(window, ssm)


def decode(
    params: Params,
    x: jax.Array,  # [B, H]: one token per sequence
    state: GdnState,  # [B, ...]
    valid: jax.Array,  # bool[B]
    *,
    config: GdnConfig,
) -> tuple[jax.Array, GdnState]:
    """The layer over one token per sequence (recurrent rule): [B, H] and the states after."""
    qkv, z, b, a = in_proj(params, x, config)
    mixed, window = jax.vmap(conv_step, (0, 0, None, 0))(
        qkv, state.conv, conv_taps(params, config), valid
    )
    q, k, v, g, beta = rule_inputs(params, mixed, b, a, config)
    o, ssm = jax.vmap(recurrent_step)(q, k, v, g, beta, state.ssm, valid)
    return out_proj(params, o, z, config, x.dtype), GdnState(window, ssm)


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
    qkv, z, b, a = in_proj(params, x, config)
    mixed, windows = jax.vmap(tree_conv, (0, 0, None, 0, 0))(
        qkv, state.conv, conv_taps(params, config), parents, valid
    )
    q, k, v, g, beta = rule_inputs(params, mixed, b, a, config)
    o, ssm = jax.vmap(tree_rule)(q, k, v, g, beta, state.ssm, parents, valid)
    return out_proj(params, o, z, config, x.dtype), GdnState(windows, ssm)


def select_node(nodes: GdnState, node: jax.Array) -> GdnState:
    """nodes [B, T, ...] from `verify`, node i32[B] -> each sequence's state after that node."""
    rows = jnp.arange(node.shape[0])
    return GdnState(*(x[rows, node] for x in nodes))


def in_proj(
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
    """conv_w [nk, Cg, K] -> [K, conv_dim], the layout the convs (`rules`) take."""
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


def out_proj(
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
