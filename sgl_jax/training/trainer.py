"""The training loop: batches, the jitted TTT step over the mesh, checkpoints and evaluation.

Parallelism is the server's: parameters carry the `parallel` package's tensor-parallel
shardings (Megatron layout over the "tp" mesh axis) and batch rows split over the "dp" axis;
XLA inserts the collectives. The target runs beside the draft in the same step (online
features): nothing is written to disk, and the features always come from the weights being
served (docs/training.md says why).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from tqdm import tqdm

from sgl_jax.models.loader import LoadedModel
from sgl_jax.parallel import TensorParallel
from sgl_jax.training.data import Example
from sgl_jax.training.objective import Batch, Objective

logger = logging.getLogger(__name__)

ROW_ALIGN = 64  # row lengths are rounded up to a multiple of this (row_width)
EVAL_SEED = 12345  # what an objective samples at evaluation is the same at every checkpoint


@dataclass(frozen=True)
class Hyper:
    lr: float = 1e-4
    warmup_ratio: float = 0.02
    max_grad_norm: float = 0.5
    weight_decay: float = 0.0
    compute_dtype: Any = jnp.float32  # the draft's and the target's arithmetic; master f32


class TrainState(NamedTuple):
    step: jax.Array  # i32[]
    params: dict[str, Any]  # the trainable draft tensors, float32
    opt_state: Any


# --------------------------------------------------------------------------- batches


def plan_batches(lengths: Sequence[int], tokens_per_batch: int, row_multiple: int,
                 seed: int) -> list[list[int]]:
    """Example indices grouped into batches of similar length (little padding), in a random
    order set by `seed`. A batch's shape is collate's: its width the bucket of its longest
    row (row_width) and as many rows as tokens_per_batch holds at that width (batch_rows),
    so a step computes at most tokens_per_batch tokens (at least one row's)."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    batches, current, width = [], [], 0
    for i in order:
        wider = max(width, row_width(lengths[i]))
        if current and len(current) + 1 > batch_rows(wider, tokens_per_batch, row_multiple):
            batches.append(current)
            current, wider = [], row_width(lengths[i])
        current.append(int(i))
        width = wider
    if current:
        batches.append(current)
    np.random.default_rng(seed).shuffle(batches)
    return batches


def collate(examples: Sequence[Example], row_multiple: int,
            tokens_per_batch: int | None = None) -> Batch:
    """The examples as one batch, right-padded to their width bucket (row_width) and, with
    `tokens_per_batch`, to the rows a batch of that width holds (batch_rows: one shape per
    width, so a run compiles a handful of step shapes), else to a multiple of row_multiple
    (the data-parallel size)."""
    width = row_width(max(len(e.input_ids) for e in examples))
    rows = (_round_up(len(examples), row_multiple) if tokens_per_batch is None
            else batch_rows(width, tokens_per_batch, row_multiple))
    if rows < len(examples):
        raise ValueError(f"{len(examples)} examples do not fit a batch of {rows} rows")
    ids = np.zeros((rows, width), np.int32)
    mask = np.zeros((rows, width), bool)
    for r, e in enumerate(examples):
        ids[r, : len(e.input_ids)] = e.input_ids
        mask[r, : len(e.loss_mask)] = e.loss_mask
    return Batch(ids, mask)


def row_width(length: int) -> int:
    """The padded width of a row of `length` tokens: a multiple of ROW_ALIGN, or of an
    eighth of the next power of two where that is coarser (past 8 * ROW_ALIGN), so a run
    compiles at most four widths an octave there and pads a row by under a quarter."""
    step = max(ROW_ALIGN, _power_of_two(max(length, 1)) // 8)
    return _round_up(max(length, 1), step)


def batch_rows(width: int, tokens_per_batch: int, row_multiple: int) -> int:
    """Rows of a batch `width` wide: as many as tokens_per_batch holds, in whole multiples
    of row_multiple, and at least row_multiple."""
    return max(row_multiple, tokens_per_batch // width // row_multiple * row_multiple)


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --------------------------------------------------------------------------- the step


class Trainer:
    """Holds the target, the objective, the draft's fixed parts and the compiled steps."""

    def __init__(self, target: LoadedModel, objective: Objective, draft_params: dict,
                 hyper: Hyper, total_steps: int, tp: TensorParallel, seed: int = 0):
        self.target, self.objective, self.hyper, self.tp = target, objective, hyper, tp
        self.key = jax.random.key(seed)
        self.frozen = {k: v for k, v in draft_params.items() if k in objective.frozen}
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, hyper.lr, max(1, round(hyper.warmup_ratio * total_steps)),
            max(total_steps, 2), end_value=0.0)
        self.schedule = schedule
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(hyper.max_grad_norm),
            optax.adamw(schedule, weight_decay=hyper.weight_decay))
        self._initial_params = _cast({k: v for k, v in draft_params.items()
                                      if k not in objective.frozen}, jnp.float32)
        # The target and the draft run as separate programs, and the state is not donated:
        # on XLA:CPU either change alone made a step 1.2x (one program) to 1.5x (donation)
        # slower.
        self._target_step = jax.jit(self._target)
        self._train_step = jax.jit(self._train_step_impl)
        self._eval_step = jax.jit(self._eval_step_impl)

    def init_state(self) -> TrainState:
        params = self._initial_params
        return TrainState(self.tp.put_replicated(np.int32(0)), params,
                          self.optimizer.init(params))

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        batch = self._device_batch(batch)
        outputs = self._target_step(self.target.params, batch)
        return self._train_step(state, self.target.params, outputs, batch)

    def evaluate(self, state: TrainState, batch: Batch):
        """The objective's metrics of the draft on a held-out batch."""
        batch = self._device_batch(batch)
        outputs = self._target_step(self.target.params, batch)
        return self._eval_step(state.params, self.target.params, outputs, batch)

    def draft_params(self, state: TrainState) -> dict[str, Any]:
        """The whole draft pytree (trained tensors and d2t) on the host."""
        return {**_to_host(state.params), **_to_host(self.frozen)}

    def target_outputs(self, batch: Batch):
        """What the target gives the objective for a host batch, on the device."""
        return self._target_step(self.target.params, self._device_batch(batch))

    # ------------------------------------------------------------------ jitted bodies

    def _target(self, target_params, batch: Batch):
        return self.objective.target(self.target, target_params, batch)

    def _loss(self, params, target_params, outputs, batch: Batch, key):
        draft = {**_cast(params, self.hyper.compute_dtype), **self.frozen}
        return self.objective.loss(draft, target_params, outputs, batch, key)

    def _train_step_impl(self, state: TrainState, target_params, outputs, batch: Batch):
        key = jax.random.fold_in(self.key, state.step)
        grads, result = jax.grad(self._loss, has_aux=True)(state.params, target_params,
                                                           outputs, batch, key)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": result.total, "losses": result.losses,
                   "accuracies": result.accuracies, "counts": result.counts,
                   "grad_norm": optax.global_norm(grads), "lr": self.schedule(state.step)}
        return TrainState(state.step + 1, params, opt_state), self.tp.constrain_replicated(
            metrics)

    def _eval_step_impl(self, params, target_params, outputs, batch: Batch):
        key = jax.random.key(EVAL_SEED)
        return self.tp.constrain_replicated(
            self._loss(params, target_params, outputs, batch, key)[1])

    def _device_batch(self, batch: Batch) -> Batch:
        sharding = self.tp.batch_sharding()
        return Batch(*(jax.make_array_from_callback(a.shape, sharding,
                                                    functools.partial(_index, a))
                       for a in batch))


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def _index(array: np.ndarray, index) -> np.ndarray:
    return array[index]


