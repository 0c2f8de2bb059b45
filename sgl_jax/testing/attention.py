"""Random ragged paged-attention problems for testing attention backends and kernels.

Every problem lives in a cache whose unused slots hold NaN, so a kernel that reads a slot it
should not see (another sequence's page, a stale tail, the null page) poisons its output.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers.attention import AttentionMetadata, LayerKV
from sgl_jax.model_executor.forward_batch import (
    Buckets,
    SeqChunk,
    build_forward_batch,
    token_positions,
    window_metadata,
)

# Query lengths and prefix lengths of each sequence, per batch mode.
BATCH_MODES = {
    "decode": dict(q_lens=[1, 1, 1], prefix_lens=[5, 70, 1]),
    "prefill": dict(q_lens=[9, 3, 40], prefix_lens=[0, 0, 0]),
    "mixed": dict(q_lens=[1, 12, 4, 1], prefix_lens=[30, 0, 7, 66]),
}
TREE_PREFIX_LENS = [0, 37, 11]  # prefixes of the verify windows (one window per sequence)


@dataclass
class AttentionProblem:
    q: np.ndarray  # [T, n_heads, hd]
    new_k: np.ndarray  # [T, n_kv, hd]: this step's keys, zero on padding tokens
    new_v: np.ndarray  # [T, n_kv, hd]
    # [num_pages, n_kv, page_size, hd], in the problem's kv_dtype: prefixes written, the rest NaN
    k_pages: np.ndarray
    v_pages: np.ndarray
    metadata: AttentionMetadata
    chunks: list[SeqChunk]
    # per sequence f32[prefix + q_len, n_kv, hd]: all its keys, as the cache holds them (rounded
    # to kv_dtype when the pages store one)
    full_k: list[np.ndarray]
    full_v: list[np.ndarray]
    rows: list[np.ndarray]  # per sequence: where its new tokens sit among the T tokens


def random_tree_mask(rng: np.random.Generator, n: int, *, branching: bool = True) -> np.ndarray:
    """bool[n, n]: each node sees itself and its ancestors. A chain when not branching."""
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        parent = rng.integers(0, i) if branching else i - 1
        mask[i] |= mask[parent]
    return mask


def random_problem(
    rng: np.random.Generator,
    *,
    q_lens: list[int],
    prefix_lens: list[int],
    page_size: int,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    dtype=np.float32,
    tree: str | None = None,  # None (causal), "chain" or "branching"
    windows: bool = False,  # metadata as a verify round builds it on the device
    kv_dtype=None,  # what the pages store (e.g. an fp8 dtype); None: `dtype`
) -> AttentionProblem:
    """With a `kv_dtype`, this step's new_k / new_v stay in `dtype` (the backend casts them as
    it writes), while full_k / full_v hold every key and value rounded to kv_dtype and back,
    which is what a backend reading those pages must attend over."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    num_pages = 1 + sum(-(-(p + q) // page_size) for p, q in zip(prefix_lens, q_lens, strict=True))
    k_pages = np.full((num_pages + 3, n_kv, page_size, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    page_ids = rng.permutation(np.arange(1, num_pages + 3))  # scattered, some never used
    chunks, full_k, full_v, new_kv, next_page = [], [], [], [], 0
    for prefix, q_len in zip(prefix_lens, q_lens, strict=True):
        n_pages = -(-(prefix + q_len) // page_size)
        pages = page_ids[next_page : next_page + n_pages].tolist()
        next_page += n_pages
        k = rng.normal(size=(prefix + q_len, n_kv, head_dim)).astype(dtype).astype(np.float32)
        v = rng.normal(size=(prefix + q_len, n_kv, head_dim)).astype(dtype).astype(np.float32)
        new_kv.append((k[prefix:], v[prefix:]))  # as the model computes them, in `dtype`
        k, v = (x.astype(kv_dtype).astype(np.float32) for x in (k, v))  # as the cache holds
        for i in range(prefix):  # the prefix was written by earlier steps
            k_pages[pages[i // page_size], :, i % page_size] = k[i]
            v_pages[pages[i // page_size], :, i % page_size] = v[i]
        mask = None if tree is None else random_tree_mask(rng, q_len,
                                                           branching=tree == "branching")
        chunks.append(SeqChunk([0] * q_len, prefix, pages, tree_mask=mask))
        full_k.append(k)
        full_v.append(v)

    if windows:
        metadata, rows = _window_batch(chunks, page_size, num_pages + 3)
    else:
        buckets = Buckets.automatic(max_tokens=256, max_seqs=8, context_len=128,
                                    page_size=page_size)
        shape = buckets.shape_for(chunks)
        metadata = build_forward_batch(chunks, page_size=page_size, shape=shape).attention
        rows = token_positions(chunks, shape)
    num_tokens = metadata.slot_mapping.shape[0]
    q = rng.normal(size=(num_tokens, n_heads, head_dim)).astype(dtype)
    new_k = np.zeros((num_tokens, n_kv, head_dim), np.float32)
    new_v = np.zeros((num_tokens, n_kv, head_dim), np.float32)
    for (k, v), where in zip(new_kv, rows, strict=True):
        new_k[where], new_v[where] = k, v
    return AttentionProblem(q, new_k.astype(dtype), new_v.astype(dtype),
                            k_pages.astype(kv_dtype), v_pages.astype(kv_dtype), metadata, chunks,
                            full_k, full_v, rows)


def _window_batch(chunks: list[SeqChunk], page_size: int, num_pages: int):
    """One window per chunk, all as wide as the longest, plus one padding window."""
    width = max(len(c.token_ids) for c in chunks)
    batch = len(chunks) + 1
    pages_per_seq = max(len(c.page_ids) for c in chunks) + 1
    page_table = np.zeros((batch, pages_per_seq), np.int32)
    prefix_lens = np.zeros(batch, np.int32)
    num_valid = np.zeros(batch, np.int32)
    masks = np.zeros((batch, width, width), bool)
    rows = []
    for i, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        page_table[i, : len(chunk.page_ids)] = chunk.page_ids
        prefix_lens[i], num_valid[i] = chunk.prefix_len, n
        masks[i, :n, :n] = chunk.tree_mask
        rows.append(i * width + np.arange(n))
    metadata = window_metadata(jnp.asarray(page_table), jnp.asarray(prefix_lens),
                               jnp.asarray(num_valid), width, page_size, jnp.asarray(masks))
    return metadata, rows


def naive_attention(q, keys, values, visible, scale):
    """One query token: q [n_heads, hd]; keys/values [kv, n_kv, hd]; visible bool[kv]."""
    group = q.shape[0] // keys.shape[1]
    out = np.zeros(q.shape, np.float64)
    for h in range(q.shape[0]):
        scores = keys[visible, h // group].astype(np.float64) @ q[h].astype(np.float64) * scale
        probs = np.exp(scores - scores.max())
        out[h] = (probs / probs.sum()) @ values[visible, h // group]
    return out


def expected_outputs(problem: AttentionProblem, scale: float,
                     sliding_window: int | None = None) -> list[np.ndarray]:
    """Per sequence [q_len, n_heads, hd], token by token in float64; with a sliding window W,
    token i of the KV sees key j only when i - W < j."""
    outputs = []
    for chunk, k, v, where in zip(problem.chunks, problem.full_k, problem.full_v, problem.rows,
                                  strict=True):
        rows = []
        for j, token in enumerate(where):
            visible = np.arange(len(k)) <= chunk.prefix_len + j
            if chunk.tree_mask is not None:
                visible[chunk.prefix_len :] = chunk.tree_mask[j]
            if sliding_window is not None:
                visible &= np.arange(len(k)) > chunk.prefix_len + j - sliding_window
            rows.append(naive_attention(np.asarray(problem.q[token], np.float32), k, v, visible,
                                        scale))
        outputs.append(np.stack(rows))
    return outputs


# Batch modes of the kernel tests: the plain ones plus verify windows of a chain (topk 1) and
# of a branching tree (topk 4), built on the device as a speculative round builds them.
KERNEL_MODES = {
    **BATCH_MODES,
    "tree_topk1": dict(q_lens=[6, 6, 4], prefix_lens=TREE_PREFIX_LENS, tree="chain",
                       windows=True),
    "tree_topk4": dict(q_lens=[7, 7, 5], prefix_lens=TREE_PREFIX_LENS, tree="branching",
                       windows=True),
}
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}
# --kv-cache-dtype's 8-bit page formats (pages cast on write, read back as q's dtype).
FP8_KV_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
# (mode, kv_dtype) of the kernels' fp8-page tests: a mixed batch and a branching tree window.
KERNEL_FP8_CASES = list(itertools.product(["mixed", "tree_topk4"], FP8_KV_DTYPES))
KERNEL_GQAS = [1, 4, 8]
KERNEL_PAGE_SIZES = [1, 16, 64]


def _kernel_cases() -> list[tuple[str, int, int, str]]:
    """(mode, gqa, page_size, dtype) every kernel is tested over (head_dim 64): every mode
    with every GQA ratio and dtype, the page size rotating so that each mode, ratio and dtype
    also meets each page size. 30 cases; the full product's 90 took about 4 minutes more per
    kernel on 2 CPU cores."""
    return [(mode, gqa, KERNEL_PAGE_SIZES[(m + g + d) % 3], dtype)
            for m, mode in enumerate(KERNEL_MODES)
            for g, gqa in enumerate(KERNEL_GQAS)
            for d, dtype in enumerate(DTYPES)]


KERNEL_CASES = _kernel_cases()
# Head dims beyond the product's 64: not powers of two (24, 80, 96), and Qwen3-Next's 256.
KERNEL_HEAD_DIMS = [24, 80, 96, 256]


def _head_dim_cases() -> list[tuple[str, int, int, str, int]]:
    """(mode, gqa, page_size, dtype, head_dim): per head dim, every mode with two of the three
    GQA ratios, and page size and dtype rotating with mode, ratio and head dim. Each head dim
    meets every mode, GQA ratio, page size and dtype in 10 cases; the product's 90 per head dim
    would take about 7 minutes per kernel on 2 CPU cores."""
    dtypes = list(DTYPES)
    return [(mode, gqa, KERNEL_PAGE_SIZES[(g + m + j) % 3], dtypes[(g + m + j) % 2], head_dim)
            for j, head_dim in enumerate(KERNEL_HEAD_DIMS)
            for m, mode in enumerate(KERNEL_MODES)
            for g, gqa in enumerate(KERNEL_GQAS) if g != (m + j) % 3]


KERNEL_HEAD_DIM_CASES = _head_dim_cases()
# (mode, head_dim, gqa, n_kv): Qwen3-Next's head_dim 256, Qwen2.5-7B's 7 query heads per KV head.
KERNEL_WIDE_HEADS = list(itertools.product(["mixed", "tree_topk4"], [(128, 7, 1), (256, 2, 2)]))
# (mode, sliding_window) at page size 4, gqa 2, float32 and 16-token KV blocks: the windows cut
# prefixes and new tokens, and leave whole KV blocks behind them (which kernels may skip).
KERNEL_SLIDING_WINDOWS = [("mixed", 20), ("tree_topk1", 9)]


def kernel_problem(mode: str, *, page_size: int, gqa: int, dtype: str, head_dim: int = 64,
                   n_kv: int = 2, seed: int = 0, kv_dtype: str | None = None) -> AttentionProblem:
    """kv_dtype: a key of FP8_KV_DTYPES for pages stored in 8 bits; None: `dtype`'s pages."""
    return random_problem(np.random.default_rng(seed), **KERNEL_MODES[mode],
                          page_size=page_size, n_heads=n_kv * gqa, n_kv=n_kv,
                          head_dim=head_dim, dtype=DTYPES[dtype],
                          kv_dtype=kv_dtype and FP8_KV_DTYPES[kv_dtype])


def check_wide_heads(kernel, mode: str, heads: tuple[int, int, int]) -> None:
    head_dim, gqa, n_kv = heads
    problem = kernel_problem(mode, page_size=16, gqa=gqa, dtype="bfloat16", head_dim=head_dim,
                             n_kv=n_kv)
    assert_kernel_matches_reference(kernel, problem, dtype="bfloat16")


# Pages of other layers before the problem's in the arrays a kernel reads (a model's layers
# share one pair): NaN, so a kernel that ignores its page_offset reads them and fails.
OTHER_LAYERS_PAGES = 3


def written_pages(problem: AttentionProblem, leading_pages: int = 0) -> LayerKV:
    """The problem's pages with this step's K/V written (cast to the pages' dtype), behind
    `leading_pages` NaN pages of other layers (the view's first_page)."""
    def pages(array: np.ndarray) -> jax.Array:
        others = np.full((leading_pages, *array.shape[1:]), np.nan, array.dtype)
        return jnp.asarray(np.concatenate([others, array]))

    layer_kv = LayerKV(pages(problem.k_pages), pages(problem.v_pages), leading_pages)
    return layer_kv.write(problem.metadata.slot_mapping, jnp.asarray(problem.new_k),
                          jnp.asarray(problem.new_v))


def assert_kernel_matches_reference(kernel, problem: AttentionProblem, *, dtype: str,
                                    sliding_window: int | None = None) -> None:
    """kernel(q, k_pages, v_pages, metadata, scale, page_offset) against the jnp reference on
    the same cache: equal on every real token, and finite everywhere although unused slots
    are NaN. The kernel reads the layer's pages behind other layers' NaN pages (page_offset);
    the reference reads them alone. The reference runs with `sliding_window`; the kernel must
    carry the same one itself."""
    from sgl_jax.layers.attention.checks import check_dynamic_inputs
    from sgl_jax.layers.attention.native import ragged_paged_attention_reference

    page_size, head_dim = problem.k_pages.shape[2], problem.q.shape[2]
    check_dynamic_inputs(problem.metadata, num_pages=problem.k_pages.shape[0],
                         page_size=page_size)
    alone, shared = written_pages(problem), written_pages(problem, OTHER_LAYERS_PAGES)
    q, scale = jnp.asarray(problem.q), head_dim**-0.5
    expected = ragged_paged_attention_reference(q, alone.k, alone.v, problem.metadata,
                                                scale=scale, sliding_window=sliding_window)
    out = kernel(q, shared.k, shared.v, problem.metadata, scale, shared.first_page)
    assert out.shape == q.shape and out.dtype == q.dtype
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    assert np.isfinite(out).all(), "a NaN from an unused cache slot reached the output"
    rows = np.concatenate(problem.rows)
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(out[rows], expected[rows], rtol=tolerance, atol=tolerance)


def assert_reads_kv_pages(kernel, problem: AttentionProblem, *,
                          sliding_window: int | None = None) -> None:
    """kernel(q, k_pages, v_pages, metadata, scale, page_offset) over pages stored in another
    dtype than q (fp8), behind other layers' pages: this step's K/V are written (cast) by
    `LayerKV.write`, then the output must equal the float64 per-token oracle over the keys and
    values as the pages hold them, within float32 tolerance, and be q's dtype. With a
    `sliding_window` the kernel must carry it itself."""
    head_dim = problem.q.shape[2]
    layer_kv = written_pages(problem, OTHER_LAYERS_PAGES)
    assert layer_kv.k.dtype == problem.k_pages.dtype != problem.q.dtype
    q, scale = jnp.asarray(problem.q), head_dim**-0.5
    out = kernel(q, layer_kv.k, layer_kv.v, problem.metadata, scale, layer_kv.first_page)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "a NaN from an unused cache slot reached the output"
    for expected, rows in zip(expected_outputs(problem, scale, sliding_window), problem.rows,
                              strict=True):
        np.testing.assert_allclose(out[rows], expected, rtol=1e-5, atol=1e-5)


def lowered_text(kernel, problem: AttentionProblem, platform: str) -> str:
    """StableHLO of kernel(q, k_pages, v_pages, metadata) lowered for `platform` ('tpu' or
    'cuda'): runs the real Pallas -> Mosaic / Triton lowering on any host."""
    import jax

    args = (jnp.asarray(problem.q), jnp.asarray(problem.k_pages), jnp.asarray(problem.v_pages),
            problem.metadata)
    return jax.jit(kernel).trace(*args).lower(lowering_platforms=(platform,)).as_text()
