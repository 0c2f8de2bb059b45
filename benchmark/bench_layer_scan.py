"""Scanning over layers against the unrolled stack the models run today: what each costs to
trace, lower, compile and load, and what each decodes at.

The unrolled program is `sgl_jax.models.llama.forward` as the engine runs it: one copy of the
layer per layer. The scanned one runs the same `decoder_layer` under `jax.lax.scan` over
parameters stacked along a leading layer axis. Both keep the engine's KV cache, one pair of
page arrays holding every layer's pages (layer i owns pages i*P .. (i+1)*P - 1), so each
layer's attention writes and reads the shared arrays at its own page offset (the scan's
cache a loop carry updated in place). Both compute the same logits; the script checks that
they agree.

For the model (default: the built-in demo model, SmolLM2-135M's 30 layers), on this host:
  - trace + lower seconds of a decode step and of a prefill step, for the host and, with
    the `fa` Pallas kernels, for TPU and CUDA (best of two, so JAX's own first-use costs do
    not count against whichever runs first);
  - XLA compile seconds, the serialized executable's size, and the seconds to load it back
    (what a warm start pays per program from the executable store);
  - step milliseconds (median): the prefill of `--prefill-len` tokens, and decode at each
    batch size with `--context` tokens per row.
With `--8b-layers`, also the trace + lower seconds for TPU and CUDA of Llama-3.1-8B's layer
structure (32 layers, 32/8 heads, head_dim 128) at small widths.

    python benchmark/bench_layer_scan.py
    python benchmark/bench_layer_scan.py --batch-sizes 1,8,32 --steps 30 --8b-layers \
        --json /tmp/scan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:
    import sgl_jax  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.layers.attention import LayerKV, ModelCache, get_attention_backend
from sgl_jax.layers.quantization import embedding_rows
from sgl_jax.layers.rotary import inverse_frequencies, rope_cos_sin
from sgl_jax.model_executor.forward_batch import Buckets, SeqChunk, build_forward_batch
from sgl_jax.models import llama
from sgl_jax.models.config import ModelConfig
from sgl_jax.testing.lowering import PLATFORMS, kernels_for

PAGE_SIZE = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in demo model")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context", type=int, default=256, help="tokens per decode row")
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per size")
    parser.add_argument("--dtype", default=None,
                        help="default: float32 on a CPU, bfloat16 elsewhere")
    parser.add_argument("--8b-layers", dest="llama8b", action="store_true")
    parser.add_argument("--json", default=None, help="write the figures here")
    return parser.parse_args(argv)


# -- the two programs -------------------------------------------------------------------------

def unrolled_forward(params, kv, input_ids, positions, metadata, *, config, attention):
    """params: the engine's pytree (a list of layers); kv: the engine's ModelCache."""
    hidden, kv, _ = llama.forward(params, kv, input_ids, positions, metadata, config=config,
                                  attention=attention)
    return hidden, kv


def scanned_forward(params, kv, input_ids, positions, metadata, *, config, attention):
    """params["layers"]: each leaf stacked to [L, ...]; kv: (k, v), each
    [L * P, n_kv, page_size, hd], layer i's pages at rows i*P ..."""
    pages_per_layer = kv[0].shape[0] // config.num_layers
    cos, sin = rope_cos_sin(positions, inverse_frequencies(config.rope, config.rotary_dim))

    def one_layer(carry, layer):
        hidden, kv, index = carry
        first_page = index * pages_per_layer
        own_pages = dataclasses.replace(
            metadata, page_table=metadata.page_table + first_page,
            slot_mapping=metadata.slot_mapping + first_page * PAGE_SIZE)

        def attend(p, x, layer_kv):
            return llama.self_attention(p, x, cos, sin, layer_kv, own_pages, config, attention)
        hidden, layer_kv = llama.decoder_layer(layer, hidden, attend, LayerKV(*kv), config)
        return (hidden, (layer_kv.k, layer_kv.v), index + 1), None

    hidden = embedding_rows(params["embed"], input_ids)
    (hidden, kv, _), _ = jax.lax.scan(one_layer, (hidden, kv, jnp.int32(0)), params["layers"])
    return llama.norm(hidden, params["norm"], config), kv


