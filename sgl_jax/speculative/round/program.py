"""One speculative round as pure functions: what enters it, what passes from one round to the
next on the device, and the target's verification of every draft tree (what comes back:
round/output.py).

A round = the drafter proposes a tree per row (drafters/), `verify_trees` runs the target over
every tree with the tree mask and walks the accepted path (round/verify.py), the drafter advances
over the accepted tokens, and `advance_slots` records the round in each request's slot. The
runner (spec_runner.py) compiles and dispatches these; nothing here holds state.

What passes from one round to the next stays on the device, per request slot (`SlotState`,
and the target's `last_tokens` for the root token): the committed length, the tokens
sampled, and the drafter's own per-slot state. So a round can be dispatched before the host
has read the one before it: where the host does not know a row's length yet it passes -1 and
the round reads the slot's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers import gated_delta_net
from sgl_jax.layers.attention import ModelCache
from sgl_jax.layers.attention.metadata import (
    from_windows,
    read_slots,
    to_windows,
    write_slots,
)
from sgl_jax.layers.sampler import SamplingBatch, raw_logprobs
from sgl_jax.model_executor.device_state import SlotLengths
from sgl_jax.model_executor.forward_batch import (
    BatchShape,
    SeqChunk,
    kv_slots,
    token_positions,
    window_metadata,
)
from sgl_jax.model_executor.model_runner import MAX_TOP_LOGPROBS, bitmask_words
from sgl_jax.model_executor.target_forward import TargetForward, target_features
from sgl_jax.speculative.round.tree import DraftTree, ancestor_mask, node_depths
from sgl_jax.speculative.round.verify import AcceptThresholds, Verdict, verify_tree

# Pending tokens one catch-up program extends the draft over, per request.
CATCH_UP_WIDTH = 8


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RoundRows:
    """Host arrays of the requests entering a round, padded to the batch bucket B."""

    slots: np.ndarray  # i32[B]: request slots (SlotState rows); -1: a padding row
    page_table: np.ndarray  # i32[B, P]: pages covering kv_len + SpecRunner.lookahead
    kv_lens: np.ndarray  # i32[B]: committed tokens before the root; -1: the slot's (a round
    # the host has not read yet decided it); the output position follows the same rule
    root_tokens: np.ndarray  # i32[B]: the request's last token; -1: the slot's
    min_new_tokens: np.ndarray  # i32[B]: EOS stays suppressed below this output position
    state_slots: np.ndarray  # i32[B]: a hybrid model's recurrent-state slots (0: none)
    max_depths: np.ndarray  # i32[B]: the deepest draft node each row may verify (0: none)
    hints: object = None  # what a host-side drafter proposes for these rows (or None)
    # i32[T] or None: a packed round verifies only these nodes, as flat indices row * N +
    # node (packed_nodes(); B * N: padding), so its target forward runs over T tokens, not
    # B * N. None: every row verifies its whole tree.
    packed_nodes: np.ndarray | None = None
    # f32[S, 2K] or None: a packed round's calibration of the draft's own scores (acceptance
    # by depth and cell, acceptance.Calibration), where the drafter scores
    # its drafts the round reallocates its nodes by (request_lengths.confident_packing)
    calibration: np.ndarray | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotState:
    """Each request slot's speculative state between rounds, on the device (its lengths are
    the target's DeviceState.lengths, which plain steps read too)."""

    draft: jax.Array  # [S, D]: the drafter's own (Drafter.slot_width; EAGLE: its output at
    # the root, f[S, H])


@dataclass
class DraftDeviceState:
    """The speculative runner's device arrays that outlive a round, beside the target's
    DeviceState. Programs take them donated and the runner stores their successors here."""

    kv: ModelCache | list  # the drafter's own paged cache (page ids and KV dtype the
    # target's); [] for a drafter that keeps none
    slots: SlotState  # per request slot: what the round in flight left for the next


@dataclass(frozen=True)
class CatchUpRow:
    """A request whose draft is behind its target by the tokens of some plain rounds."""

    slot: int  # its request slot: the caught-up draft's root is written there
    page_ids: Sequence[int]
    draft_len: int  # tokens the draft's cache holds (kv_len minus the pending ones)
    next_tokens: Sequence[int]  # per pending position p, the token at p + 1 (CATCH_UP_WIDTH)
    features: np.ndarray  # f[len(next_tokens), F]: the target's features at those positions


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Verified:
    """What a round's verification hands on, one row per request."""

    verdict: Verdict
    logprobs: jax.Array  # f32[B, S+1]: raw target log-probability of each emitted token
    top: tuple[jax.Array, jax.Array]  # i32 / f32[B, S+1, MAX_TOP_LOGPROBS] (zeros unless asked)
    features: jax.Array | None  # f[B*(S+1), F]: the target's features along the accepted
    # path (what the draft reads), or None for a draft that reads none



