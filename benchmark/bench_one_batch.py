"""Prefill and decode latency of one static batch through the real ModelRunner.

Like SGLang's bench_one_batch: for each batch size B, B random prompts of --input-len tokens
are prefilled (in as few extend batches as ModelRunner allows: it caps the sequences per extend
batch), then --output-len decode steps feed each sequence its greedy (argmax) token. Every
timed call has been run before with the same shapes, so compilation is excluded, and
ModelRunner.forward returns numpy logits, so each timing ends with the result on the host.

Decode is compared with a memory-bandwidth roofline measured in the same run (the time to
stream the weights once) and with Hugging Face transformers' greedy `generate` on the same
checkpoint and prompts. transformers runs afterwards in a process of its own with torch's
defaults (benchmark/transformers_peer.py), while this process waits.

    python benchmark/bench_one_batch.py                      # the demo model, float32
    python benchmark/bench_one_batch.py --batch-sizes 1,8 --json /tmp/bench.json
    python benchmark/bench_one_batch.py --model-path random  # a random ~66M Llama
    python benchmark/bench_one_batch.py --model-path Qwen/Qwen3-0.6B --no-compare-transformers
    python benchmark/bench_one_batch.py --batch-sizes 1 --profile   # batch-1 step breakdown
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

try:
    import sgl_jax  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from transformers_peer import describe_peer, run_peer  # this folder, on sys.path[0]

from sgl_jax.demo import DEMO_MODEL_NAME, demo_model_path
from sgl_jax.mem_cache.kv_cache import kv_bytes_per_token, kv_cache_dtype
from sgl_jax.mem_cache.page_allocator import PageAllocator
from sgl_jax.model_executor.forward_batch import (
    Buckets,
    SeqChunk,
    aligned,
    bucket,
    build_forward_batch,
)
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models.llama import matmul_rows
from sgl_jax.models.loader import LoadedModel, load_model
from sgl_jax.server_args import QUANTIZATION_CHOICES

GB = 1e9
TARGET_ROOFLINE_RATIO = 1.4  # batch-1 decode step <= 1.4x the time to stream the weights


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None,
                        help="a checkpoint directory, hub id or .gguf file; 'random': a random "
                             "Llama of the shape below (default: the demo model, "
                             f"{DEMO_MODEL_NAME})")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where to write the random checkpoint (default: a temp dir); "
                             "reused if it already holds one")
    parser.add_argument("--hidden-size", type=int, default=512, help="random Llama only")
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32, help="decode steps timed")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pool size in pages (default: just enough for the largest "
                             "batch, plus the null page)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--attention-backend", default="native")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                        help="8-bit weights (the server's --quantization)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the KV pages' dtype (the server's --kv-cache-dtype)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed decode steps after the compiling one, per batch size")
    parser.add_argument("--repeats", type=int, default=3,
                        help="prefill+decode runs per batch size: prefill takes their median, "
                             "decode the median over all their steps")
    parser.add_argument("--bandwidth-gib", type=float, default=1.0,
                        help="size of the array the bandwidth probes stream")
    parser.add_argument("--compare-transformers", action=argparse.BooleanOptionalAction,
                        default=True, help="time transformers' greedy generate on the same model")
    parser.add_argument("--transformers-batch-sizes", type=int_list, default=[1, 8],
                        help="batch sizes for the transformers comparison")
    parser.add_argument("--profile", action="store_true",
                        help="also break a batch-1 decode step down into its parts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure to this file")
    return parser.parse_args(argv)


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4, got {text!r}")
    return values


# --------------------------------------------------------------------------- setup


RANDOM_MODEL = "random"


def model_or_demo(model_path: str | None) -> str | None:
    """--model-path, the demo model's GGUF when it is not given, or None for 'random'."""
    if model_path is None:
        return str(demo_model_path())
    return None if model_path == RANDOM_MODEL else model_path


