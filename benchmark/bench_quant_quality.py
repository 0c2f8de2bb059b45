"""What 8-bit weights and an FP8 KV cache cost in quality: the mean next-token KL divergence
from the unquantized model (float32 weights and pages) over held-out ShareGPT text, per
variant, and the greedy answers of every variant to MT-Bench questions side by side.

The text: the first exchange (question and answer) of each ShareGPT conversation past the
first 12000 (drafts are trained on the file's start), tokenized without a chat template and
cut into sequences of `--seq-len` tokens until `--num-tokens` tokens are read; each sequence
is one prefill whose logits at every position are compared with the reference's. The KV
variants matter here because every layer's attention reads its keys and values back from
the pages it just wrote.

    python benchmark/bench_quant_quality.py                      # the demo model
    python benchmark/bench_quant_quality.py --model trained-tiny-qwen3-moe --answers 0
    python benchmark/bench_quant_quality.py --model tiny-qwen3-moe --answers 0   # random
    python benchmark/bench_quant_quality.py --num-tokens 2000 --answers 2   # quick look
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# name -> (--quantization, --kv-cache-dtype); the first is the reference.
VARIANTS = {
    "float32": (None, "auto"),
    "int8": ("int8", "auto"),
    "w8a8_int8": ("w8a8_int8", "auto"),
    "fp8": ("fp8", "auto"),
    "kv fp8_e4m3": (None, "fp8_e4m3"),
    "kv fp8_e5m2": (None, "fp8_e5m2"),
}


@dataclass(frozen=True)
class Variant:
    name: str
    quantization: str | None
    kv_cache_dtype: str


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo",
                        help="demo, trained-tiny-qwen3-moe (trained on ShareGPT's first 12000 "
                             "conversations; cached, the first run trains it for 12 minutes), "
                             "tiny-qwen3-moe (random, written to a temporary folder) or a model "
                             "path")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma list from {', '.join(VARIANTS)}; float32 always runs")
    parser.add_argument("--num-tokens", type=int, default=20_000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--sharegpt-skip", type=int, default=12000)
    parser.add_argument("--answers", type=int, default=8,
                        help="MT-Bench questions answered greedily by every variant")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    names = ["float32", *(n for n in args.variants.split(",") if n != "float32")]
    variants = [Variant(n, *VARIANTS[n]) for n in names]
    with tempfile.TemporaryDirectory(prefix="bench_quant_") as scratch:
        path = model_path(args.model, Path(scratch))
        sequences = held_out_sequences(path, args.num_tokens, args.seq_len, args.sharegpt_skip)
        print(f"{sum(map(len, sequences))} tokens in {len(sequences)} sequences of at most "
              f"{args.seq_len}", flush=True)
        kl = divergences(path, variants, sequences)
        answers = mt_bench_answers(path, variants, args.answers, args.answer_tokens)
    print_results(args.model, kl, answers)
    if args.json:
        Path(args.json).write_text(json.dumps({"kl": kl, "answers": answers}, indent=2))


def model_path(model: str, scratch: Path) -> str:
    if model == "demo":
        from sgl_jax.demo import demo_model_path

        return str(demo_model_path())
    if model == "trained-tiny-qwen3-moe":
        from sgl_jax.testing.trained_moe import trained_tiny_qwen3_moe

        return str(trained_tiny_qwen3_moe())
    if model == "tiny-qwen3-moe":
        from sgl_jax.testing import write_tiny_checkpoint

        return str(write_tiny_checkpoint(scratch / "qwen3_moe", "qwen3_moe"))
    return model


def held_out_sequences(path: str, num_tokens: int, seq_len: int, skip: int
                       ) -> list[list[int]]:
    from sgl_jax.datasets import iter_sharegpt_exchanges
    from sgl_jax.models.loader import open_checkpoint
    from sgl_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(open_checkpoint(path).model_dir)
    sequences, total = [], 0
    for question, answer in iter_sharegpt_exchanges(skip=skip):
        ids = tokenizer.encode(f"{question}\n\n{answer}", add_special_tokens=False)[:seq_len]
        if len(ids) < 16:
            continue
        ids = ids[: num_tokens - total]
        sequences.append(ids)
        total += len(ids)
        if total >= num_tokens:
            return sequences
    return sequences


def divergences(path: str, variants: list[Variant], sequences: list[list[int]]
                ) -> dict[str, dict]:
    """Per variant: mean KL(reference || variant) over every position, the share of
    positions whose argmax agrees with the reference's, and the seconds it took."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    reference_logprobs = None
    results = {}
    for variant in variants:
        start = time.perf_counter()
        logits = prefill_logits(path, variant, sequences)
        logprobs = [jax.nn.log_softmax(jnp.asarray(x)) for x in logits]
        if reference_logprobs is None:
            reference_logprobs = logprobs
        kl = np.concatenate([np.asarray(jnp.sum(jnp.exp(p) * (p - q), axis=-1))
                             for p, q in zip(reference_logprobs, logprobs, strict=True)])
        agree = np.concatenate([np.asarray(p.argmax(-1) == q.argmax(-1))
                                for p, q in zip(reference_logprobs, logprobs, strict=True)])
        results[variant.name] = {"mean_kl": float(kl.mean()), "p99_kl": float(
            np.quantile(kl, 0.99)), "argmax_agreement": float(agree.mean()),
            "seconds": time.perf_counter() - start}
        print(f"{variant.name}: mean KL {kl.mean():.5f}, argmax agreement {agree.mean():.4f}",
              flush=True)
    return results