def commit_path_kv(kv: ModelCache, page_table: jax.Array, prefix_lens: jax.Array,
                   verdict: Verdict, page_size: int) -> ModelCache:
    """Copy the K/V of each accepted node (at slot prefix + node index) to slot prefix + depth,
    so the accepted path lies in consecutive slots like ordinary decoded tokens (in every
    attention layer at once; a hybrid model's state pools are committed apart)."""
    depth = jnp.arange(1, verdict.path.shape[1])[None, :]  # i32[1, S]
    nodes = verdict.path[:, 1:]
    moved = (depth <= verdict.num_accepted[:, None]) & (nodes != depth)
    source = kv_slots(page_table, prefix_lens[:, None] + jnp.maximum(nodes, 0), page_size)
    dest = kv_slots(page_table, prefix_lens[:, None] + depth, page_size)
    # unmoved pairs copy the null slot
    source = kv.every_layer_slots(jnp.where(moved, source, 0)).reshape(-1)
    dest = kv.every_layer_slots(jnp.where(moved, dest, 0)).reshape(-1)

    def move(pages: jax.Array) -> jax.Array:
        return write_slots(pages, dest, read_slots(pages, source))

    return dataclasses.replace(kv, k=move(kv.k), v=move(kv.v))


def path_logprobs(logits: jax.Array, rows: jax.Array, tokens: jax.Array, detail: jax.Array):
    """logits f32[B*N, V] at every node, rows i32[B*(S+1)]: the node that produced each
    emitted token, tokens i32[B, S+1], and the detail wanted (sampler.raw_logprobs) -> raw
    log-probabilities f32[B, S+1] and top ones [B, S+1, MAX_TOP_LOGPROBS] (zeros where not
    wanted)."""
    batch, width = tokens.shape
    chosen, top_ids, top_values = raw_logprobs(logits, tokens.reshape(-1), detail,
                                               MAX_TOP_LOGPROBS, rows=rows)
    shape = (batch, width, MAX_TOP_LOGPROBS)
    return chosen.reshape(batch, width), (top_ids.reshape(shape), top_values.reshape(shape))


def node_sampling(sampling: SamplingBatch, depths: jax.Array, suppress_depth: jax.Array
                  ) -> SamplingBatch:
    """One sampling row per tree node (B*N rows) from one per request (B rows) and the node
    depths i32[B, N]: the request's parameters at the output position of that node's
    prediction, with EOS suppressed only where min_new_tokens still holds."""
    n = depths.shape[1]
    per_node = jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), sampling)
    suppressing = (depths < suppress_depth[:, None]).reshape(-1)
    return dataclasses.replace(
        per_node, position=per_node.position + depths.reshape(-1),
        suppress_ids=jnp.where(suppressing[:, None], per_node.suppress_ids, -1))


def allow_every_id(nodes: tuple[int, int], vocab_size: int) -> np.ndarray:
    """i32[B, N, W]: node bitmasks that allow every id at each of [B, N] nodes."""
    return np.full((*nodes, bitmask_words(vocab_size)), -1, np.int32)


@dataclass(frozen=True)
class RoundInputs:
    """A round's per-row inputs on the device: the host's where it knows them, else the
    slot's (inside a jitted round)."""

    active: jax.Array  # bool[B]: padding rows write nothing
    kv_lens: jax.Array  # i32[B]
    root_tokens: jax.Array  # i32[B]
    draft: jax.Array  # [B, D]: the drafter's slot state
    sampling: SamplingBatch | None  # positions from the slots where the host's are unknown
    suppress_depth: jax.Array  # i32[B]: nodes shallower than this suppress EOS