def step(params, kv, batch, *, forward, config, attention):
    """One step: the cache after it and the logits f32[N, V] of the batch's last tokens."""
    hidden, kv = forward(params, kv, batch.input_ids, batch.positions, batch.attention,
                         config=config, attention=attention)
    return kv, llama.compute_logits(params, hidden[batch.logits_indices], config)


def stacked(params: dict) -> dict:
    return {**params, "layers": jax.tree.map(lambda *leaves: jnp.stack(leaves),
                                             *params["layers"])}


def kv_caches(config: ModelConfig, num_pages: int, dtype) -> dict[str, object]:
    """Zeroed caches of `num_pages` pages per layer in each layout."""
    shape = (num_pages, config.num_kv_heads, PAGE_SIZE, config.head_dim)
    flat = (config.num_layers * num_pages, *shape[1:])
    return {"unrolled": ModelCache(jnp.zeros(flat, dtype), jnp.zeros(flat, dtype),
                                   (None,) * config.num_layers, num_pages),
            "scanned": (jnp.zeros(flat, dtype), jnp.zeros(flat, dtype))}


def batch_of(batch_size: int, new_tokens: int, context: int):
    """Rows of `context` tokens, the last `new_tokens` of each new in this step."""
    pages_per_row = -(-context // PAGE_SIZE)
    chunks = [SeqChunk([1] * new_tokens, context - new_tokens,
                       list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row)))
              for i in range(batch_size)]
    buckets = Buckets.automatic(max_tokens=max(64, batch_size * new_tokens),
                                max_seqs=batch_size, context_len=context, page_size=PAGE_SIZE)
    batch = build_forward_batch(chunks, page_size=PAGE_SIZE, shape=buckets.shape_for(chunks))
    return jax.tree.map(jnp.asarray, batch), 1 + batch_size * pages_per_row


# -- measurements ------------------------------------------------------------------------------

def trace_lower_s(make_step, args, platform: str | None) -> float:
    """Best of two fresh traces and lowerings (None: for this host)."""
    times = []
    for _ in range(2):
        jax.clear_caches()
        started = time.perf_counter()
        if platform is None:
            jax.jit(make_step()).lower(*args)
        else:
            with kernels_for(platform):
                jax.jit(make_step()).trace(*args).lower(lowering_platforms=(platform,))
        times.append(time.perf_counter() - started)
    return min(times)


def compile_and_load(make_step, args) -> tuple[dict[str, float], object]:
    """XLA compile seconds, serialized bytes and load seconds; returns the loaded program."""
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    lowered = jax.jit(make_step(), donate_argnums=(1,)).lower(*args)
    started = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - started
    payload, in_tree, out_tree = serialize(compiled)
    started = time.perf_counter()
    loaded = deserialize_and_load(payload, in_tree, out_tree)
    load_s = time.perf_counter() - started
    return {"compile_s": round(compile_s, 2), "executable_mb": round(len(payload) / 2**20, 2),
            "load_s": round(load_s, 2)}, loaded


def step_ms(program, params, kv, batch, steps: int) -> tuple[float, object, jax.Array]:
    """Median milliseconds of a step (after one untimed run); the cache and the logits."""
    kv, logits = program(params, kv, batch)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        kv, logits = program(params, kv, batch)
        logits.block_until_ready()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, kv, logits