def _to_host(tree: Any) -> Any:
    """Device arrays -> numpy, gathering shards other processes hold."""
    if jax.process_count() > 1:
        tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, tree)


# --------------------------------------------------------------------------- checkpoints


def save_state(directory: str | Path, state: TrainState, meta: dict) -> None:
    """The whole training state (step, parameters, optimizer moments) as flat leaves in one
    .npz plus meta.json, written to a temporary directory and renamed, so an interrupted save
    never leaves a half-written checkpoint behind."""
    leaves = _to_host(jax.tree.leaves(state))
    if jax.process_index() != 0:
        return
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    np.savez(tmp / "state.npz", *leaves)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        directory.rename(old)
        tmp.rename(directory)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        tmp.rename(directory)


def load_state(directory: str | Path, like: TrainState) -> tuple[TrainState, dict]:
    """A saved state, placed with the shardings of `like` (a freshly initialised state)."""
    directory = Path(directory)
    with np.load(directory / "state.npz") as f:
        leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
    template, treedef = jax.tree.flatten(like)
    if len(leaves) != len(template):
        raise ValueError(f"checkpoint {directory} holds {len(leaves)} arrays, this run's state "
                         f"has {len(template)}: was it saved with another draft config?")
    placed = []
    for saved, fresh in zip(leaves, template, strict=True):
        if saved.shape != fresh.shape:
            raise ValueError(f"checkpoint {directory} has an array of shape {saved.shape} "
                             f"where this run has {fresh.shape}")
        placed.append(jax.make_array_from_callback(
            fresh.shape, fresh.sharding, functools.partial(_index, saved.astype(fresh.dtype))))
    meta = json.loads((directory / "meta.json").read_text())
    return jax.tree.unflatten(treedef, placed), meta


