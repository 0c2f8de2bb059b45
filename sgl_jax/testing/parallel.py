"""The same greedy requests through Engines of several --tp-size values, for the tests and the
benchmark of tensor parallelism.

The device count is fixed when JAX starts, so callers run this module in a subprocess with
the devices they need (`run_subprocess`), e.g. 8 CPU devices for TP 1, 2, 4 and 8:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m sgl_jax.testing.parallel \\
        --model-path M [--draft-model-path D] --tp-sizes 1,2,4,8 --out result.json

With a draft (or --draft-algorithm NGRAM, which needs none), the same runs follow with
speculative decoding. With --nnodes > 1 each process is one rank of a multi-host group;
rank 0 writes the result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

PROMPT_LENGTHS = (3, 50, 12)  # 50 takes two prefill chunks of 48
MAX_NEW_TOKENS = 8
ENGINE_SETTINGS = dict(
    dtype="float32", precompile_token_paddings=[64], precompile_bs_paddings=[4],
    max_prefill_tokens=64, chunked_prefill_size=48, skip_server_warmup=True,
    max_total_tokens=1024,
)
# A small tree (2 steps of top-2, 4 nodes verified) compiles sooner than the seed shapes.
TREE = dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
# DFLASH reads a chain from one block: the tiny heads' whole block of 8 (7 drafts).
SHAPES = {"DFLASH": dict(speculative_num_steps=7, speculative_eagle_topk=1)}


# Eight heads of 16 split up to 8 ways (small, and the kernels' fast path). Vocabularies
# of 514 and 518 do not divide by 4 or 8, so those tables are padded; the llama draft maps a
# 100-token draft vocabulary (d2t), which pads too.
TP_PRESETS = {
    "llama": dict(vocab_size=512, draft=dict(draft_vocab_size=100)),  # 2 KV heads
    "qwen2": dict(vocab_size=514, draft={}),  # 1 KV head
    "qwen3": dict(vocab_size=518, draft={}),  # 2 KV heads, head_dim 32, tied embeddings
}


def write_tp_checkpoints(root: Path, preset: str) -> tuple[Path, Path]:
    """A tiny `preset` target that splits 8 ways, and an EAGLE3 draft for it."""
    from sgl_jax.testing.checkpoints import write_tiny_checkpoint
    from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft

    spec = TP_PRESETS[preset]
    target = write_tiny_checkpoint(root / preset, preset, hidden_size=128,
                                   num_attention_heads=8, vocab_size=spec["vocab_size"])
    config = json.loads((target / "config.json").read_text())
    draft = write_tiny_eagle3_draft(root / f"{preset}-eagle3", config, num_heads=8,
                                    num_kv_heads=2, **spec["draft"])
    return target, draft


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def transformers_greedy(model_dir: Path) -> list[list[int]]:
    """The oracle: transformers' greedy continuation of each of `prompts`, on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    for ids in prompts(model.config.vocab_size):
        generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS,
                                   min_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        outputs.append(generated[0, len(ids):].tolist())
    return outputs