def round_inputs(state: SlotState, lengths: SlotLengths, last_tokens: jax.Array,
                 rows: RoundRows, sampling: SamplingBatch | None) -> RoundInputs:
    slot = jnp.maximum(rows.slots, 0)
    unread = rows.kv_lens < 0  # a round the host has not read decided the length
    kv_lens = jnp.where(unread, lengths.kv_lens[slot], rows.kv_lens)
    roots = jnp.where(rows.root_tokens < 0, last_tokens[slot], rows.root_tokens)
    positions = lengths.num_sampled[slot]
    if sampling is not None:
        positions = jnp.where(unread, positions, sampling.position)
        sampling = dataclasses.replace(sampling, position=positions)
    return RoundInputs(rows.slots >= 0, kv_lens, roots, state.draft[slot], sampling,
                       jnp.maximum(rows.min_new_tokens - positions, 0))


def advance_slots(state: SlotState, lengths: SlotLengths, last_tokens: jax.Array,
                  slots: jax.Array, inputs: RoundInputs, verdict: Verdict,
                  draft: jax.Array) -> tuple[SlotState, SlotLengths, jax.Array]:
    """Each row's slot after the round: a + 1 more tokens committed and sampled, the bonus
    token as the root, and the drafter's new slot state `draft` [B, D]."""
    where = jnp.where(inputs.active, slots, last_tokens.shape[0])  # padding: dropped
    grown = verdict.num_accepted + 1
    bonus = jnp.take_along_axis(verdict.tokens, verdict.num_accepted[:, None], axis=1)[:, 0]
    drafts = state.draft.at[where].set(draft, mode="drop")
    lengths = SlotLengths(
        lengths.kv_lens.at[where].set(inputs.kv_lens + grown, mode="drop"),
        lengths.num_sampled.at[where].set(inputs.sampling.position + grown, mode="drop"))
    return SlotState(drafts), lengths, last_tokens.at[where].set(bonus, mode="drop")


def packed_nodes(counts: Sequence[int], width: int, num_tokens: int) -> np.ndarray:
    """i32[T]: the first counts[r] nodes of every row r of a round of `width` (N) nodes a
    row, as flat indices r * N + node, then padding (B * N) up to T = `num_tokens`. A
    row's first nodes are a subtree: a drafter numbers every node after its parent."""
    flat = [row * width + node for row, count in enumerate(counts) for node in range(count)]
    if len(flat) > num_tokens:
        raise ValueError(f"{len(flat)} nodes do not fit a packed round of {num_tokens} tokens")
    packed = np.full(num_tokens, len(counts) * width, np.int32)
    packed[: len(flat)] = flat
    return packed


