"""The mixture-of-experts MLP (Qwen3-MoE; Qwen3-Next adds a shared expert), in plain jnp.

    probs   = softmax(x @ router.T)                  in float32, over all E experts
    w, e    = top_k(probs)                           k experts per token, best first
    w       = w / sum(w)                             only when `norm_topk_prob`
    y       = sum_j w_j * expert_{e_j}(x)            expert(x) = down(silu(gate(x)) * up(x))
    y      += sigmoid(x @ shared_gate.T) * shared(x) only when the layer has a shared expert

The routed experts run as a grouped matmul: the T*k (token, expert) slots are sorted by
expert, and `jax.lax.ragged_dot_general` multiplies each expert's run of rows by that
expert's matrix, so on GPU and TPU (XLA's ragged dot) the work grows with k, not with E.
On CPU, JAX lowers ragged dot to a masked product over every expert (work E*T*k); the CPU
serves tiny test models only, and the results are the same.

Parameters of one MoE layer (a flat dict, beside the attention's in a decoder layer):
    "w_router": [E, H]
    "w_expert_gate_up": [E, I, 2, H]   each expert's gate and up rows of a feature side by side
    "w_expert_down": [E, H, I]
    and for a shared expert, all three or none:
    "w_shared_gate_up": [Is, 2, H], "w_shared_down": [H, Is], "w_shared_gate": [1, H]
Matrices keep the checkpoint's [out, in] layout; tensor parallelism splits the feature axes
I and Is (see `sgl_jax.layers.weights.LOGICAL_AXES`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.layers.linear import matmul_rows
from sgl_jax.layers.quantization import QuantizedWeight, dequantize, per_channel_product

Params = dict[str, Any]

# lhs [M, in] with rows grouped by expert, rhs [E, out, in]: contract `in`, group on E.
_GROUPED_ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def has_experts(p: Params) -> bool:
    """Whether a decoder layer's parameters hold a mixture-of-experts MLP."""
    return "w_router" in p


def moe_mlp(
    p: Params,
    x: jax.Array,  # [T, H]
    *,
    top_k: int,
    norm_topk_prob: bool,
) -> jax.Array:  # [T, H], x's dtype
    weights, experts = route(x, p["w_router"], top_k=top_k, norm_topk_prob=norm_topk_prob)
    y = routed_experts(p, x, weights, experts)
    if "w_shared_gate_up" in p:
        y = y + shared_expert(p, x)
    return y


def route(
    x: jax.Array,  # [T, H]
    w_router: jax.Array,  # [E, H]
    *,
    top_k: int,
    norm_topk_prob: bool,
) -> tuple[jax.Array, jax.Array]:  # f32[T, k] weights, i32[T, k] expert ids
    logits = matmul_rows(x, w_router, preferred_element_type=jnp.float32)  # f32[T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def routed_experts(
    p: Params,
    x: jax.Array,  # [T, H]
    weights: jax.Array,  # f32[T, k]
    experts: jax.Array,  # i32[T, k]
) -> jax.Array:  # [T, H], x's dtype
    """Each token through its k experts, weighted: one grouped matmul per projection."""
    num_tokens, top_k = experts.shape
    num_experts = p["w_expert_gate_up"].shape[0]
    order, group_sizes = sort_by_expert(experts, num_experts)  # i32[T*k], i32[E]
    rows = x[order // top_k]  # [T*k, H]: slot s = token * k + j belongs to token s // k
    y = expert_mlp(p, rows, group_sizes)  # [T*k, H], sorted by expert
    y = y[jnp.argsort(order)].reshape(num_tokens, top_k, -1)  # [T, k, H], back in slot order
    out = jnp.einsum("tk,tkh->th", weights, y.astype(jnp.float32))
    return out.astype(x.dtype)


def sort_by_expert(
    experts: jax.Array,  # i32[T, k]
    num_experts: int,
) -> tuple[jax.Array, jax.Array]:
    """The T*k slots ordered by expert (i32[T*k], stable) and each expert's count (i32[E])."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def expert_mlp(
    p: Params,
    rows: jax.Array,  # [M, H], grouped by expert
    group_sizes: jax.Array,  # i32[E], summing to M
) -> jax.Array:  # [M, H]
    w_gate_up = p["w_expert_gate_up"]  # [E, I, 2, H]
    num_experts, inter = w_gate_up.shape[:2]
    gate_up = grouped_matmul(rows, w_gate_up.reshape(num_experts, 2 * inter, -1), group_sizes)
    gate_up = gate_up.reshape(rows.shape[0], inter, 2)  # [M, I, 2]
    hidden = jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1]  # [M, I]
    return grouped_matmul(hidden, p["w_expert_down"], group_sizes)


def grouped_matmul(
    rows: jax.Array,  # [M, in]: the first group_sizes[0] rows for expert 0, and so on
    weight: jax.Array | QuantizedWeight,  # [E, out, in]
    group_sizes: jax.Array,  # i32[E]
) -> jax.Array:  # [M, out]: each row times its expert's matrix
    if not isinstance(weight, QuantizedWeight):
        return jax.lax.ragged_dot_general(rows, weight, group_sizes, _GROUPED_ROWS)
    if weight.num_blocks > 1:
        return jax.lax.ragged_dot_general(rows, dequantize(weight, rows.dtype), group_sizes,
                                          _GROUPED_ROWS)
    y = per_channel_product(rows, weight, lambda a, b, acc: jax.lax.ragged_dot_general(
        a, b, group_sizes, _GROUPED_ROWS, preferred_element_type=acc))  # f32[M, out]
    expert_of_row = jnp.repeat(jnp.arange(weight.shape[0]), group_sizes,
                               total_repeat_length=rows.shape[0])  # i32[M]
    return (y * weight.scales[expert_of_row, :, 0]).astype(rows.dtype)


def shared_expert(
    p: Params,
    x: jax.Array,  # [T, H]
) -> jax.Array:  # [T, H]
    gate_up = matmul_rows(x, p["w_shared_gate_up"])  # [T, Is, 2]
    y = matmul_rows(jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1], p["w_shared_down"])  # [T, H]
    gate = jax.nn.sigmoid(matmul_rows(x, p["w_shared_gate"]))  # [T, 1]
    return gate * y

