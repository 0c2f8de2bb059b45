"""A tiny Qwen3-MoE trained on ShareGPT text, in Hugging Face layout, cached per user.

What: a ``Qwen3MoeForCausalLM`` of 1.9M parameters (4 layers, every one of them MoE with
8 experts, top 2, hidden size 128) and the repository's tiny byte-level BPE tokenizer
(vocabulary 512), trained with next-token cross-entropy (plus the router's load-balancing
loss) on the first exchange of ShareGPT conversations. Weights are saved in float32.

Why: a quantization benchmark should measure what users meet, the sensitivity of a *trained*
model to 8-bit rounding. The random tiny checkpoints (``write_tiny_checkpoint``) are drawn with
ten times the usual initializer range so that their outputs are peaked; that makes them chaotic,
amplifying any perturbation, so their KL divergence under quantization says little about a
real model. Training only on conversations before ``TRAIN_RECORDS`` keeps the text that
``benchmark/bench_quant_quality.py`` evaluates on (``--sharegpt-skip 12000``) unseen.

Where: ``user_cache_dir() / "trained-tiny-qwen3-moe-v1"``; a finished build holds
``training.json`` (its summary), and later calls return the folder without training. Delete
the folder to rebuild.

How long: ``minutes`` of training (12 by default; about 0.3 s per step of 4096 tokens on two
CPU cores) plus about 10 s to read and tokenize the data. Initialization and data order are
seeded; the learning-rate schedule follows the wall clock as well as the step count (so the
run always ends cooled down), hence two builds differ slightly in how far they got.

    python -m sgl_jax.testing.trained_moe [--minutes M] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sgl_jax.cache import user_cache_dir
from sgl_jax.testing.tokenizer import ENDOFTEXT_ID, TINY_VOCAB_SIZE, write_tiny_tokenizer

if TYPE_CHECKING:  # torch and transformers load only when a build is needed
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

CACHE_NAME = "trained-tiny-qwen3-moe-v1"  # bump the version when the recipe changes
MARKER = "training.json"  # written last: its presence means the checkpoint is complete

# bench_quant_quality evaluates on the records from 12000 on (its --sharegpt-skip).
TRAIN_RECORDS = 12000
# The last records of the training range are kept out of training to report a held-out loss.
HELD_OUT_RECORDS = 200
HELD_OUT_SEQUENCES = 32

# The benchmark's default --seq-len, so no position it evaluates is past what was trained.
SEQ_LEN = 512
BATCH_SIZE = 8
MAX_STEPS = 6000
WARMUP_STEPS = 100
PEAK_LR = 3e-3
FINAL_LR_FRACTION = 0.1
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
# Small, as MoE recipes use (OLMoE 0.01): enough to keep every layer's experts in use.
ROUTER_AUX_LOSS_COEF = 0.01
THREADS = 2
LOG_EVERY = 50

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_CONFIG = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "intermediate_size": 512,  # the dense MLP's; unused, every layer is MoE
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": SEQ_LEN,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
    # The tiny tokenizer has no BOS; like the random tiny checkpoints, both are <|endoftext|>.
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": ENDOFTEXT_ID,
    "router_aux_loss_coef": ROUTER_AUX_LOSS_COEF,
}


@dataclass
class TrainingSummary:
    seed: int
    minutes_budget: float
    steps: int
    seconds: float
    tokens_seen: int
    train_sequences: int
    final_train_loss: float  # mean cross-entropy (nats/token) over the last LOG_EVERY steps
    held_out_loss: float  # cross-entropy (nats/token) on the held-out records


def trained_tiny_qwen3_moe(directory: Path | None = None, *, minutes: float = 12.0,
                           seed: int = 0) -> Path:
    """The trained tiny Qwen3-MoE checkpoint folder, built (``minutes`` of training) unless
    a finished one is already there."""
    out = Path(directory) if directory is not None else user_cache_dir() / CACHE_NAME
    if (out / MARKER).is_file():
        return out
    scratch = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        train_and_save(scratch, minutes, seed)
        shutil.rmtree(out, ignore_errors=True)  # an unfinished folder from elsewhere
        scratch.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def train_and_save(out: Path, minutes: float, seed: int) -> None:
    import torch

    torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    tokenizer = write_tiny_tokenizer(out)
    train_stop = TRAIN_RECORDS - HELD_OUT_RECORDS
    train = _pack(_encode(tokenizer, training_documents(0, train_stop)))
    held_out = _pack(_encode(tokenizer, training_documents(train_stop, TRAIN_RECORDS)))
    held_out = held_out[:HELD_OUT_SEQUENCES]
    print(f"{len(train)} training and {len(held_out)} held-out sequences of {SEQ_LEN} tokens",
          flush=True)

    model = _new_model()
    summary = _train(model, train, minutes, seed)
    summary.held_out_loss = _mean_loss(model, held_out)
    print(f"final train loss {summary.final_train_loss:.4f}, held-out loss "
          f"{summary.held_out_loss:.4f} nats/token", flush=True)

    model.config.output_router_logits = False  # the inference default
    model.save_pretrained(out)  # config.json, generation_config.json, model.safetensors
    (out / MARKER).write_text(json.dumps(asdict(summary), indent=2) + "\n")


# --------------------------------------------------------------------------- data


def training_documents(first_record: int, stop_record: int) -> list[str]:
    """The first exchange of ShareGPT records [first_record, stop_record), as the benchmark
    formats it. Counted in records, as ``iter_sharegpt_exchanges(skip=...)`` counts."""
    from sgl_jax.datasets import first_exchange, iter_sharegpt

    records = itertools.islice(iter_sharegpt(), first_record, stop_record)
    exchanges = (first_exchange(record.get("conversations") or []) for record in records)
    return [f"{question}\n\n{answer}" for question, answer in filter(None, exchanges)]


def _encode(tokenizer: PreTrainedTokenizerFast, documents: list[str]) -> np.ndarray:
    """Every document's tokens, each followed by <|endoftext|>, in one stream."""
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    separator = np.array([ENDOFTEXT_ID], dtype=np.int32)
    return np.concatenate([part for doc in ids for part in (np.asarray(doc, np.int32),
                                                              separator)])


