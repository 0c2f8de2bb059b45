"""The native ragged paged attention (the reference of every kernel) against a per-token
numpy loop and a hand-worked case."""

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.layers.attention.metadata import LayerKV, pack_mask_bits, window_visible
from sgl_jax.layers.attention.native import native_attention, ragged_paged_attention_reference
from sgl_jax.model_executor.forward_batch import Buckets, SeqChunk, build_forward_batch
from sgl_jax.speculative.round.program import packed_nodes
from sgl_jax.testing.attention import (
    BATCH_MODES,
    FP8_KV_DTYPES,
    OTHER_LAYERS_PAGES,
    TREE_PREFIX_LENS,
    assert_reads_kv_pages,
    expected_outputs,
    kernel_problem,
    random_problem,
    written_pages,
)


def pages_of(problem) -> LayerKV:
    return LayerKV(jnp.asarray(problem.k_pages), jnp.asarray(problem.v_pages))


def pack(chunks, page_size):
    buckets = Buckets.automatic(max_tokens=128, max_seqs=8, context_len=64, page_size=page_size)
    return build_forward_batch(chunks, page_size=page_size, shape=buckets.shape_for(chunks))


@pytest.mark.parametrize(
    "mode,page_size,gqa,tree",
    [(m, ps, g, None) for m, ps, g in itertools.product(BATCH_MODES, [1, 4, 16], [1, 4])]
    + [("mixed", ps, g, "branching") for ps, g in itertools.product([1, 16], [1, 2])],
)
@pytest.mark.parametrize("block_tokens", [4, 64])  # several blocks per sequence, or one
def test_matches_per_token_loop(mode, page_size, gqa, tree, block_tokens):
    rng = np.random.default_rng(0)
    n_kv, hd = 2, 8
    problem = random_problem(rng, **BATCH_MODES[mode], page_size=page_size, n_heads=n_kv * gqa,
                             n_kv=n_kv, head_dim=hd, tree=tree)
    # The layer's pages behind other layers' NaN pages, as in a model's shared arrays.
    layer_kv = written_pages(problem, OTHER_LAYERS_PAGES)
    out = ragged_paged_attention_reference(
        problem.q, layer_kv.k, layer_kv.v, problem.metadata, scale=hd**-0.5,
        block_tokens=block_tokens, page_offset=layer_kv.first_page)
    out, k_after = np.asarray(out), np.asarray(layer_kv.k)
    for expected, rows in zip(expected_outputs(problem, hd**-0.5), problem.rows, strict=True):
        np.testing.assert_allclose(out[rows], expected, rtol=1e-5, atol=1e-5)
    for chunk, k in zip(problem.chunks, problem.full_k, strict=True):
        last = OTHER_LAYERS_PAGES + chunk.page_ids[(len(k) - 1) // page_size]
        np.testing.assert_array_equal(k_after[last, :, (len(k) - 1) % page_size], k[-1])
    assert not np.isnan(out[np.concatenate(problem.rows)]).any()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tree", ["chain", "branching"])
def test_device_built_tree_windows_match_per_token_loop(page_size, tree):
    """Verify windows as a speculative round builds them: packed mask bits, a padding window."""
    rng = np.random.default_rng(1)
    problem = random_problem(rng, q_lens=[7, 7, 5], prefix_lens=TREE_PREFIX_LENS,
                             page_size=page_size, n_heads=4, n_kv=2, head_dim=8, tree=tree,
                             windows=True)
    layer_kv = written_pages(problem)
    out = np.asarray(ragged_paged_attention_reference(problem.q, layer_kv.k, layer_kv.v,
                                                      problem.metadata, scale=0.5))
    for expected, rows in zip(expected_outputs(problem, 0.5), problem.rows, strict=True):
        np.testing.assert_allclose(out[rows], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch,window", [
    (BATCH_MODES["mixed"], 5),
    (BATCH_MODES["prefill"], 7),
    (dict(q_lens=[7, 7, 5], prefix_lens=TREE_PREFIX_LENS, tree="chain", windows=True), 4),
], ids=["mixed", "prefill", "chain_windows"])
def test_sliding_window_matches_per_token_loop(batch, window):
    """Query i sees key j only when i - W < j: prefix keys and earlier new tokens drop out."""
    rng = np.random.default_rng(4)
    problem = random_problem(rng, **batch, page_size=4, n_heads=4, n_kv=2, head_dim=8)
    layer_kv = written_pages(problem)
    out = np.asarray(ragged_paged_attention_reference(
        problem.q, layer_kv.k, layer_kv.v, problem.metadata, scale=0.5, block_tokens=4,
        sliding_window=window))
    windowed, full = expected_outputs(problem, 0.5, window), expected_outputs(problem, 0.5)
    for expected, rows in zip(windowed, problem.rows, strict=True):
        np.testing.assert_allclose(out[rows], expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.concatenate(windowed), np.concatenate(full)), "window cut nothing"


@pytest.mark.parametrize("window", [0, 2.5, True])
def test_sliding_window_must_be_a_positive_int(window):
    problem = random_problem(np.random.default_rng(0), **BATCH_MODES["decode"], page_size=4,
                             n_heads=2, n_kv=2, head_dim=8)
    with pytest.raises(ValueError, match="sliding_window must be a positive int or None"):
        native_attention(problem.q, problem.new_k, problem.new_v, pages_of(problem),
                         problem.metadata, scale=1.0, sliding_window=window)


