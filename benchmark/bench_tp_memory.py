"""Per-device memory under tensor parallelism: for each TP size, the parameter bytes and the KV
bytes per token that one device holds, beside the 1/tp ideal, and how far the logits of one
prefill drift from TP 1's (they should agree to float rounding).

On a CPU the script asks XLA for as many host devices as the largest TP size (unless
XLA_FLAGS already sets a count). Default model: the ~66M-parameter float32 Llama of the other
benchmarks with 2 KV heads, so TP 4 and 8 hold copies of KV heads.

    python benchmark/bench_tp_memory.py [--model-path M] [--tp-sizes 1,2,4,8] [--json out.json]
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
    parser.add_argument("--json", default=None, help="also write the rows here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    if COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COUNT_FLAG}={max(tp_sizes)}"
    with tempfile.TemporaryDirectory(prefix="bench_tp_memory_") as scratch:
        path = args.model_path or generate_model(Path(scratch), args.num_kv_heads)
        rows = [measure(path, tp, args.prompt_len) for tp in tp_sizes]
        whole = whole_model_bytes(path)
    print_table(rows, whole)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def generate_model(out: Path, num_kv_heads: int) -> str:
    from sgl_jax.testing import write_tiny_checkpoint

    print(f"Writing a random Llama checkpoint to {out} ...", flush=True)
    write_tiny_checkpoint(out, "llama", backend="numpy", hidden_size=512, intermediate_size=2048,
                          num_hidden_layers=8, vocab_size=32000, num_attention_heads=8,
                          num_key_value_heads=num_kv_heads)
    return str(out)


def measure(path: str, tp_size: int, prompt_len: int) -> dict:
    import jax
    import numpy as np

    from sgl_jax.mem_cache.kv_cache import kv_bytes_per_token
    from sgl_jax.model_executor.forward_batch import SeqChunk
    from sgl_jax.model_executor.model_runner import ModelRunner
    from sgl_jax.models.loader import load_model
    from sgl_jax.parallel import TensorParallel, bytes_per_device

    tp = TensorParallel.of_size(tp_size)
    model = load_model(path, dtype="float32", tp=tp, progress=False)
    leaves = jax.tree.leaves(model.params)
    runner = ModelRunner(model, num_pages=1 + -(-prompt_len // 16), page_size=16)
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, prompt_len).tolist()
    logits, _ = runner.forward([SeqChunk(ids, 0, list(range(1, 1 + -(-prompt_len // 16))))])
    return {
        "tp": tp_size,
        "device": str(jax.devices()[0].device_kind),
        "param_bytes_per_device": bytes_per_device(leaves),
        "kv_bytes_per_token_per_device": kv_bytes_per_token(model.config, model.dtype, tp),
        "kv_heads_per_device": tp.kv_heads(model.config) // tp_size,
        "logits": logits[0].tolist(),
    }


def whole_model_bytes(path: str) -> int:
    """The unsplit float32 parameters: what one device holds at TP 1."""
    import jax

    from sgl_jax.models.loader import load_model

    return sum(x.nbytes for x in jax.tree.leaves(load_model(path, dtype="float32",
                                                            progress=False).params))


def print_table(rows: list[dict], whole: int) -> None:
    """Logit drift is measured against the first TP size listed."""
    import numpy as np

    base_logits = rows[0]["logits"]
    print(f"\nbench_tp_memory on {rows[0]['device']} devices, float32; whole model "
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