def nodes_per_row(packed: jax.Array, nodes: tuple[int, int]) -> jax.Array:
    """i32[B]: the nodes (the root included) each row of a [B, N] round verifies in a packed
    round of `packed` i32[T] (padding, B * N, counts for none)."""
    batch, width = nodes
    return jnp.zeros(batch, jnp.int32).at[packed // width].add(1, mode="drop")


def keep_first_nodes(tree: DraftTree, packed: jax.Array) -> tuple[DraftTree, jax.Array]:
    """The tree [B, N] without the nodes a packed round leaves out (their parents -1, so no
    walk reaches them), and each row's count of verified nodes i32[B]."""
    counts = nodes_per_row(packed, tree.tokens.shape)
    kept = jnp.arange(tree.tokens.shape[1])[None, :] < counts[:, None]
    return dataclasses.replace(tree, parents=jnp.where(kept, tree.parents, -1)), counts


def verify_trees(
    forward: TargetForward, params, kv: ModelCache,
    page_table: jax.Array,  # i32[B, P]
    inputs: RoundInputs,
    tree: DraftTree,  # [B, N]
    detail: jax.Array,  # i32[]: the raw log-probabilities wanted (sampler.raw_logprobs)
    state_slots: jax.Array,  # i32[B]: hybrid targets' slots
    *,
    num_steps: int,  # S: the deepest a path may be accepted
    chain: bool,  # every tree is a chain (parents 0, 1, 2, ...)
    page_size: int,
    thresholds: AcceptThresholds,
    features: str,  # what the drafter reads of the target: "aux", "final" or "" (nothing)
    capture: tuple[int, ...] = (),
    node_allowed: jax.Array | None = None,  # i32[B, N, W]: grammar bitmasks per node
    packed: jax.Array | None = None,  # i32[T]: verify only these nodes (RoundRows.packed_nodes)
) -> tuple[ModelCache, Verified]:
    """The target's forward over every tree with the tree mask, the acceptance walk, and the
    accepted nodes' K/V moved into place. `node_allowed` masks each node's distribution (else
    each request's row applies). A hybrid target's linear layers run the trees from each
    request's committed state without writing the pools; the state after the last accepted
    node is then committed to the request's slot (padding rows write nothing). A packed
    round runs the target over the `packed` nodes alone and leaves the others unverified
    (a hybrid target's linear layers run their recurrence in the window layout, the nodes
    left out marked invalid)."""
    batch, n = tree.tokens.shape
    kv_lens, active = inputs.kv_lens, inputs.active
    counts = jnp.full(batch, n, jnp.int32)
    if packed is not None:
        tree, counts = keep_first_nodes(tree, packed)
    depths = node_depths(tree.parents)
    metadata = window_metadata(page_table, kv_lens, jnp.where(active, counts, 0), n,
                               page_size, ancestor_mask(tree.parents))
    metadata = dataclasses.replace(metadata, token_windows=packed)
    slots = jnp.where(active, state_slots, 0)
    layout = None
    if forward.hybrid:
        verified = jnp.arange(n)[None, :] < counts[:, None]  # bool[B, N]
        layout = gated_delta_net.TreeLayout(slots, tree.parents, active[:, None] & verified)
    pools = kv.states
    hidden, kv, captured = forward(params, kv, from_windows(tree.tokens.reshape(-1), metadata),
                                   from_windows((kv_lens[:, None] + depths).reshape(-1),
                                                metadata),
                                   metadata, capture=capture, tree=layout)
    # f32[B*N, V], and hidden and captured per node (a packed round's others: zeros)
    logits = to_windows(forward.logits(params, hidden), metadata)
    hidden = to_windows(hidden, metadata)
    captured = tuple(to_windows(layer, metadata) for layer in captured)
    per_node = node_sampling(inputs.sampling, depths, inputs.suppress_depth)
    if node_allowed is not None:
        per_node = dataclasses.replace(per_node, allowed=node_allowed.reshape(batch * n, -1))
    verdict = verify_tree(tree, logits, per_node, num_steps=num_steps, thresholds=thresholds)
    if forward.hybrid:
        last = jnp.take_along_axis(verdict.path, verdict.num_accepted[:, None], axis=1)[:, 0]
        kv = kv.with_states([None if pool is None else
                             gated_delta_net.commit_node(pool, nodes, slots, last, active)
                             for pool, nodes in zip(pools, kv.states, strict=True)])
    if not chain:  # a chain's accepted nodes are already consecutive
        kv = commit_path_kv(kv, page_table, kv_lens, verdict, page_size)
    path_rows = (jnp.arange(batch)[:, None] * n + jnp.maximum(verdict.path, 0)).reshape(-1)
    logprobs, top = path_logprobs(logits, path_rows, verdict.tokens, detail)
    path_features = target_features(features, hidden, captured)
    return kv, Verified(verdict, logprobs, top,
                        None if path_features is None else path_features[path_rows])


def shifted_ids(chunks: Sequence[SeqChunk], shape: BatchShape, next_tokens: Sequence[int]
                 ) -> np.ndarray:
    """i32[T]: at each token, the token after it (EAGLE3 pairs features t with token t+1)."""
    ids = np.zeros(shape.num_tokens, np.int32)
    for chunk, where, after in zip(chunks, token_positions(chunks, shape), next_tokens,
                                   strict=True):
        ids[where] = [*chunk.token_ids[1:], after]
    return ids


def catch_up_arrays(rows: Sequence[CatchUpRow], padded: int, pages_per_seq: int,
                    feature_width: int, dtype) -> tuple:
    """A catch-up's host arrays over `padded` rows: tokens i32[B, W], features f[B, W, F],
    page table i32[B, P], draft lengths and pending counts i32[B] each, slots i32[B] (-1:
    padding), W = CATCH_UP_WIDTH."""
    page_table = np.zeros((padded, pages_per_seq), np.int32)
    ints = np.zeros((2, padded), np.int32)  # draft_len, pending count
    slots = np.full(padded, -1, np.int32)
    tokens = np.zeros((padded, CATCH_UP_WIDTH), np.int32)
    features = np.zeros((padded, CATCH_UP_WIDTH, feature_width), dtype)
    for i, row in enumerate(rows):
        count = len(row.next_tokens)
        page_table[i, : len(row.page_ids)] = row.page_ids
        ints[:, i] = row.draft_len, count
        slots[i] = row.slot
        tokens[i, :count] = row.next_tokens
        features[i, :count] = row.features
    return tokens, features, page_table, *ints, slots
