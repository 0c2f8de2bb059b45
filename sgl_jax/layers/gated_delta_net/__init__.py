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
The rules and convs (`rules`) work on one sequence; the entry points (`layer`) vmap them over
sequences, and `slots` runs them over the server's batches and its pool of states.

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

from sgl_jax.layers.gated_delta_net.checkpoint import ConvChannels, linear_attn_specs
from sgl_jax.layers.gated_delta_net.config import (
    GdnConfig,
    GdnState,
    Params,
    state_bytes,
    state_shapes,
    zero_state,
)
from sgl_jax.layers.gated_delta_net.layer import (
    L2_EPS,
    conv_taps,
    decode,
    normalize_qk,
    prefill,
    rule_inputs,
    select_node,
    verify,
)
from sgl_jax.layers.gated_delta_net.rules import (
    CHUNK_SIZE,
    ChunkTerms,
    causal_conv,
    chunk_step,
    chunk_terms,
    chunked_rule,
    conv_step,
    recurrent_rule,
    recurrent_step,
    tree_conv,
    tree_rule,
)
from sgl_jax.layers.gated_delta_net.slots import (
    SlotLayout,
    TreeLayout,
    commit_node,
    forward_slots,
    verify_slots,
)

__all__ = [
    "CHUNK_SIZE", "L2_EPS", "ChunkTerms", "ConvChannels", "GdnConfig", "GdnState", "Params",
    "SlotLayout", "TreeLayout", "causal_conv", "chunk_step", "chunk_terms", "chunked_rule",
    "commit_node", "conv_step", "conv_taps", "decode", "forward_slots", "linear_attn_specs",
    "normalize_qk", "prefill", "recurrent_rule", "recurrent_step", "rule_inputs", "select_node",
    "state_bytes", "state_shapes", "tree_conv", "tree_rule", "verify", "verify_slots",
    "zero_state",
]