@pytest.mark.parametrize("mode,window,kv_dtype", [
    ("mixed", None, "fp8_e4m3"), ("tree_topk4", None, "fp8_e5m2"),
    ("tree_topk1", 9, "fp8_e4m3"), ("mixed", 20, "fp8_e5m2")])
def test_reads_fp8_pages(mode, window, kv_dtype):
    """--kv-cache-dtype fp8: native_attention casts this step's K/V to the pages' dtype as it
    writes them and every page it reads to q's float32: the output is the per-token loop's
    over K/V rounded to fp8 (causal, a tree window, sliding windows)."""
    problem = kernel_problem(mode, page_size=4, gqa=2, dtype="float32", kv_dtype=kv_dtype)

    def backend(q, k_pages, v_pages, metadata, scale, page_offset):
        return ragged_paged_attention_reference(q, k_pages, v_pages, metadata, scale=scale,
                                                block_tokens=16, sliding_window=window,
                                                page_offset=page_offset)
    assert_reads_kv_pages(backend, problem, sliding_window=window)
    written = native_attention(jnp.asarray(problem.q), jnp.asarray(problem.new_k),
                               jnp.asarray(problem.new_v), pages_of(problem),
                               problem.metadata, scale=0.125)[1]
    assert written.k.dtype == written.v.dtype == FP8_KV_DTYPES[kv_dtype]


def test_mask_bits_round_trip_past_one_word():
    rng = np.random.default_rng(2)
    mask = rng.random((3, 70)) < 0.5
    bits = pack_mask_bits(mask)
    assert bits.shape == (3, 3) and bits.dtype == jnp.int32
    offsets = jnp.arange(-4, 74)[None, :]  # prefix keys and keys past the window see nothing
    visible = window_visible([bits[:, j : j + 1] for j in range(3)], offsets)
    expected = np.zeros((3, 78), bool)
    expected[:, 4:74] = mask
    np.testing.assert_array_equal(np.asarray(visible), expected)


def test_hand_worked_single_query():
    # One head, head_dim 1, keys 0, 1, 2 and values 10, 20, 30 in pages of 2; query 1, scale 1:
    # softmax([0, 1, 2]) @ [10, 20, 30].
    k_pages = np.zeros((3, 1, 2, 1), np.float32)  # [pages, n_kv, page_size, hd]
    v_pages = np.zeros((3, 1, 2, 1), np.float32)
    k_pages[1, 0, :, 0], v_pages[1, 0, :, 0] = [0, 1], [10, 20]
    batch = pack([SeqChunk([0], 2, [1, 2])], page_size=2)
    q = np.ones((1, 1, 1), np.float32)
    new = np.full((1, 1, 1), 2.0, np.float32)
    layer_kv = LayerKV(jnp.asarray(k_pages), jnp.asarray(v_pages))
    out, _ = native_attention(q, new, new * 15, layer_kv, batch.attention, scale=1.0)
    weights = np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum()
    assert float(np.asarray(out)[0, 0, 0]) == pytest.approx(weights @ [10, 20, 30], rel=1e-6)


@pytest.mark.parametrize("tree", ["chain", "branching"])
def test_a_packed_batch_attends_and_writes_only_its_tokens(tree):
    """A packed verify (token_windows): each window keeps its first tokens (7, 7, 5 wide; it
    keeps 3, 7 and 1, the padding window none), packed with padding after them. The kept
    tokens attend as in the whole windows (a node sees only earlier nodes), padding tokens
    give zeros, and only the kept tokens' K/V reach the cache (the rest stay unwritten)."""
    problem = random_problem(np.random.default_rng(5), q_lens=[7, 7, 5],
                             prefix_lens=TREE_PREFIX_LENS, page_size=4, n_heads=4, n_kv=2,
                             head_dim=8, tree=tree, windows=True)
    meta, counts = problem.metadata, np.array([3, 7, 1, 0])
    width = meta.q_block
    kept = (np.arange(width)[None, :] < counts[:, None]).reshape(-1)
    packed = packed_nodes(counts, width, 16)
    meta = dataclasses.replace(
        meta, slot_mapping=np.where(kept, meta.slot_mapping, 0),
        kv_lens=np.where(counts > 0, np.asarray(meta.window_starts) + counts, 0),
        token_windows=packed)
    take = np.minimum(packed, len(kept) - 1)  # padding tokens carry any values
    out, written = native_attention(
        problem.q[take], problem.new_k[take], problem.new_v[take], pages_of(problem), meta,
        scale=0.5)
    out, k_after = np.asarray(out), np.asarray(written.k)
    start = 0
    for count, expected in zip(counts, expected_outputs(problem, 0.5), strict=False):
        np.testing.assert_allclose(out[start : start + count], expected[:count], rtol=1e-5,
                                   atol=1e-5)
        start += count
    np.testing.assert_array_equal(out[start:], 0)
    page_size = k_after.shape[2]
    slots = np.asarray(problem.metadata.slot_mapping)
    for window_slot, slot in enumerate(slots):
        written = k_after[slot // page_size, :, slot % page_size]
        if kept[window_slot]:
            np.testing.assert_array_equal(written, problem.new_k[window_slot])
        elif slot:
            assert np.isnan(written).all(), f"window slot {window_slot} was written"