def prepare_checkpoint(args: argparse.Namespace, scratch: contextlib.ExitStack) -> str:
    """The checkpoint to benchmark: --model-path (the demo model by default), or for 'random'
    a random Llama written for this run (into --checkpoint-dir, or a temporary directory
    removed when `scratch` closes)."""
    if (path := model_or_demo(args.model_path)) is not None:
        return path
    overrides = dict(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, vocab_size=args.vocab_size,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=max(4096, args.input_len + args.output_len),
    )
    return random_llama(args.checkpoint_dir, scratch, overrides, args.dtype, "bench_one_batch_")


def random_llama(checkpoint_dir: str | None, scratch: contextlib.ExitStack, overrides: dict,
                 dtype: str, prefix: str) -> str:
    """A random Llama with `overrides` in checkpoint_dir (reused when its config matches), or
    in a temporary directory removed when `scratch` closes."""
    from sgl_jax.testing import write_tiny_checkpoint

    if checkpoint_dir:
        out = Path(checkpoint_dir)
    else:
        out = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    if not _matches_existing(out, overrides, dtype):
        print(f"Writing a random Llama checkpoint to {out} ...", flush=True)
        write_tiny_checkpoint(out, "llama", dtype=dtype, backend="numpy", **overrides)
    return str(out)


def _matches_existing(out: Path, overrides: dict, dtype: str) -> bool:
    config_path = out / "config.json"
    if not config_path.is_file() or not list(out.glob("*.safetensors")):
        return False
    config = json.loads(config_path.read_text())
    saved_dtype = config.get("dtype", config.get("torch_dtype"))
    return saved_dtype == dtype and all(config.get(k) == v for k, v in overrides.items())


def parameter_bytes(model: LoadedModel) -> dict[str, int]:
    """All parameter bytes, and the bytes one decode step streams from memory.

    A decode step reads every matrix once, but only B rows of the embedding table. When the
    embedding is tied to the LM head the whole table is read for the logits anyway.
    """
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    embed = model.params["embed"].nbytes
    streamed = total if model.config.tie_word_embeddings else total - embed
    return {"all": int(total), "streamed": int(streamed), "embedding": int(embed),
            "num_params": int(sum(x.size for x in jax.tree.leaves(model.params)))}


# --------------------------------------------------------------------------- bandwidth


class BandwidthProbe:
    """Streaming read bandwidth (GB/s) of one float32 array (far larger than the caches).

    Three readers, each the best of `repeats` passes: numpy's sum, a jitted jnp.sum, and a
    jitted matrix-vector product (the decode access pattern, often the fastest on CPU). The
    bandwidth a shared VM delivers drifts over minutes, so the benchmark probes right before
    and after each batch size and compares each batch with its own neighbouring probes.
    """

    def __init__(self, gib: float, repeats: int = 5):
        n = int(gib * (1 << 30)) // 4 // 4096 * 4096
        self.bytes, self.repeats = n * 4, repeats
        self.host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
        self.matrix = jax.device_put(self.host.reshape(-1, 4096))
        self.vector = jnp.ones(4096, jnp.float32)
        self.jitted_sum, self.matvec = jax.jit(jnp.sum), jax.jit(jnp.matmul)

    def measure(self) -> dict[str, float]:
        readers = {
            "numpy_sum_GBps": lambda: self.host.sum(),
            "jax_sum_GBps": lambda: self.jitted_sum(self.matrix).block_until_ready(),
            "jax_matvec_GBps": lambda: self.matvec(self.matrix, self.vector).block_until_ready(),
        }
        figures = {k: self.bytes / _best_time(fn, self.repeats) / GB for k, fn in readers.items()}
        return {**figures, "best_GBps": max(figures.values())}


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # compile / fault pages in
    return min(_timed(fn)[0] for _ in range(repeats))


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# --------------------------------------------------------------------------- our engine


