"""The native ragged paged attention against a per-token numpy loop and a hand-worked case."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.layers.attention.native import (
    native_attention,
    ragged_paged_attention_reference,
    write_kv,
)
from sgl_jax.model_executor.forward_batch import (
    Buckets,
    SeqChunk,
    build_forward_batch,
    token_positions,
)


def pack(chunks, page_size):
    """The batch, and where each chunk's tokens sit in it (chunks start on block boundaries)."""
    buckets = Buckets.automatic(max_tokens=128, max_seqs=8, context_len=64, page_size=page_size)
    shape = buckets.shape_for(chunks)
    batch = build_forward_batch(chunks, page_size=page_size, shape=shape)
    return batch, token_positions(chunks, shape)


def naive_attention(q, keys, values, visible, scale):
    """q [nq, hd]; keys/values [kv, nkv, hd] of one sequence; visible bool[kv] -> [nq, hd]."""
    group = q.shape[0] // keys.shape[1]
    out = np.zeros_like(q)
    for h in range(q.shape[0]):
        scores = keys[visible, h // group] @ q[h] * scale
        probs = np.exp(scores - scores.max())
        out[h] = (probs / probs.sum()) @ values[visible, h // group]
    return out


def make_case(rng, *, q_lens, prefix_lens, page_size, n_heads, n_kv, hd, tree=False):
    """Random chunks over a NaN-filled cache whose prefixes are already written."""
    num_pages = 1 + sum(-(-(p + q) // page_size) for p, q in zip(prefix_lens, q_lens, strict=True))
    k_pages = np.full((num_pages + 3, page_size, n_kv, hd), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    page_ids = rng.permutation(np.arange(1, num_pages + 3))  # scattered, some never used
    chunks, full_k, full_v = [], [], []
    next_page = 0
    for prefix, q_len in zip(prefix_lens, q_lens, strict=True):
        n_pages = -(-(prefix + q_len) // page_size)
        pages = page_ids[next_page : next_page + n_pages].tolist()
        next_page += n_pages
        k = rng.normal(size=(prefix + q_len, n_kv, hd)).astype(np.float32)
        v = rng.normal(size=(prefix + q_len, n_kv, hd)).astype(np.float32)
        for i in range(prefix):  # the prefix was written by earlier steps
            k_pages[pages[i // page_size], i % page_size] = k[i]
            v_pages[pages[i // page_size], i % page_size] = v[i]
        mask = random_tree_mask(rng, q_len) if tree else None
        chunks.append(SeqChunk([0] * q_len, prefix, pages, tree_mask=mask))
        full_k.append(k)
        full_v.append(v)
    return chunks, k_pages, v_pages, full_k, full_v


def random_tree_mask(rng, n):
    """Node i's parent is a random earlier node; each node sees itself and its ancestors."""
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        parent = rng.integers(0, i)
        mask[i] |= mask[parent]
    return mask


CASES = {
    "decode": dict(q_lens=[1, 1, 1], prefix_lens=[5, 17, 1]),
    "prefill": dict(q_lens=[9, 3, 20], prefix_lens=[0, 0, 0]),
    "mixed": dict(q_lens=[1, 12, 4, 1], prefix_lens=[30, 0, 7, 2]),
}


@pytest.mark.parametrize(
    "case,page_size,gqa,tree",
    [(c, ps, g, False) for c, ps, g in itertools.product(CASES, [1, 4, 16], [1, 4])]
    + [("mixed", ps, g, True) for ps, g in itertools.product([1, 16], [1, 2])],
)
@pytest.mark.parametrize("block_tokens", [4, 64])  # several blocks per sequence, or one
def test_matches_per_token_loop(case, page_size, gqa, tree, block_tokens):
    rng = np.random.default_rng(0)
    n_kv, hd = 2, 8
    n_heads = n_kv * gqa
    chunks, k_pages, v_pages, full_k, full_v = make_case(
        rng, **CASES[case], page_size=page_size, n_heads=n_heads, n_kv=n_kv, hd=hd, tree=tree
    )
    batch, where = pack(chunks, page_size)
    num_tokens = batch.input_ids.shape[0]
    q = rng.normal(size=(num_tokens, n_heads, hd)).astype(np.float32)
    new_k = np.zeros((num_tokens, n_kv, hd), np.float32)
    new_v = np.zeros((num_tokens, n_kv, hd), np.float32)
    for chunk, k, v, rows in zip(chunks, full_k, full_v, where, strict=True):
        new_k[rows], new_v[rows] = k[chunk.prefix_len :], v[chunk.prefix_len :]

    layer_kv = write_kv((jnp.asarray(k_pages), jnp.asarray(v_pages)), new_k, new_v,
                        batch.attention.slot_mapping)
    out = ragged_paged_attention_reference(
        q, *layer_kv, batch.attention, scale=hd**-0.5, block_tokens=block_tokens
    )
    out, k_after = np.asarray(out), layer_kv[0]

    for chunk, k, v, rows in zip(chunks, full_k, full_v, where, strict=True):
        for j, token in enumerate(rows):
            visible = np.arange(len(k)) <= chunk.prefix_len + j
            if chunk.tree_mask is not None:
                visible[chunk.prefix_len :] = chunk.tree_mask[j]
            expected = naive_attention(q[token], k, v, visible, hd**-0.5)
            np.testing.assert_allclose(out[token], expected, rtol=1e-5, atol=1e-5)
        last = chunk.page_ids[(len(k) - 1) // page_size]
        np.testing.assert_array_equal(np.asarray(k_after)[last, (len(k) - 1) % page_size], k[-1])
    assert not np.isnan(out[np.concatenate(where)]).any()


def test_hand_worked_single_query():
    # One head, head_dim 1, keys 0, 1, 2 and values 10, 20, 30 in pages of 2; query 1, scale 1:
    # softmax([0, 1, 2]) @ [10, 20, 30].
    k_pages = np.zeros((3, 2, 1, 1), np.float32)
    v_pages = np.zeros((3, 2, 1, 1), np.float32)
    k_pages[1, :, 0, 0], v_pages[1, :, 0, 0] = [0, 1], [10, 20]
    batch, _ = pack([SeqChunk([0], 2, [1, 2])], page_size=2)
    q = np.ones((1, 1, 1), np.float32)
    new = np.full((1, 1, 1), 2.0, np.float32)
    layer_kv = (jnp.asarray(k_pages), jnp.asarray(v_pages))
    out, _ = native_attention(q, new, new * 15, layer_kv, batch.attention, scale=1.0)
    weights = np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum()
    assert float(np.asarray(out)[0, 0, 0]) == pytest.approx(weights @ [10, 20, 30], rel=1e-6)