def _pack(stream: np.ndarray) -> torch.Tensor:
    """The stream cut into [n, SEQ_LEN] sequences (the tail that does not fill one dropped)."""
    import torch

    usable = len(stream) // SEQ_LEN * SEQ_LEN
    return torch.from_numpy(stream[:usable].reshape(-1, SEQ_LEN).astype(np.int64))


def _batches(sequences: torch.Tensor, seed: int) -> Iterator[torch.Tensor]:
    """Batches of sequences in a seeded order, reshuffled each epoch."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(sequences), generator=generator)
        for start in range(0, len(order) - BATCH_SIZE + 1, BATCH_SIZE):
            yield sequences[order[start:start + BATCH_SIZE]]


# --------------------------------------------------------------------------- model


def _new_model() -> Qwen3MoeForCausalLM:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(architectures=[ARCHITECTURE], **MODEL_CONFIG)
    return Qwen3MoeForCausalLM(config)  # transformers' initialization (std 0.02)


def _optimizer(model: Qwen3MoeForCausalLM) -> torch.optim.AdamW:
    import torch

    # Decaying norm weights towards 0 would fight their role as scales.
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": WEIGHT_DECAY},
                              {"params": vectors, "weight_decay": 0.0}],
                             lr=PEAK_LR, betas=(0.9, 0.95))


def _learning_rate(step: int, progress: float) -> float:
    """Linear warmup over WARMUP_STEPS, then cosine decay to FINAL_LR_FRACTION of the peak
    as progress (the larger of the step and time fractions spent) goes from 0 to 1."""
    warmup = min(1.0, (step + 1) / WARMUP_STEPS)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return PEAK_LR * warmup * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * cosine)


def _train(model: Qwen3MoeForCausalLM, sequences: torch.Tensor, minutes: float, seed: int
           ) -> TrainingSummary:
    optimizer = _optimizer(model)
    batches = _batches(sequences, seed)
    budget = minutes * 60
    recent: list[float] = []  # cross-entropy of the last LOG_EVERY steps
    step, start = 0, time.perf_counter()
    model.train()
    while (progress := max(step / MAX_STEPS, (time.perf_counter() - start) / budget)) < 1:
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, progress)
        cross_entropy, balance = _train_step(model, optimizer, next(batches))
        recent = [*recent[1 - LOG_EVERY:], cross_entropy]
        step += 1
        if step % LOG_EVERY == 0:
            print(f"step {step:5d}  {time.perf_counter() - start:7.1f} s  train loss "
                  f"{np.mean(recent):.4f}  balance loss {balance:.3f}  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
    seconds = time.perf_counter() - start
    print(f"{step} steps in {seconds:.0f} s ({seconds / max(step, 1):.3f} s/step)", flush=True)
    return TrainingSummary(seed=seed, minutes_budget=minutes, steps=step, seconds=seconds,
                           tokens_seen=step * BATCH_SIZE * SEQ_LEN,
                           train_sequences=len(sequences),
                           final_train_loss=float(np.mean(recent)), held_out_loss=math.nan)


def _train_step(model: Qwen3MoeForCausalLM, optimizer: torch.optim.Optimizer,
                batch: torch.Tensor) -> tuple[float, float]:
    """One AdamW step on cross-entropy + ROUTER_AUX_LOSS_COEF * load-balancing loss; returns
    both losses."""
    import torch

    out = model(input_ids=batch, output_router_logits=True)
    cross_entropy = _cross_entropy(out.logits, batch)
    balance = torch.stack([_balance_loss(logits) for logits in out.router_logits]).mean()
    (cross_entropy + ROUTER_AUX_LOSS_COEF * balance).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return cross_entropy.item(), balance.item()


def _cross_entropy(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _balance_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of one layer (top_k when balanced).
    transformers' own pools every layer's tokens, which only balances each expert's total
    over the layers: trained with it, single layers left experts unused."""
    import torch

    num_experts, top_k = router_logits.shape[-1], MODEL_CONFIG["num_experts_per_tok"]
    probs = router_logits.softmax(dim=-1)
    chosen = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, num_experts)
    token_share = chosen.float().mean(dim=0)  # [top_k, experts]
    return num_experts * (token_share * probs.mean(dim=0)).sum()


def _mean_loss(model: Qwen3MoeForCausalLM, sequences: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats/token) of the model over the sequences."""
    import torch

    batches = sequences.split(BATCH_SIZE)
    model.eval()
    with torch.no_grad():
        losses = [_cross_entropy(model(input_ids=batch).logits, batch).item()
                  for batch in batches]
    model.train()
    return float(np.average(losses, weights=[len(batch) for batch in batches]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=12.0, help="training time budget")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"checkpoint folder (default: <user cache>/{CACHE_NAME})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(trained_tiny_qwen3_moe(args.out, minutes=args.minutes, seed=args.seed))


if __name__ == "__main__":
    main()