def run_tp_sizes(model_path: str, tp_sizes: list[int], *, draft_model_path: str | None = None,
                 draft_algorithm: str = "EAGLE3", given_prompts: list[list[int]] | None = None,
                 **settings: Any) -> dict[int, dict[str, Any]]:
    """Per TP size: the greedy output ids, the mean accepted length (with a draft, which
    grows a tree, or DFLASH's chain) and the parameter bytes on one device, for
    `given_prompts` (default: `prompts`). `settings`: more Engine arguments."""
    from sgl_jax import Engine
    from sgl_jax.parallel import bytes_per_device

    if draft_model_path is not None or draft_algorithm == "NGRAM":
        draft = {} if draft_model_path is None else {
            "speculative_draft_model_path": draft_model_path}
        settings = {**SHAPES.get(draft_algorithm, TREE), "speculative_algorithm": draft_algorithm,
                    **draft, **settings}
    # NGRAM drafts from text it has read: the prompts run twice, and the second pass, which
    # drafts from the first one's answers, is reported.
    passes = 2 if settings.get("speculative_algorithm") == "NGRAM" else 1
    results = {}
    for tp in tp_sizes:
        engine = Engine(model_path=model_path, tp_size=tp, **ENGINE_SETTINGS, **settings)
        if engine.server_args.node_rank > 0:  # it has followed rank 0 to the end
            continue
        with engine:
            params = {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
            asked = given_prompts or prompts(engine.model.config.vocab_size)
            for _ in range(passes):
                outputs = engine.generate(input_ids=asked, sampling_params=[params] * len(asked))
            info = engine.get_server_info()
            results[tp] = {
                "output_ids": [o["output_ids"] for o in outputs],
                "finish_reasons": [o["meta_info"]["finish_reason"]["type"] for o in outputs],
                "accept_length": info.get("avg_spec_accept_length"),
                "param_bytes_per_device": bytes_per_device(jax.tree.leaves(engine.model.params)),
                "param_bytes": sum(x.nbytes for x in jax.tree.leaves(engine.model.params)),
                "kv_heads": engine.model.tp.kv_heads(engine.model.config.num_kv_heads),
                "devices": len(engine.model.tp.mesh.devices.flat),
            }
    return results


def run_subprocess(args: list[str], *, devices: int, timeout: float = 1200
                   ) -> dict[str, dict[int, Any]]:
    """Run this module with `args` in a fresh process that sees `devices` CPU devices; returns
    {"plain": {tp: result}} and, with a draft, "speculative" beside it."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"sgl-jax-tp-{os.getpid()}-{id(args)}.json"
    completed = subprocess.run(
        [sys.executable, "-m", "sgl_jax.testing.parallel", *args, "--out", str(out)],
        env=cpu_devices_env(devices), capture_output=True, text=True, timeout=timeout)
    if completed.returncode != 0:
        raise RuntimeError(f"TP worker failed ({completed.returncode}):\n"
                           f"{completed.stderr[-6000:]}")
    try:
        return {mode: {int(tp): result for tp, result in by_tp.items()}
                for mode, by_tp in json.loads(out.read_text()).items()}
    finally:
        out.unlink(missing_ok=True)


# LLVM's optimizations off: each test process compiles many small programs, which then
# start 20-45% sooner (measured on test_ngram and the TP sizes); the arithmetic, and so
# every output, is the same.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true")


def with_xla_flags(current: str, *flags: str) -> str:
    """`current` XLA_FLAGS with `flags` appended (those already there once)."""
    words = current.split()
    return " ".join(words + [f for f in flags if f not in words])


def cpu_devices_env(devices: int) -> dict[str, str]:
    """The environment of a CPU process with `devices` host devices, compiling fast."""
    flags = with_xla_flags(os.environ.get("XLA_FLAGS", ""),
                           f"--xla_force_host_platform_device_count={devices}",
                           *FAST_COMPILE_FLAGS)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--draft-model-path", default=None)
    parser.add_argument("--draft-algorithm", default="EAGLE3",
                        help="NGRAM runs speculative decoding without a draft path")
    parser.add_argument("--attention-backend", default="native")
    parser.add_argument("--tp-sizes", default="1,2,4,8")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-init-addr", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--speculative-only", action="store_true",
                        help="with a draft, skip the runs without it")
    parser.add_argument("--prompts", type=json.loads, default=None,
                        help="a JSON list of token id lists (default: random prompts)")
    parser.add_argument("--engine-settings", type=json.loads, default={},
                        help='more Engine arguments as JSON, e.g. {"quantization": "int8"}')
    args = parser.parse_args(argv)
    common = dict(attention_backend=args.attention_backend, nnodes=args.nnodes,
                  node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
                  given_prompts=args.prompts, **args.engine_settings)
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    results = {}
    speculative = args.draft_model_path is not None or args.draft_algorithm == "NGRAM"
    if not (speculative and args.speculative_only):
        results["plain"] = run_tp_sizes(args.model_path, tp_sizes, **common)
    if speculative:
        results["speculative"] = run_tp_sizes(
            args.model_path, tp_sizes, draft_model_path=args.draft_model_path,
            draft_algorithm=args.draft_algorithm, **common)
    if args.node_rank == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
