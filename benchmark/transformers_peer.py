"""The transformers peer of the benchmarks, in a process of its own.

bench_one_batch and bench_offline_throughput compare with Hugging Face transformers on the same
checkpoint and prompts. The peer runs here, as a child process started by `run_peer`, so that
it gets torch's own defaults: nothing in this file sets an environment variable or a thread
count, and no JAX runtime shares the process. It reads one JSON request on stdin and writes one
JSON result on stdout:

    {"task": "decode_steps", "model_path": ..., "dtype": "float32", "output_len": 32,
     "repeats": 3, "prompts_by_batch": {"1": [[ids...]], ...}}
    {"task": "throughput", "model_path": ..., "dtype": "float32", "output_len": 64,
     "concurrency": 16, "prompts": [[ids...], ...]}

A .gguf model_path loads with transformers' GGUF reader (needs the `gguf` package).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# The peer reports the variables with these prefixes that it finds set (it never sets any):
# OpenMP, MKL and Intel/GNU OpenMP runtime settings change torch's threading.
THREAD_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_")


def run_peer(request: dict) -> dict:
    """Run one request in a fresh Python process with the caller's environment as it is.

    The child's log goes to our stderr; a failure raises with its exit status.
    """
    done = subprocess.run([sys.executable, str(Path(__file__).resolve())],
                          input=json.dumps(request), stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the transformers peer exited with status {done.returncode} "
                           "(its log is above)")
    return json.loads(done.stdout)


def describe_peer(env: dict) -> str:
    """One line on how the transformers peer ran: its process, torch and thread settings."""
    found = ", ".join(f"{k}={v}" for k, v in env["thread_env"].items())
    return (f"own process (pid {env['pid']}), torch {env['torch_version']}, transformers "
            f"{env['transformers_version']}, {env['torch_threads']} torch threads, "
            f"thread environment: {found or 'none set'}")


def hf_source(model_path: str) -> tuple[str, dict]:
    """from_pretrained's first argument and extra keywords: a .gguf file loads from its folder
    with gguf_file=its name."""
    path = Path(model_path)
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return model_path, {}


def vocab_size(model_path: str) -> int:
    """The vocabulary size in the checkpoint's config (transformers' reading of it)."""
    from transformers import AutoConfig

    source, kwargs = hf_source(model_path)
    config = AutoConfig.from_pretrained(source, **kwargs)
    return int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)


# --------------------------------------------------------------------------- in the child


def load_model(model_path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    source, kwargs = hf_source(model_path)
    return AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype),
                                                **kwargs).eval()


def environment() -> dict:
    import torch
    import transformers

    return {"pid": os.getpid(), "python": platform.python_version(),
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "thread_env": {name: value for name, value in sorted(os.environ.items())
                           if name.startswith(THREAD_ENV_PREFIXES)}}


def decode_steps(model, request: dict) -> dict:
    """Per-step greedy decode time of generate, per batch size.

    Method: a StoppingCriteria that never stops timestamps every generated token inside
    generate(max_new_tokens=output_len). The first stamp follows the prefill; each interval
    after it is one decode step with generate's per-token overhead (logits processing, cache
    update, argmax) -- the work our step timing covers. The median interval over `repeats`
    runs (after a warm-up run) is reported. Differencing two generate lengths would mix in
    the prefill's run-to-run noise, which swamps the decode time at larger batches.
    """
    import torch

    output_len, repeats = request["output_len"], request["repeats"]
    by_batch = {}
    for batch, prompts in request["prompts_by_batch"].items():
        input_ids = torch.tensor(prompts, dtype=torch.long)
        _timed_generate(model, input_ids, output_len)  # warm-up
        runs = [_timed_generate(model, input_ids, output_len) for _ in range(repeats)]
        steps = np.concatenate([np.diff(stamps) for _, stamps, _ in runs])
        decode_s = float(np.median(steps))
        by_batch[int(batch)] = {
            "generate_ms": float(np.median([total for total, _, _ in runs])) * 1e3,
            "decode_ms": decode_s * 1e3, "decode_tok_s": int(batch) / decode_s,
            "decode_ms_p10": float(np.percentile(steps, 10)) * 1e3,
            "decode_ms_p90": float(np.percentile(steps, 90)) * 1e3,
            "tokens": runs[-1][2],
        }
    return {"method": "median interval between generated tokens inside generate()",
            "by_batch": by_batch}


def _timed_generate(model, input_ids, new_tokens: int):
    """One greedy generate of exactly new_tokens tokens: (total s, per-token stamps, tokens)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps = []

    class StepClock(StoppingCriteria):
        def __call__(self, ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)

    kwargs = {
        # Explicit mask: pad = eos, and a random prompt may contain the eos id.
        "attention_mask": torch.ones_like(input_ids),
        "max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
        "pad_token_id": _first(model.generation_config.eos_token_id),
        "stopping_criteria": StoppingCriteriaList([StepClock()]),
    }
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(input_ids, **kwargs)
        total = time.perf_counter() - start
    return total, np.array(stamps), out[:, input_ids.shape[1]:].tolist()


def _first(token_id):
    return token_id[0] if isinstance(token_id, list) else token_id


def throughput(model, request: dict) -> dict:
    """The prompts in batches of c through greedy generate; output tok/s over the pass.

    Our requests use ignore_eos. generate's min_new_tokens instead bans EOS until the last
    token, which changes the greedy token wherever EOS is the argmax (a random model's EOS is
    an ordinary id). Without an EOS id generate neither bans nor stops on it; generate fills
    an eos_token_id=None argument from the generation config, so it is cleared there.
    """
    import torch

    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = _first(eos)
    prompts, c, output_len = request["prompts"], request["concurrency"], request["output_len"]
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    batches = [torch.tensor(prompts[i:i + c], dtype=torch.long)
               for i in range(0, len(prompts), c)]
    with torch.no_grad():
        warm = batches[0]  # untimed: the first call at a batch size allocates and warms up
        model.generate(input_ids=warm, attention_mask=torch.ones_like(warm),
                       **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        tokens, batch_s = [], []
        start = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            out = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), **kwargs)
            batch_s.append(time.perf_counter() - t0)
            tokens.extend(out[:, batch.shape[1]:].tolist())
        wall_s = time.perf_counter() - start
    if any(len(t) != output_len for t in tokens):
        raise RuntimeError(f"transformers did not generate {output_len} tokens per prompt")
    return {"requests": len(prompts), "batches": len(batches), "wall_s": wall_s,
            "batch_s": batch_s, "output_tok_s": len(prompts) * output_len / wall_s,
            "tokens": tokens}


TASKS = {"decode_steps": decode_steps, "throughput": throughput}


def main() -> None:
    request = json.load(sys.stdin)
    # Our stdout carries only the result: libraries' prints go to stderr, at the fd level.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    model = load_model(request["model_path"], request["dtype"])
    result = TASKS[request["task"]](model, request)
    result["environment"] = environment()
    with os.fdopen(result_fd, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