def pages_per_seq(args: argparse.Namespace) -> int:
    return -(-(args.input_len + args.output_len) // args.page_size)


def make_runner(model: LoadedModel, args: argparse.Namespace, max_batch: int,
                num_pages: int | None = None) -> tuple[ModelRunner, list]:
    """One runner (one KV pool, as in a server) for up to max_batch sequences, and their pages.

    The buckets are ModelRunner's defaults, widened only when the arguments need more.
    """
    needed = max_batch * pages_per_seq(args) + 1  # + the null page
    if num_pages is not None and num_pages < needed:
        raise SystemExit(f"--num-pages {num_pages} is too small: the batch needs {needed}")
    buckets = Buckets.automatic(
        max_tokens=max(4096, bucket(max_batch * args.input_len)), max_seqs=max(64, max_batch),
        context_len=max(model.config.max_position_embeddings, args.input_len + args.output_len),
        page_size=args.page_size,
    )
    allocator = PageAllocator(num_pages or needed)
    hybrid = model.config.is_hybrid  # sequence i holds recurrent-state slot i + 1
    runner = ModelRunner(model, num_pages=allocator.num_pages, page_size=args.page_size,
                         buckets=buckets, attention_backend=args.attention_backend,
                         num_state_slots=max_batch + 1 if hybrid else 0,
                         kv_dtype=kv_cache_dtype(args.kv_cache_dtype, model.dtype))
    page_ids = [allocator.allocate(pages_per_seq(args)) for _ in range(max_batch)]
    return runner, page_ids


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, length)).tolist()


def prefill(runner: ModelRunner, prompts: list[list[int]], page_ids: list) -> np.ndarray:
    """Prefill every prompt; an extend batch holds at most the largest token bucket, so larger
    batches are prefilled in consecutive groups (the time reported covers all of them)."""
    group = prefill_group(runner, len(prompts[0]))
    logits = []
    for start in range(0, len(prompts), group):
        chunks = [SeqChunk(p, 0, pages, state_slot=start + i + 1) for i, (p, pages) in
                  enumerate(zip(prompts[start:start + group], page_ids[start:start + group],
                                strict=True))]
        logits.append(runner.forward(chunks)[0])
    return np.concatenate(logits)


