"""Time one training step (target forward + draft forward/backward + update) on the demo model.

    python benchmark/bench_train_step.py --batch 16 --seq-len 256
    python benchmark/bench_train_step.py --algorithm DSPARK --batch 4 --seq-len 256 \
        --draft-config '{"num_hidden_layers": 1, "block_size": 4, "markov_rank": 64}'

EAGLE3 (TTT), DFLASH or DSPARK (blocks at --num-anchors random anchors a row). Prints the
seconds of the target's forward alone and of a whole step (best of --repeats after one
warm-up step), and tokens per second. The tokens are random: the speed does not depend on
them.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from sgl_jax.demo import demo_model_path
from sgl_jax.models import dflash as dflash_model
from sgl_jax.models import dspark as dspark_model
from sgl_jax.models import llama_eagle3
from sgl_jax.models.loader import LoadedModel, load_model, read_hf_config
from sgl_jax.parallel import TensorParallel
from sgl_jax.training import dflash as dflash_lib
from sgl_jax.training import draft as draft_lib
from sgl_jax.training import dspark as dspark_lib
from sgl_jax.training.objective import Batch, Eagle3Objective, Objective
from sgl_jax.training.trainer import Hyper, Trainer


def eagle3_head(args, target: LoadedModel, hf: dict, tp: TensorParallel
                ) -> tuple[Objective, dict]:
    """A fresh EAGLE3 head over a random draft vocabulary of --draft-vocab-size ids."""
    rng = np.random.default_rng(0)
    d2t = np.sort(rng.choice(hf["vocab_size"], args.draft_vocab_size, replace=False))
    d2t = d2t - np.arange(args.draft_vocab_size)
    config = llama_eagle3.config_from_hf(
        draft_lib.draft_hf_config(hf, args.draft_vocab_size, args.draft_config))
    params = draft_lib.place_draft(config, draft_lib.initial_tensors(
        config, d2t, draft_lib.target_output_rows(target), 0), np.float32, tp)
    capture = llama_eagle3.target_capture_layers(target.config.num_layers, config)
    return Eagle3Objective(config, capture, args.ttt_length), params


def dflash_head(args, target: LoadedModel, hf: dict, tp: TensorParallel
                ) -> tuple[Objective, dict]:
    config = dflash_model.config_from_hf(dflash_lib.dflash_hf_config(hf, args.draft_config))
    params = dflash_lib.place_head(config, dflash_lib.initial_tensors(config, 0), np.float32,
                                   tp)
    return dflash_lib.DFlashObjective(config, target, num_anchors=args.num_anchors), params


def dspark_head(args, target: LoadedModel, hf: dict, tp: TensorParallel
                ) -> tuple[Objective, dict]:
    config = dspark_model.config_from_hf(dspark_lib.dspark_hf_config(hf, args.draft_config))
    params = dspark_lib.place_head(config, dspark_lib.initial_tensors(config, target, 0),
                                   np.float32, tp)
    return dspark_lib.DSparkObjective(config, num_anchors=args.num_anchors), params


HEADS = {"EAGLE3": eagle3_head, "DFLASH": dflash_head, "DSPARK": dspark_head}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="the target (default: the demo model)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--algorithm", choices=list(HEADS), default="EAGLE3")
    p.add_argument("--draft-config", type=json.loads, default=None,
                   help="JSON overrides of the head's config.json (as train_eagle3's file)")
    p.add_argument("--num-anchors", type=int, default=96,
                   help="DFLASH / DSPARK: blocks a row (train_eagle3's --num-anchors)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    tp = TensorParallel.of_size(1)
    target = load_model(args.model_path or str(demo_model_path()), dtype="float32", tp=tp,
                        progress=False)
    hf = read_hf_config(target.model_dir)
    objective, params = HEADS[args.algorithm](args, target, hf, tp)
    trainer = Trainer(target, objective, params, Hyper(), 100, tp)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf["vocab_size"], (args.batch, args.seq_len)).astype(np.int32)
    batch = Batch(ids, np.ones(ids.shape, bool))
    state = trainer.init_state()
    state, metrics = trainer.train_step(state, batch)  # compiles
    jax.block_until_ready(metrics)
    target_s, step_s = [], []
    for _ in range(args.repeats):
        began = time.perf_counter()
        jax.block_until_ready(trainer.target_outputs(batch))
        target_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        step_s.append(time.perf_counter() - began)
    step = min(step_s)
    print(json.dumps({"device": str(jax.devices()[0].platform), "algorithm": args.algorithm,
                      "batch": args.batch,
                      "seq_len": args.seq_len, "draft_vocab_size": args.draft_vocab_size,
                      "ttt_length": args.ttt_length, "target_forward_s": round(min(target_s), 2),
                      "train_step_s": round(step, 2),
                      "tokens_per_s": round(ids.size / step, 1)}))


if __name__ == "__main__":
    main()