def prefill_logits(path: str, variant: Variant, sequences: list[list[int]]) -> list:
    from sgl_jax.mem_cache.kv_cache import kv_cache_dtype
    from sgl_jax.model_executor.forward_batch import SeqChunk
    from sgl_jax.model_executor.model_runner import ModelRunner
    from sgl_jax.models.loader import load_model

    model = load_model(path, dtype="float32", progress=False, quantization=variant.quantization)
    longest = max(map(len, sequences))
    pages = -(-longest // 16)
    runner = ModelRunner(model, num_pages=pages + 1, page_size=16,
                         kv_dtype=kv_cache_dtype(variant.kv_cache_dtype, model.dtype))
    return [runner.forward([SeqChunk(ids, 0, list(range(1, 1 + -(-len(ids) // 16))))],
                           all_logits=True)[0] for ids in sequences]


def mt_bench_answers(path: str, variants: list[Variant], count: int, max_new_tokens: int
                     ) -> list[dict]:
    """The first turn of the first `count` MT-Bench questions, answered greedily (chat
    template, `max_new_tokens`) by each variant."""
    if not count:
        return []
    from sgl_jax import Engine
    from sgl_jax.datasets import load_mt_bench

    questions = [q.turns[0] for q in load_mt_bench()[:count]]
    rows = [{"question": q} for q in questions]
    for variant in variants:
        with Engine(model_path=path, dtype="float32", quantization=variant.quantization,
                    kv_cache_dtype=variant.kv_cache_dtype, skip_server_warmup=True) as engine:
            prompts = [engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                for q in questions]
            outputs = engine.generate(prompt=prompts, sampling_params={
                "temperature": 0, "max_new_tokens": max_new_tokens})
        for row, out in zip(rows, outputs, strict=True):
            row[variant.name] = {"text": out["text"], "ids": out["output_ids"]}
    return rows


def print_results(model: str, kl: dict[str, dict], answers: list[dict]) -> None:
    print(f"\nbench_quant_quality, {model}: next-token KL from float32")
    print(f"{'variant':>12}  {'mean KL':>9}  {'p99 KL':>8}  {'argmax agrees':>13}  {'s':>6}")
    for name, row in kl.items():
        print(f"{name:>12}  {row['mean_kl']:>9.5f}  {row['p99_kl']:>8.4f}  "
              f"{row['argmax_agreement']:>13.4f}  {row['seconds']:>6.1f}")
    for i, row in enumerate(answers):
        print(f"\n[{i}] {row['question'][:100]!r}")
        reference = row["float32"]["ids"]
        for name, answer in row.items():
            if name == "question":
                continue
            same = next((k for k, (a, b) in enumerate(zip(answer["ids"], reference,
                                                           strict=False)) if a != b), None)
            where = "same as float32" if same is None else f"differs from token {same}"
            print(f"  {name:>12} ({where}): {answer['text'][:160]!r}")


if __name__ == "__main__":
    main()
