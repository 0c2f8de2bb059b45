"""The layer over the server's batches, whose sequences keep their states in a pool of slots:
ragged prefill and decode batches (`forward_slots`), draft trees (`verify_slots`) and the
state a verify keeps (`commit_node`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sgl_jax.layers.gated_delta_net.config import GdnConfig, GdnState, Params
from sgl_jax.layers.gated_delta_net.layer import (
    conv_taps,
    decode,
    in_proj,
    out_proj,
    rule_inputs,
    select_node,
    verify,
)
from sgl_jax.layers.gated_delta_net.rules import (
    causal_conv,
    chunk_step,
    chunk_terms,
    expand_mask,
)


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
    qkv, z, b, a = in_proj(params, x, config)
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
    y = out_proj(params, o, z, config, x.dtype)
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
    return jnp.where(expand_mask(fresh, rows), 0, rows).astype(pool.dtype)


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