def compare_on_host(config, params, args) -> dict:
    attention = get_attention_backend(None)  # the engine's: jnp on a CPU, Pallas elsewhere
    variants = {"unrolled": (unrolled_forward, params), "scanned": (scanned_forward,
                                                                    stacked(params))}
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    figures: dict = {name: {} for name in variants}
    logits_of: dict = {}
    for label, batch_size, new_tokens in [("prefill", 1, args.prefill_len),
                                          *[(f"decode bs{b}", b, 1) for b in sizes]]:
        batch, num_pages = batch_of(batch_size, new_tokens, max(args.context, new_tokens))
        caches = kv_caches(config, num_pages, params["embed"].dtype)
        for name, (forward, variant_params) in variants.items():
            def make_step(forward=forward):
                return functools.partial(step, forward=forward, config=config,
                                         attention=attention)
            call = (variant_params, caches[name], batch)
            row = {"trace_lower_s": round(trace_lower_s(make_step, call, None), 2)}
            loaded_figures, program = compile_and_load(make_step, call)
            row.update(loaded_figures)
            ms, caches[name], logits = step_ms(program, variant_params, caches[name], batch,
                                                 args.steps)
            row["step_ms"] = round(ms, 2)
            logits_of[name] = np.asarray(logits)
            figures[name][label] = row
            print(f"{name:9s} {label:10s} {row}", flush=True)
        gap = float(np.abs(logits_of["unrolled"] - logits_of["scanned"]).max())
        print(f"          {label}: largest logit difference {gap:.2e}", flush=True)
        if params["embed"].dtype == jnp.float32:  # 16-bit sums may round apart
            assert gap < 1e-3, f"the scanned program disagrees with the unrolled one ({gap})"
    return figures


def lower_for_accelerators(config, params, label: str) -> dict:
    """Trace + lower seconds for TPU and CUDA (the `fa` kernels), decode bs 8 and prefill."""
    attention = get_attention_backend("fa")
    figures: dict = {}
    for name, forward, variant_params in [("unrolled", unrolled_forward, params),
                                          ("scanned", scanned_forward, stacked(params))]:
        for shape, batch_size, new_tokens in [("decode bs8", 8, 1), ("prefill", 1, 256)]:
            batch, num_pages = batch_of(batch_size, new_tokens, 256)
            call = (variant_params, kv_caches(config, num_pages, params["embed"].dtype)[name],
                    batch)
            for platform in PLATFORMS:
                seconds = trace_lower_s(lambda forward=forward: functools.partial(
                    step, forward=forward, config=config, attention=attention), call, platform)
                figures[f"{name} {shape} {platform}"] = round(seconds, 2)
    print(label, figures, flush=True)
    return figures


def main(argv: list[str] | None = None) -> dict:
    from sgl_jax.model_executor.programs import outside_jax_cache

    args = parse_args(argv)
    # Every compile measured afresh, and serializable: turning JAX's cache off after a
    # process used it leaves it on, and a program it loads serializes without machine code.
    with outside_jax_cache():
        results = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def measure(args: argparse.Namespace) -> dict:
    from sgl_jax.demo import demo_model_path
    from sgl_jax.models.loader import load_model

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    loaded = load_model(args.model_path or str(demo_model_path()), dtype=dtype, progress=False)
    print(f"{loaded.config.num_layers} layers, hidden {loaded.config.hidden_size}", flush=True)
    results = {"host": compare_on_host(loaded.config, loaded.params, args),
               "accelerators": lower_for_accelerators(loaded.config, loaded.params, "model")}
    if args.llama8b:
        results["llama8b_layers"] = lower_8b_layers()
    return results


def lower_8b_layers() -> dict:
    from sgl_jax.models.loader import load_model
    from sgl_jax.testing import write_tiny_checkpoint
    from sgl_jax.testing.benchmarks import load_benchmark

    layers = load_benchmark("bench_startup").LLAMA_8B_LAYERS

    with tempfile.TemporaryDirectory() as workdir:
        path = write_tiny_checkpoint(f"{workdir}/llama8b", "llama", **layers)
        loaded = load_model(str(path), dtype="float32", progress=False)
    return lower_for_accelerators(loaded.config, loaded.params, "Llama-3.1-8B layers")


if __name__ == "__main__":
    main()