# --------------------------------------------------------------------------- the loop


@dataclass
class LoopConfig:
    epochs: float = 1.0
    max_steps: int | None = None
    tokens_per_batch: int = 8192
    save_interval: int = 200
    seed: int = 0


def total_steps(num_batches: int, loop: LoopConfig) -> int:
    steps = math.ceil(num_batches * loop.epochs)
    return min(steps, loop.max_steps) if loop.max_steps else steps


def epoch_plan(epoch: int, lengths: Sequence[int], loop: LoopConfig, row_multiple: int
               ) -> list[list[int]]:
    """Epoch e's batches, in the order seed + e sets, so a resumed run sees exactly the
    batches it would have seen."""
    return plan_batches(lengths, loop.tokens_per_batch, row_multiple, loop.seed + epoch)


def run_training(trainer: Trainer, state: TrainState, examples: Sequence[Example],
                 loop: LoopConfig, *, steps: int, checkpoint_dir: Path | None,
                 on_save=None, on_step=None, progress: bool = True
                 ) -> tuple[TrainState, list[dict]]:
    """Train from state.step to `steps`, saving every save_interval steps (then calling
    on_save(state, step)); on_step(step, metrics) sees each step's metrics. Returns the final
    state and the metrics of the steps run (host arrays)."""
    lengths = [len(e.input_ids) for e in examples]
    row_multiple = trainer.tp.dp_size
    history = []
    start = int(state.step)
    per_epoch = len(epoch_plan(0, lengths, loop, row_multiple))
    plan_epoch, plan = None, []
    bar = tqdm(total=steps, initial=start, desc="Training", unit="step",
               disable=not progress or jax.process_index() != 0)
    tokens, began = 0, time.perf_counter()
    for step in range(start, steps):
        if step // per_epoch != plan_epoch:
            plan_epoch = step // per_epoch
            plan = epoch_plan(plan_epoch, lengths, loop, row_multiple)
        chosen = [examples[i] for i in plan[step % per_epoch]]
        batch = collate(chosen, row_multiple, loop.tokens_per_batch)
        num_tokens = sum(len(e.input_ids) for e in chosen)
        state, metrics = trainer.train_step(state, batch)
        metrics = jax.tree.map(np.asarray, metrics)
        history.append(metrics)
        if on_step is not None:
            on_step(step + 1, metrics)
        tokens += num_tokens
        rate = tokens / max(time.perf_counter() - began, 1e-9)
        bar.set_postfix(loss=f"{float(metrics['loss']):.3f}",
                        acc_0=f"{float(metrics['accuracies'][0]):.3f}", tok_s=f"{rate:.0f}")
        bar.update()
        done = step + 1
        if checkpoint_dir is not None and (done % loop.save_interval == 0 or done == steps):
            save_state(checkpoint_dir, state, {"step": done, "seed": loop.seed})
            if on_save is not None:
                on_save(state, done)
    bar.close()
    return state, history
