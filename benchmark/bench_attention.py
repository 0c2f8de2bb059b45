"""The `fa` attention kernel against the jnp reference (`native`) across batch sizes, context
lengths and page sizes.

Every configuration builds a paged cache holding B sequences of --context-lens tokens and times
one attention call (the K/V of the step already written), after a warm-up call with the same
shapes, so compilation is excluded. Decode is one new token per sequence; prefill is a chunk of
--prefill-len new tokens per sequence at the end of its context. Printed per configuration:
milliseconds for kernel and reference, the largest difference between them, and:

- decode: achieved HBM bandwidth, the bytes that must be read (every visible K/V entry, the
  queries, the page table) over the kernel's time, and its share of the read bandwidth
  measured in the same run (a jitted sum over 2 GiB) and of the vendor's peak;
- prefill: achieved TFLOP/s, 4 * head_dim * n_heads per visible (query, key) pair.

    python benchmark/bench_attention.py                          # on a GPU or TPU
    python benchmark/bench_attention.py --batch-sizes 32 --context-lens 2048 --modes decode
    python benchmark/bench_attention.py --json /tmp/attention.json --peak-gbs 3350
    python benchmark/bench_attention.py --modes decode --peer jax   # beside JAX's own kernel

`--peer jax` (the default on a GPU) also times JAX's Pallas GPU paged-attention kernel
(`jax.experimental.pallas.ops.gpu.paged_attention`, its default block settings) on each decode
problem: the same queries and pages, moved to its head-major layout outside the timed call,
checked against the same reference.
On a CPU the kernel runs in Pallas interpret mode: use tiny sizes, and read the timings as a
functional check only (the defaults shrink there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

try:
    import sgl_jax  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

from sgl_jax.layers.attention.flash import platform_kernel
from sgl_jax.layers.attention.native import ragged_paged_attention_reference
from sgl_jax.model_executor.forward_batch import Buckets, SeqChunk, build_forward_batch

# Peak HBM bandwidth in GB/s by device kind (vendor figures), for the share-of-peak column.
PEAK_GBS = {"H100": 3350, "H200": 4800, "A100": 2039, "TPU v5 lite": 819, "TPU v5p": 2765,
            "TPU v6 lite": 1640, "TPU v4": 1228}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    on_cpu = jax.default_backend() == "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="decode,prefill",
                        type=lambda s: [m for m in s.split(",") if m])
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 4] if on_cpu else [1, 8, 32])
    parser.add_argument("--context-lens", type=int_list,
                        default=[64] if on_cpu else [512, 2048, 8192])
    parser.add_argument("--page-sizes", type=int_list, default=[16] if on_cpu else [16, 64])
    parser.add_argument("--prefill-len", type=int, default=32 if on_cpu else 512,
                        help="new tokens per sequence in prefill mode")
    parser.add_argument("--num-heads", type=int, default=4 if on_cpu else 32)
    parser.add_argument("--num-kv-heads", type=int, default=2 if on_cpu else 8)
    parser.add_argument("--head-dim", type=int, default=64 if on_cpu else 128)
    parser.add_argument("--dtype", default="float32" if on_cpu else "bfloat16",
                        choices=["float32", "bfloat16"])
    parser.add_argument("--kv-dtype", default=None,
                        help="the pages' dtype, e.g. float8_e4m3fn as --kv-cache-dtype fp8_e4m3 "
                             "stores them (default: --dtype); JAX's kernel is then not timed")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2 if on_cpu else 20)
    parser.add_argument("--peak-gbs", type=float, default=None,
                        help="peak HBM bandwidth in GB/s; default: looked up by device kind")
    parser.add_argument("--peer", choices=["jax", "none"], default="none" if on_cpu else "jax",
                        help="decode only: also time JAX's Pallas GPU paged-attention kernel "
                             "(interpreted on a CPU)")
    parser.add_argument("--json", default=None, help="also write every row to this file")
    args = parser.parse_args(argv)
    args.kv_dtype = args.kv_dtype or args.dtype
    unknown = set(args.modes) - {"decode", "prefill"}
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; choose from decode, prefill")
    return args


def build_problem(args, mode: str, batch: int, context: int, page_size: int):
    """q [T, H, hd], the paged cache with every sequence's context written, the metadata,
    the chunks and each chunk's first row of q (chunks start on query-block boundaries)."""
    new_tokens = 1 if mode == "decode" else min(args.prefill_len, context)
    pages_per_seq = -(-context // page_size)
    chunks = [SeqChunk([0] * new_tokens, context - new_tokens,
                       list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)))
              for i in range(batch)]
    buckets = Buckets.automatic(max_tokens=max(16, batch * (-(-new_tokens // 16) * 16)),
                                max_seqs=batch, context_len=context, page_size=page_size)
    shape = buckets.shape_for(chunks)
    metadata = build_forward_batch(chunks, page_size=page_size, shape=shape).attention
    metadata = jax.tree.map(jnp.asarray, metadata)
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 3)
    cache_shape = (1 + batch * pages_per_seq, args.num_kv_heads, page_size, args.head_dim)
    kv_dtype = jnp.dtype(args.kv_dtype)
    k_pages = jax.random.normal(keys[0], cache_shape, dtype).astype(kv_dtype)
    v_pages = jax.random.normal(keys[1], cache_shape, dtype).astype(kv_dtype)
    q = jax.random.normal(keys[2], (metadata.slot_mapping.shape[0], args.num_heads,
                                    args.head_dim), dtype)
    first_rows = np.arange(batch) * (-(-new_tokens // shape.q_block) * shape.q_block)
    return q, k_pages, v_pages, metadata, chunks, first_rows


def time_call(fn, args, *, warmup: int, repeats: int) -> tuple[float, jax.Array]:
    """Median seconds of fn(*args), result on the device and complete."""
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def visible_pairs(chunks) -> int:
    """(query, key) pairs that causal attention computes over the batch's new tokens."""
    total = 0
    for chunk in chunks:
        q_len = len(chunk.token_ids)
        total += q_len * chunk.prefix_len + q_len * (q_len + 1) // 2
    return total


def bytes_read(args, chunks, q: jax.Array) -> int:
    """What decode attention must read at least: each sequence's K and V (in the pages' dtype),
    q and the output."""
    itemsize = jnp.dtype(args.kv_dtype).itemsize
    kv_tokens = sum(c.prefix_len + len(c.token_ids) for c in chunks)
    return 2 * kv_tokens * args.num_kv_heads * args.head_dim * itemsize + 2 * q.nbytes


def peak_bandwidth(args) -> float | None:
    if args.peak_gbs is not None:
        return args.peak_gbs
    kind = jax.devices()[0].device_kind
    return next((gbs for name, gbs in PEAK_GBS.items() if name in kind), None)


def measured_bandwidth(gib: float = 2.0, repeats: int = 10) -> float:
    """GB/s of the best streaming read on this device (a jitted sum over `gib` of bfloat16),
    the ceiling a decode kernel, which only reads, can approach."""
    x = jnp.ones((int(gib * (1 << 30)) // 2 // 4096, 4096), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    seconds, _ = time_call(total, (x,), warmup=2, repeats=repeats)
    return x.nbytes / seconds / 1e9


def run_config(args, mode, batch, context, page_size, kernel) -> dict:
    q, k_pages, v_pages, metadata, chunks, first_rows = build_problem(args, mode, batch, context,
                                                                      page_size)
    scale = args.head_dim**-0.5
    kernel_fn = jax.jit(lambda *a: kernel(*a, scale=scale))
    reference_fn = jax.jit(lambda *a: ragged_paged_attention_reference(*a, scale=scale))
    timing = dict(warmup=args.warmup, repeats=args.repeats)
    kernel_s, out = time_call(kernel_fn, (q, k_pages, v_pages, metadata), **timing)
    reference_s, expected = time_call(reference_fn, (q, k_pages, v_pages, metadata), **timing)
    row = dict(mode=mode, batch=batch, context=context, page_size=page_size,
               kernel_ms=kernel_s * 1e3, reference_ms=reference_s * 1e3,
               max_abs_diff=float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                  - expected.astype(jnp.float32)))))
    if mode == "decode":
        row["kernel_gbs"] = bytes_read(args, chunks, q) / kernel_s / 1e9
        peak = peak_bandwidth(args)
        row["share_of_peak"] = row["kernel_gbs"] / peak if peak else None
        row["share_of_measured"] = row["kernel_gbs"] / args.measured_gbs
        if args.peer == "jax" and args.kv_dtype == args.dtype:
            row.update(jax_peer_row(args, q[first_rows], k_pages, v_pages, chunks, q,
                                    expected[first_rows]))
    else:
        flops = 4 * visible_pairs(chunks) * args.head_dim * args.num_heads
        row["kernel_tflops"] = flops / kernel_s / 1e12
    return row


def jax_peer_row(args, decode_q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, chunks,
                 q: jax.Array, expected: jax.Array) -> dict:
    """JAX's own Pallas GPU paged-attention kernel on the same decode problem: its time, its
    bandwidth by the same byte count (`q`: the padded queries of ours), and its largest
    difference from the reference's rows `expected` [B, H, hd]."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    # Its layout: q [B, H, hd] (one token a sequence, unscaled: scale q), pages
    # [KVH, pages, page_size, hd], a block table [B, pages_per_seq] and lengths [B].
    peer_q = decode_q * jnp.asarray(args.head_dim**-0.5, decode_q.dtype)
    peer_k, peer_v = (jnp.transpose(pages, (1, 0, 2, 3)) for pages in (k_pages, v_pages))
    tables = jnp.asarray([chunk.page_ids for chunk in chunks], jnp.int32)
    lengths = jnp.asarray([chunk.prefix_len + len(chunk.token_ids) for chunk in chunks],
                          jnp.int32)
    # Its defaults (16 splits of 8-page blocks) where the pages allow, e.g. 2k context in
    # 16-token pages; fewer splits for the short contexts of a CPU check.
    splits = min(16, tables.shape[1])
    settings = dict(k_splits=splits, pages_per_compute_block=min(8, tables.shape[1] // splits),
                    interpret=jax.default_backend() == "cpu")
    peer_fn = jax.jit(lambda *a: paged_attention(*a, **settings))
    seconds, out = time_call(peer_fn, (peer_q, peer_k, peer_v, tables, lengths),
                             warmup=args.warmup, repeats=args.repeats)
    gbs = bytes_read(args, chunks, q) / seconds / 1e9
    return dict(peer_ms=seconds * 1e3, peer_gbs=gbs,
                peer_max_abs_diff=float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                        - expected.astype(jnp.float32)))))


def format_row(row: dict) -> str:
    text = (f"{row['mode']:>7} B={row['batch']:<3} ctx={row['context']:<5} "
            f"page={row['page_size']:<3} kernel {row['kernel_ms']:9.3f} ms  reference "
            f"{row['reference_ms']:9.3f} ms  max|diff| {row['max_abs_diff']:.1e}")
    if row["mode"] == "decode":
        text += f"  {row['kernel_gbs']:8.1f} GB/s"
        text += f" ({100 * row['share_of_measured']:.0f}% of measured"
        if row["share_of_peak"] is not None:
            text += f", {100 * row['share_of_peak']:.0f}% of peak"
        text += ")"
        if "peer_ms" in row:
            text += (f"  | JAX's kernel {row['peer_ms']:9.3f} ms {row['peer_gbs']:8.1f} GB/s "
                     f"max|diff| {row['peer_max_abs_diff']:.1e}")
    else:
        text += f"  {row['kernel_tflops']:7.2f} TFLOP/s"
    return text


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = jax.devices()[0]
    kernel = platform_kernel(jax.default_backend())
    print(f"device: {device.device_kind} ({jax.default_backend()}); heads {args.num_heads}/"
          f"{args.num_kv_heads} kv, head_dim {args.head_dim}, {args.dtype}, pages {args.kv_dtype}"
          + ("; kernel interpreted (timings are not kernel performance)"
             if jax.default_backend() == "cpu" else ""))
    args.measured_gbs = measured_bandwidth(0.25 if jax.default_backend() == "cpu" else 2.0)
    print(f"measured read bandwidth: {args.measured_gbs:.0f} GB/s")
    rows = []
    for mode in args.modes:
        for batch in args.batch_sizes:
            for context in args.context_lens:
                for page_size in args.page_sizes:
                    rows.append(run_config(args, mode, batch, context, page_size, kernel))
                    print(format_row(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device.device_kind,
                                                   measured_gbs=args.measured_gbs, rows=rows),
                                              indent=2))
    return rows


if __name__ == "__main__":
    main()
