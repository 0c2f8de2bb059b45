"""Per-device memory under tensor parallelism: for each TP size, the parameter bytes and the KV
bytes per token that one device holds, beside the 1/tp ideal, and how far the logits of one
prefill drift from TP 1's (they should agree to float rounding). With `--weight-formats`
(e.g. bfloat16,int8,fp8) every TP size loads the model in each format and the table adds
each one's bytes as a ratio of the first's; `--kv-cache-dtypes` (e.g. bfloat16,fp8_e4m3)
allocates the KV pages in each dtype and prints their bytes per token and how many pages
a fixed budget holds.

On a CPU the script asks XLA for as many host devices as the largest TP size (unless
XLA_FLAGS already sets a count). Default model: the ~66M-parameter float32 Llama of the other
benchmarks with 2 KV heads, so TP 4 and 8 hold copies of KV heads.

    python benchmark/bench_tp_memory.py [--model-path M] [--tp-sizes 1,2,4,8] [--json out.json]
    python benchmark/bench_tp_memory.py --dtype bfloat16 --weight-formats bfloat16,int8,fp8 \
        --kv-cache-dtypes bfloat16,fp8_e4m3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

COUNT_FLAG = "--xla_force_host_platform_device_count"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: generate a random Llama")
    parser.add_argument("--tp-sizes", default="1,2,4,8")
    parser.add_argument("--num-kv-heads", type=int, default=2, help="of the generated model")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32", help="the model dtype")
    parser.add_argument("--weight-formats", default=None,
                        help="comma list of the dtype's name, int8, fp8: each loaded at every "
                             "TP size, bytes as a ratio of the first")
    parser.add_argument("--kv-cache-dtypes", default=None,
                        help="comma list of --kv-cache-dtype values to allocate pages in")
    parser.add_argument("--kv-budget-mib", type=float, default=64.0,
                        help="the fixed per-device KV budget the page counts are taken from")
    parser.add_argument("--json", default=None, help="also write the rows here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    if COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COUNT_FLAG}={max(tp_sizes)}"
    with tempfile.TemporaryDirectory(prefix="bench_tp_memory_") as scratch:
        path = args.model_path or generate_model(Path(scratch), args.num_kv_heads)
        rows = [measure(path, tp, args.prompt_len, args.dtype) for tp in tp_sizes]
        whole = whole_model_bytes(path, args.dtype)
        formats = args.weight_formats and [
            {"tp": tp, **{f: format_bytes(path, tp, args.dtype, f)
                          for f in args.weight_formats.split(",")}} for tp in tp_sizes]
        pages = args.kv_cache_dtypes and [
            kv_pages(path, tp, args.dtype, args.kv_cache_dtypes.split(","), args.kv_budget_mib)
            for tp in tp_sizes]
    print_table(rows, whole, args.dtype)
    if formats:
        print_ratios("parameter bytes per device", formats)
    if pages:
        print_pages(pages, args.kv_budget_mib)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "formats": formats,
                                               "kv_pages": pages}, indent=2))


def generate_model(out: Path, num_kv_heads: int) -> str:
    from sgl_jax.testing import write_tiny_checkpoint

    print(f"Writing a random Llama checkpoint to {out} ...", flush=True)
    write_tiny_checkpoint(out, "llama", backend="numpy", hidden_size=512, intermediate_size=2048,
                          num_hidden_layers=8, vocab_size=32000, num_attention_heads=8,
                          num_key_value_heads=num_kv_heads)
    return str(out)


def measure(path: str, tp_size: int, prompt_len: int, dtype: str) -> dict:
    import jax
    import numpy as np

    from sgl_jax.mem_cache.kv_cache import kv_bytes_per_token
    from sgl_jax.model_executor.forward_batch import SeqChunk
    from sgl_jax.model_executor.model_runner import ModelRunner
    from sgl_jax.models.loader import load_model
    from sgl_jax.parallel import TensorParallel, bytes_per_device

    tp = TensorParallel.of_size(tp_size)
    model = load_model(path, dtype=dtype, tp=tp, progress=False)
    leaves = jax.tree.leaves(model.params)
    runner = ModelRunner(model, num_pages=1 + -(-prompt_len // 16), page_size=16)
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, prompt_len).tolist()
    logits, _ = runner.forward([SeqChunk(ids, 0, list(range(1, 1 + -(-prompt_len // 16))))])
    return {
        "tp": tp_size,
        "device": str(jax.devices()[0].device_kind),
        "param_bytes_per_device": bytes_per_device(leaves),
        "kv_bytes_per_token_per_device": kv_bytes_per_token(model.config, model.dtype, tp),
        "kv_heads_per_device": tp.kv_heads(model.config.num_kv_heads) // tp_size,
        "logits": logits[0].tolist(),
    }


def whole_model_bytes(path: str, dtype: str) -> int:
    """The unsplit parameters: what one device holds at TP 1."""
    import jax

    from sgl_jax.models.loader import load_model

    return sum(x.nbytes for x in jax.tree.leaves(load_model(path, dtype=dtype,
                                                            progress=False).params))


def format_bytes(path: str, tp_size: int, dtype: str, weight_format: str) -> int:
    """Per-device parameter bytes with the weights in `weight_format` (the dtype's own name,
    or a --quantization value)."""
    import jax

    from sgl_jax.models.loader import load_model
    from sgl_jax.parallel import TensorParallel, bytes_per_device

    quantization = None if weight_format == dtype else weight_format
    model = load_model(path, dtype=dtype, tp=TensorParallel.of_size(tp_size), progress=False,
                       quantization=quantization)
    return bytes_per_device(jax.tree.leaves(model.params))


def kv_pages(path: str, tp_size: int, dtype: str, kv_dtypes: list[str], budget_mib: float
             ) -> dict:
    """Per KV dtype: the bytes one token's pages take on a device (measured on allocated
    pages) and the pages of 16 tokens a per-device budget of `budget_mib` holds."""
    import jax

    from sgl_jax.mem_cache.kv_cache import (
        allocate_kv_cache,
        device_memory_bytes,
        kv_cache_dtype,
        kv_pool_pages,
    )
    from sgl_jax.models.loader import load_model
    from sgl_jax.parallel import TensorParallel, bytes_per_device

    tp = TensorParallel.of_size(tp_size)
    config = load_model(path, dtype=dtype, tp=tp, progress=False).config
    memory = device_memory_bytes(jax.local_devices()[0])
    row = {"tp": tp_size}
    for name in kv_dtypes:
        pages = allocate_kv_cache(config, num_pages=8, page_size=16, tp=tp, dtype=dtype,
                                  kv_dtype=kv_cache_dtype(name, dtype))
        per_token = bytes_per_device(jax.tree.leaves(pages)) // (8 * 16)
        count = kv_pool_pages(page_size=16, bytes_per_token=per_token, max_total_tokens=None,
                              mem_fraction_static=budget_mib * 2**20 / memory, param_bytes=0,
                              max_useful_tokens=2**40) - 1  # the engine's sizing, less null
        row[name] = {"bytes_per_token": per_token, "pages": count}
    return row


def print_ratios(what: str, rows: list[dict]) -> None:
    names = [k for k in rows[0] if k != "tp"]
    print(f"\n{what}, MiB (x {names[0]})")
    print(f"{'tp':>3}  " + "  ".join(f"{n:>16}" for n in names))
    for row in rows:
        first = row[names[0]]
        print(f"{row['tp']:>3}  " + "  ".join(
            f"{row[n] / 2**20:>8.2f} ({row[n] / first:.3f})" for n in names))


def print_pages(rows: list[dict], budget_mib: float) -> None:
    names = [k for k in rows[0] if k != "tp"]
    print(f"\nKV cache per device: bytes per token, pages of 16 tokens in {budget_mib:g} MiB")
    print(f"{'tp':>3}  " + "  ".join(f"{n:>22}" for n in names))
    for row in rows:
        print(f"{row['tp']:>3}  " + "  ".join(
            f"{row[n]['bytes_per_token']:>8} B {row[n]['pages']:>7} pages" for n in names))


def print_table(rows: list[dict], whole: int, dtype: str) -> None:
    """Logit drift is measured against the first TP size listed."""
    import numpy as np

    base_logits = rows[0]["logits"]
    print(f"\nbench_tp_memory on {rows[0]['device']} devices, {dtype}; whole model "
          f"{whole / 2**20:.1f} MiB")
    print(f"{'tp':>3}  {'params MiB/device':>17}  {'x whole':>8}  {'1/tp':>6}  "
          f"{'KV heads/device':>15}  {'KV KiB/token/device':>19}  {'max |logit - first|':>17}")
    for row in rows:
        drift = float(np.max(np.abs(np.subtract(row.pop("logits"), base_logits))))
        print(f"{row['tp']:>3}  {row['param_bytes_per_device'] / 2**20:>17.2f}  "
              f"{row['param_bytes_per_device'] / whole:>8.3f}  {1 / row['tp']:>6.3f}  "
              f"{row['kv_heads_per_device']:>15}  "
              f"{row['kv_bytes_per_token_per_device'] / 2**10:>19.2f}  {drift:>17.2e}")


if __name__ == "__main__":
    main()