def prefill_group(runner: ModelRunner, prompt_len: int) -> int:
    """Prompts per extend batch: each takes its length rounded up to a query block."""
    return max(1, runner.buckets.max_tokens // aligned(prompt_len))


def run_once(runner: ModelRunner, prompts: list[list[int]], page_ids: list, steps: int):
    """Prefill then `steps` greedy decode steps; returns (prefill s, step s list, tokens)."""
    prefill_time, logits = _timed(lambda: prefill(runner, prompts, page_ids))
    tokens = [np.argmax(logits, axis=-1)]
    step_times = []
    for i in range(steps):
        prefix = len(prompts[0]) + i
        chunks = [SeqChunk([int(t)], prefix, pages, state_slot=row + 1)
                  for row, (t, pages) in enumerate(zip(tokens[-1], page_ids, strict=False))]
        step_time, (logits, _) = _timed(lambda c=chunks: runner.forward(c))
        step_times.append(step_time)
        tokens.append(np.argmax(logits, axis=-1))
    return prefill_time, step_times, np.stack(tokens, axis=1)  # tokens: [B, 1 + steps]


def bench_batch(runner: ModelRunner, page_ids: list, batch: int, args, vocab: int) -> dict:
    prompts = random_prompts(batch, args.input_len, vocab, args.seed + batch)
    pages = page_ids[:batch]
    # Warm-up with the same shapes: compiles the prefill and the decode step.
    run_once(runner, prompts, pages, steps=1 + args.warmup)
    compilations = runner.num_compilations
    prefill_times, step_times = [], []
    for _ in range(args.repeats):
        prefill_time, steps, tokens = run_once(runner, prompts, pages, args.output_len)
        prefill_times.append(prefill_time)
        step_times.extend(steps)
    prefill_s, decode_s = float(np.median(prefill_times)), float(np.median(step_times))
    return {
        "batch_size": batch,
        "prefill_ms": prefill_s * 1e3,
        "prefill_tok_s": batch * args.input_len / prefill_s,
        "prefill_forwards": -(-batch // prefill_group(runner, args.input_len)),
        "decode_ms": decode_s * 1e3,
        "decode_ms_p10": float(np.percentile(step_times, 10)) * 1e3,
        "decode_ms_p90": float(np.percentile(step_times, 90)) * 1e3,
        "decode_tok_s": batch / decode_s,
        "recompilations_while_timed": runner.num_compilations - compilations,
        "tokens": tokens.tolist(),
    }


def weight_products_only(model: LoadedModel) -> Callable[[jax.Array, int], jax.Array]:
    """A jitted chain of only the model's weight products (q|k|v, o, gate|up, down per layer,
    then the LM head over the first num_logits rows), with the model's own `matmul_rows` and
    nothing but slicing in between.

    No step of that many tokens can beat it however attention, norms, sampling or the runner
    change: it is the floor XLA's matrix products put under the step.
    """
    config, params = model.config, model.params
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]

    def chain(layers, head, hidden, num_logits):  # hidden [T, H] -> f32[num_logits, V']
        for layer in layers:
            qkv = matmul_rows(hidden, layer["w_qkv"]).reshape(hidden.shape[0], -1)
            hidden = hidden + matmul_rows(qkv[:, : config.q_size], layer["w_o"])
            gate_up = matmul_rows(hidden, layer["w_gate_up"])  # [T, I, 2]
            hidden = hidden + matmul_rows(gate_up[..., 0] * gate_up[..., 1], layer["w_down"])
        return matmul_rows(hidden[:num_logits], head, preferred_element_type=jnp.float32)

    jitted = jax.jit(chain, static_argnums=3)
    return lambda hidden, num_logits: jitted(params["layers"], head, hidden,
                                             num_logits).block_until_ready()


def is_dense(model: LoadedModel) -> bool:
    """Every layer is attention with a dense MLP (what weight_products_only chains)."""
    return all("w_qkv" in layer and "w_gate_up" in layer for layer in model.params["layers"])


def time_weight_products(model: LoadedModel, num_tokens: int, num_logits: int | None = None
                         ) -> float:
    """Median ms of weight_products_only over num_tokens rows (logits for num_logits of them,
    all by default): a decode step of B sequences is (B, B), a prefill of T tokens (T, B)."""
    run = weight_products_only(model)
    hidden = jnp.ones((num_tokens, model.config.hidden_size), model.dtype)
    calls = 20 if num_tokens <= 64 else 3  # large prefills take about a second each
    return _median_ms(lambda: run(hidden, num_logits or num_tokens), calls)


def add_roofline(result: dict, weight_bytes: dict, kv_per_token: int, bandwidth_gbps: float,
                 args) -> None:
    """Time to stream the weights (and, for reference, the KV read) vs the decode step."""
    result["bandwidth_GBps"] = bandwidth_gbps
    step_s = result["decode_ms"] / 1e3
    for key in ("streamed", "all"):
        stream_s = weight_bytes[key] / (bandwidth_gbps * GB)
        result[f"stream_{key}_ms"] = stream_s * 1e3
        result[f"roofline_{key}"] = stream_s / step_s  # 1.0 = at the bandwidth limit
    result["products_over_stream"] = result["products_ms"] / result["stream_streamed_ms"]
    mean_context = args.input_len + (args.output_len + 1) / 2
    result["kv_read_bytes_per_step"] = int(result["batch_size"] * mean_context * kv_per_token)


# --------------------------------------------------------------------------- transformers


def bench_transformers(path: str, prompts_by_batch: dict[int, list[list[int]]], args) -> dict:
    """transformers' per-step greedy decode time per batch size (method in the peer's
    `decode_steps`), measured in a child process with torch's defaults."""
    hf = run_peer({"task": "decode_steps", "model_path": path, "dtype": args.dtype,
                   "output_len": args.output_len, "repeats": args.repeats,
                   "prompts_by_batch": prompts_by_batch})
    hf["by_batch"] = {int(b): figures for b, figures in hf["by_batch"].items()}  # JSON keys
    return hf


# --------------------------------------------------------------------------- profile


def profile_decode_step(model: LoadedModel, runner: ModelRunner, page_ids: list, args,
                        calls: int = 20) -> dict[str, float]:
    """Median ms of the parts of one batch-1 decode step.

    Reaches into ModelRunner's jitted logits step (a private attribute) to time it alone.
    """
    chunks = [SeqChunk([1], args.input_len, page_ids[0])]
    host_batch = _build(runner, chunks)
    device_batch = jax.device_put(host_batch)
    ready = {}

    def jitted_step(batch):
        state = runner.state
        state.kv_cache, logits, _ = runner.logits_step(model.params, state.kv_cache, batch)
        ready["logits"] = logits
        return logits.block_until_ready()

    small_runner, small_pages = make_runner(model, args, max_batch=1)
    small_chunks = [SeqChunk([1], args.input_len, small_pages[0])]
    no_kv_forward = _forward_without_attention(model)
    logits_only = jax.jit(lambda p, h: model.impl.compute_logits(p, h, model.config))
    hidden = jnp.zeros((1, model.config.hidden_size), model.dtype)
    ids, positions = device_batch.input_ids, device_batch.positions
    pool = runner.state.kv_cache.pages_per_layer
    parts = {
        f"runner.forward, whole step ({pool}-page pool)": lambda: runner.forward(chunks),
        "  build_forward_batch (host)": lambda: _build(runner, chunks),
        "  jitted step, host batch, blocking": lambda: jitted_step(host_batch),
        "  jitted step, device batch, blocking": lambda: jitted_step(device_batch),
        "  np.asarray(logits) of a ready result": lambda: np.asarray(ready["logits"]),
        f"runner.forward, minimal pool ({pages_per_seq(args) + 1} pages)":
            lambda: small_runner.forward(small_chunks),
        "jitted forward without attention/KV work": lambda: no_kv_forward(
            model.params, ids, positions, device_batch.logits_indices).block_until_ready(),
        "jitted LM head only": lambda: logits_only(model.params, hidden).block_until_ready(),
    }
    compilations = runner.num_compilations
    out = {name: _median_ms(fn, calls) for name, fn in parts.items()}
    out["recompilations while profiling"] = runner.num_compilations - compilations
    return out


def _build(runner: ModelRunner, chunks: list[SeqChunk]):
    return build_forward_batch(chunks, page_size=runner.page_size,
                               shape=runner.buckets.shape_for(chunks))


def _forward_without_attention(model: LoadedModel):
    """The model's own forward with attention replaced by 'return q': weights only, no KV."""
    def skip_attention(q, k, v, layer_kv, metadata, *, scale):
        return q, layer_kv

    def forward(params, input_ids, positions, logits_indices):
        empty = jnp.zeros((0,), model.dtype)
        kv = [(empty, empty)] * model.config.num_layers
        hidden, _, _ = model.impl.forward(params, kv, input_ids, positions, None,
                                          config=model.config, attention=skip_attention)
        return model.impl.compute_logits(params, hidden[logits_indices], model.config)

    return jax.jit(forward)


def _median_ms(fn: Callable[[], object], calls: int) -> float:
    fn()
    fn()
    return float(np.median([_timed(fn)[0] for _ in range(calls)])) * 1e3


# --------------------------------------------------------------------------- report


def machine_info() -> dict:
    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "jax_version": jax.__version__, "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()], "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "memory_gib": _memory_gib(), "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError, AttributeError):
        return None


def print_table(results: list[dict]) -> None:
    header = (f"{'batch':>5} {'prefill ms':>11} {'prefill tok/s':>14} {'decode ms/step':>15} "
              f"{'(p10-p90)':>14} {'decode tok/s':>13} {'GB/s':>6} {'roofline':>9} "
              f"{'products ms':>12}")
    print(header)
    print("-" * len(header))
    for r in results:
        spread = f"{r['decode_ms_p10']:.1f}-{r['decode_ms_p90']:.1f}"
        print(f"{r['batch_size']:>5} {r['prefill_ms']:>11.1f} {r['prefill_tok_s']:>14.0f} "
              f"{r['decode_ms']:>15.2f} {spread:>14} {r['decode_tok_s']:>13.1f} "
              f"{r['bandwidth_GBps']:>6.1f} {r['roofline_streamed']:>9.2f} "
              f"{r['products_ms']:>12.2f}")
    print("GB/s = best read bandwidth of the probes around that batch; roofline = time to stream "
          "the decode-streamed weights once at it / decode step time (1.0 = bandwidth bound); "
          "products ms = the model's weight matrix products alone, chained (no attention, "
          "norms or RoPE): a floor under the decode step")


def summarize(results: list[dict], weights: dict, bandwidth: dict, hf: dict | None) -> dict:
    """Print the verdicts and return them."""
    summary = {}
    print(f"Read bandwidth over the run: {bandwidth['worst_GBps']:.1f} to "
          f"{bandwidth['best_GBps']:.1f} GB/s (best reader of each probe)")
    first = next((r for r in results if r["batch_size"] == 1), None)
    if first is not None:
        for key in ("streamed", "all"):
            ratio = first["decode_ms"] / first[f"stream_{key}_ms"]
            summary[f"batch1_step_over_stream_{key}"] = ratio
        ratio = summary["batch1_step_over_stream_streamed"]
        summary["batch1_target_met"] = ratio <= TARGET_ROOFLINE_RATIO
        print(f"Batch-1 decode: {first['decode_ms']:.2f} ms/step = {ratio:.2f}x the time to "
              f"stream the {weights['streamed'] / 1e6:.1f} MB of decode-streamed weights "
              f"({first['stream_streamed_ms']:.2f} ms at {first['bandwidth_GBps']:.1f} GB/s); "
              f"target <= {TARGET_ROOFLINE_RATIO}x: "
              f"{'MET' if summary['batch1_target_met'] else 'MISSED'}")
        print(f"  (against all {weights['all'] / 1e6:.1f} MB of parameters: "
              f"{summary['batch1_step_over_stream_all']:.2f}x, "
              f"{first['stream_all_ms']:.2f} ms to stream)")
        summary["batch1_products_over_stream"] = first["products_over_stream"]
        print(f"  floor: the weight products alone take {first['products_ms']:.2f} ms = "
              f"{first['products_over_stream']:.2f}x the stream time")
    if hf:
        print(f"transformers: {describe_peer(hf['environment'])}")
    for batch, figures in (hf or {}).get("by_batch", {}).items():
        ours = next((r for r in results if r["batch_size"] == batch), None)
        if ours is None:
            continue
        ratio = figures["decode_ms"] / ours["decode_ms"]
        agree = _token_agreement(ours["tokens"], figures["tokens"])
        summary[f"transformers_over_ours_batch{batch}"] = ratio
        summary[f"greedy_tokens_agree_batch{batch}"] = agree
        print(f"transformers decode at batch {batch}: {figures['decode_ms']:.2f} ms/step vs ours "
              f"{ours['decode_ms']:.2f} -> transformers/ours = {ratio:.2f} "
              f"({'ours faster' if ratio > 1 else 'ours SLOWER'}); greedy tokens agree: "
              f"{agree:.0%}")
    return summary


def _token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    n = min(len(ours[0]), len(theirs[0]))
    a, b = np.asarray(ours)[:, :n], np.asarray(theirs)[:, :n]
    return float((a == b).mean())


def _print_bandwidth(probe: dict) -> None:
    print(f"    read bandwidth: jitted jnp.sum {probe['jax_sum_GBps']:.1f} GB/s, jitted matvec "
          f"{probe['jax_matvec_GBps']:.1f} GB/s, numpy sum {probe['numpy_sum_GBps']:.1f} GB/s",
          flush=True)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.output_len < 2:
        raise SystemExit("--output-len must be at least 2")
    with contextlib.ExitStack() as scratch:
        return run(args, prepare_checkpoint(args, scratch))


def run(args: argparse.Namespace, path: str) -> dict:
    info = machine_info()
    print(f"Machine: {info['platform']}, {info['cpu_count']} CPUs, "
          f"{info['memory_gib'] or 0:.0f} GiB, JAX {info['jax_version']} on {info['devices']}")
    model = load_model(path, dtype=args.dtype, progress=False, quantization=args.quantization)
    weights = parameter_bytes(model)
    print(f"Model: {model.config.architecture}, {weights['num_params'] / 1e6:.1f}M parameters, "
          f"{args.dtype}: {weights['all'] / 1e6:.1f} MB in all, {weights['streamed'] / 1e6:.1f} "
          f"MB streamed per decode step (embedding table {weights['embedding'] / 1e6:.1f} MB"
          f"{', tied: read whole for the logits' if model.config.tie_word_embeddings else ''})")

    probe = BandwidthProbe(args.bandwidth_gib)
    probes = [probe.measure()]
    _print_bandwidth(probes[-1])
    runner, page_ids = make_runner(model, args, max(args.batch_sizes), args.num_pages)
    kv_bytes = kv_bytes_per_token(model.config, kv_cache_dtype(args.kv_cache_dtype, model.dtype),
                                  model.tp)
    results = []
    for batch in args.batch_sizes:
        r = bench_batch(runner, page_ids, batch, args, model.config.vocab_size)
        # The chain of products is written for dense decoders; others get none (nan).
        r["products_ms"] = (time_weight_products(model, batch) if is_dense(model)
                            else float("nan"))
        probes.append(probe.measure())
        # A busy neighbour can only slow a probe down, so the best adjacent one counts.
        add_roofline(r, weights, kv_bytes,
                     max(probes[-2]["best_GBps"], probes[-1]["best_GBps"]), args)
        results.append(r)
        print(f"  batch {batch:>3}: prefill {r['prefill_ms']:.1f} ms "
              f"({r['prefill_forwards']} extend batch(es)), decode {r['decode_ms']:.2f} ms/step, "
              f"{r['recompilations_while_timed']} recompilations while timed; the weight "
              f"products alone {r['products_ms']:.2f} ms", flush=True)
        _print_bandwidth(probes[-1])
    profile = profile_decode_step(model, runner, page_ids, args) if args.profile else None
    del runner, probe  # frees the KV pool and the probe's arrays before transformers
    best = [p["best_GBps"] for p in probes]
    bandwidth = {"best_GBps": max(best), "worst_GBps": min(best), "probes": probes}

    hf = None
    if args.compare_transformers:
        batches = [b for b in args.transformers_batch_sizes if b in args.batch_sizes]
        prompts = {b: random_prompts(b, args.input_len, model.config.vocab_size, args.seed + b)
                   for b in batches}
        hf = bench_transformers(path, prompts, args)

    print()
    print(f"bench_one_batch: input_len={args.input_len}, output_len={args.output_len}, "
          f"page_size={args.page_size}, dtype={args.dtype}")
    print_table(results)
    if profile:
        print("\nBatch-1 decode step breakdown (median ms):")
        for name, value in profile.items():
            print(f"  {name:<48} {value:8.2f}")
    print()
    summary = summarize(results, weights, bandwidth, hf)
    report = {"machine": info, "args": vars(args), "checkpoint": path,
              "parameter_bytes": weights, "bandwidth": bandwidth, "results": results,
              "profile": profile, "transformers": hf, "summary": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"Wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
