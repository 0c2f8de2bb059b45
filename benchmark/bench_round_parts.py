"""The cost of a speculative round in parts, beside a plain decode step, on any device.

For each draft shape and batch size, with every request `--context` tokens deep:

- decode: one plain decode step through ModelRunner.step (host arrays in, tokens out);
- round: one verify round through SpecRunner.round (the same, for a round);
- verify: SpecRunner.verify alone on the device (target forward over the trees with the
  tree mask, logits, acceptance walk, accepted K/V moved);
- draft: the drafter's propose and advance on the device (the tree's draft steps, the
  draft's extend over the accepted path); for a plain round, which leaves the draft behind,
  the share of one catch-up (SpecRunner.catch_up over CATCH_UP_WIDTH pending tokens) that
  falls to each plain round, counted in the break-even too;
- round on device: all three as the one program a round compiles to; host = round - that.

A round emits `accept length` tokens where a decode step emits one, so speculation pays when
the accept length exceeds round / decode: the break-even column. Contents of the caches and
trees do not change the cost (every shape is fixed), so random tokens stand in for real ones.

    python benchmark/bench_round_parts.py                      # the demo pair, chain and tree
    python benchmark/bench_round_parts.py --shapes 2/1/3,5/1/6,3/4/8 --batch-sizes 1,8,32
    python benchmark/bench_round_parts.py --model-path meta-llama/Llama-3.1-8B-Instruct \\
        --draft-model-path lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B --dtype bfloat16
    python benchmark/bench_round_parts.py --model-path Qwen/Qwen3-Next-80B-A3B-Instruct \\
        --algorithm NEXTN --shapes 3/1/4 --dtype bfloat16
    python benchmark/bench_round_parts.py --algorithm DFLASH --shapes 7/1/8,15/1/16,7/3/16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# "plain" is the adaptive policy's plain round: the target decodes the root and the draft
# catches up later, so its cost beside a decode step is what a plain round costs extra.
SHAPES = {"chain": "5/1/6", "tree": "3/4/8", "plain": "0/1/1"}


@dataclass
class Row:
    shape: str  # steps/topk/draft tokens
    batch_size: int
    decode_ms: float
    round_ms: float
    verify_ms: float
    draft_ms: float
    round_device_ms: float
    host_ms: float
    break_even_accept_length: float  # round / decode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="demo", help="target; default: the demo model")
    p.add_argument("--algorithm", default="EAGLE3",
                   choices=("EAGLE3", "NEXTN", "DFLASH", "DSPARK"),
                   help="NEXTN: the target's own multi-token-prediction module (Qwen3-Next; "
                        "--draft-model-path is ignored); DFLASH: a DFlash head; DSPARK: a "
                        "DSpark head")
    p.add_argument("--draft-model-path", default="demo",
                   help="the head; default: the demo model's trained EAGLE3 head, or for "
                        "DFLASH and DSPARK a random head of the published shape (5 layers, "
                        "block 16; DSpark's block 7 with a rank-256 Markov head: weights do "
                        "not change the cost)")
    p.add_argument("--shapes", default="chain,tree",
                   help="comma-separated: chain, tree, plain, or steps/topk/draft-tokens")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--context", type=int, default=256, help="committed tokens per request")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--output-json")
    return p.parse_args(argv)


def random_block_head(config: dict[str, Any], algorithm: str) -> str:
    """A random DFlash head (or DSpark: DeepSpec's block of 7 and rank-256 Markov head) for
    the target (its config.json), of the published heads' shape, in a temporary directory."""
    import tempfile

    from sgl_jax.testing.dflash import write_tiny_dflash_draft
    from sgl_jax.testing.dspark import write_tiny_dspark_draft
    from sgl_jax.training.dflash import DEFAULT_BLOCK, DEFAULT_LAYERS, default_target_layer_ids
    from sgl_jax.training.dspark import DEFAULTS

    shape = {"num_layers": DEFAULT_LAYERS, "target_layer_ids": tuple(
        default_target_layer_ids(config["num_hidden_layers"], DEFAULT_LAYERS))}
    folder = tempfile.mkdtemp(prefix=f"{algorithm.lower()}-")
    if algorithm == "DSPARK":
        return str(write_tiny_dspark_draft(folder, config, block_size=DEFAULTS["block_size"],
                                           markov_rank=DEFAULTS["markov_rank"], **shape))
    return str(write_tiny_dflash_draft(folder, config, block_size=DEFAULT_BLOCK, **shape))


def parse_shape(text: str) -> tuple[int, int, int]:
    steps, topk, tokens = (int(x) for x in SHAPES.get(text, text).split("/"))
    return steps, topk, tokens


def median_ms(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time of each fn() in ms, after one untimed call each (compilation). The
    calls take turns, so a load that comes and goes weighs on all of them alike."""
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


class Setup:
    """A target ModelRunner and its SpecRunner for one shape, loaded as the Engine loads them."""

    def __init__(self, args: argparse.Namespace, shape: tuple[int, int, int], max_batch: int):
        from sgl_jax.demo import demo_draft_path, demo_model_path
        from sgl_jax.model_executor.forward_batch import Buckets
        from sgl_jax.model_executor.model_runner import ModelRunner
        from sgl_jax.models.loader import load_model, read_hf_config
        from sgl_jax.server_args import ServerArgs
        from sgl_jax.speculative.drafters.factories import make_drafter, round_shapes
        from sgl_jax.speculative.round.verify import AcceptThresholds
        from sgl_jax.speculative.spec_config import TreeShape
        from sgl_jax.speculative.spec_runner import SpecRunner

        self.shape = TreeShape(*shape)
        plain = shape[0] == 0  # compiled beside a one-step chain, as the adaptive policy does
        steps, topk, tokens = (1, 1, 2) if plain else shape
        target = str(demo_model_path()) if args.model_path == "demo" else args.model_path
        draft = str(demo_draft_path()) if args.draft_model_path == "demo" else args.draft_model_path
        backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
        if args.algorithm == "NEXTN":
            draft = None  # the target's checkpoint holds the module
        self.model = load_model(target, dtype=args.dtype, tp=None)
        if args.algorithm in ("DFLASH", "DSPARK") and args.draft_model_path == "demo":
            draft = random_block_head(read_hf_config(self.model.model_dir), args.algorithm)
        server_args = ServerArgs(
            model_path=target, dtype=args.dtype, page_size=args.page_size,
            speculative_algorithm=args.algorithm, speculative_draft_model_path=draft,
            speculative_num_steps=steps, speculative_eagle_topk=topk,
            speculative_num_draft_tokens=tokens, speculative_adaptive=plain, **backend)
        context_len = args.context + 64
        self.pages_per_seq = -(-context_len // args.page_size)
        buckets = Buckets.automatic(max_tokens=256, max_seqs=max_batch, context_len=context_len,
                                    page_size=args.page_size)
        hybrid = self.model.config.is_hybrid  # request i holds recurrent-state slot i + 1
        self.runner = ModelRunner(self.model, num_pages=1 + max_batch * self.pages_per_seq,
                                  page_size=args.page_size, buckets=buckets,
                                  attention_backend=server_args.attention_backend,
                                  num_state_slots=max_batch + 1 if hybrid else 0,
                                  num_request_slots=buckets.max_seqs)  # request i: slot i
        spec = server_args.speculative
        shapes = round_shapes(spec, adaptive=plain)
        drafter = make_drafter(spec, self.model, attention_backend=server_args.attention_backend,
                               page_size=args.page_size, shapes=shapes).drafter
        self.spec = SpecRunner(self.runner, drafter, spec.shape, shapes=shapes,
                               thresholds=AcceptThresholds(1.0, 1.0))
        self.num_tokens = self.shape.num_draft_tokens
        self.tree_parents = _tree_parents(*shape)

    def pages(self, row: int) -> list[int]:
        return list(range(1 + row * self.pages_per_seq, 1 + (row + 1) * self.pages_per_seq))


def _tree_parents(steps: int, topk: int, tokens: int) -> np.ndarray:
    """i32[N]: a tree of N nodes, topk children per node in breadth-first order (a chain when
    topk is 1), no deeper than `steps`. Which tree it is does not change the cost."""
    parents = np.array([-1] + [(i - 1) // topk for i in range(1, tokens)], np.int32)
    depth = 0 if topk == 1 else int(np.ceil(np.log(tokens * (topk - 1) + 1) / np.log(topk))) - 1
    if (tokens - 1 if topk == 1 else depth) > steps:
        raise ValueError(f"{tokens} draft tokens do not fit {steps} steps of topk {topk}")
    return parents


def measure(setup: Setup, batch: int, context: int, repeats: int, shape_name: str) -> Row:
    import jax

    from sgl_jax.layers.sampler import NO_LOGPROBS
    from sgl_jax.model_executor.forward_batch import SeqChunk
    from sgl_jax.model_executor.model_runner import greedy_sampling_batch
    from sgl_jax.speculative.round.program import CATCH_UP_WIDTH, CatchUpRow, RoundInputs, RoundRows
    from sgl_jax.speculative.round.tree import DraftTree

    rng = np.random.default_rng(0)
    vocab = setup.runner.config.vocab_size
    runner, spec = setup.runner, setup.spec
    sampling = greedy_sampling_batch(batch, vocab)

    def decode():
        chunks = [SeqChunk([int(rng.integers(vocab))], context, setup.pages(i),
                           state_slot=i + 1)
                  for i in range(batch)]
        return runner.step(chunks, sampling, np.full(batch, -1, np.int32),
                           np.ones(batch, bool), False, want_logprobs=False).result().tokens

    # The round's arrays, padded to the batch bucket B: request i in request slot i and
    # recurrent-state slot i + 1; padding rows (inactive) read the null page and state slot 0.
    dtype = runner.model.dtype
    padded = spec.target.buckets.batch_padding(batch)
    active = np.arange(padded) < batch
    page_table = np.zeros((padded, spec.target.buckets.pages_per_seq), np.int32)
    for i in range(batch):
        pages = setup.pages(i)[: page_table.shape[1]]
        page_table[i, : len(pages)] = pages
    kv_lens = np.where(active, context, 0).astype(np.int32)
    root_tokens = np.where(active, rng.integers(vocab, size=padded), 0).astype(np.int32)
    width = spec.drafter.slot_width
    root_hidden = np.zeros((padded, width), dtype)
    root_hidden[:batch] = rng.standard_normal((batch, width))
    request_sampling = greedy_sampling_batch(padded, vocab)
    suppress = np.zeros(padded, np.int32)
    shape = setup.shape
    slots = np.where(active, np.arange(padded) + 1, 0).astype(np.int32)  # state slots
    rows = RoundRows(slots=np.where(active, np.arange(padded), -1).astype(np.int32),
                     page_table=page_table, kv_lens=kv_lens, root_tokens=root_tokens,
                     min_new_tokens=np.zeros(padded, np.int32), state_slots=slots,
                     max_depths=np.full(padded, shape.num_steps, np.int32))
    # A round reads each request's draft root from its slot (SlotState.draft): the same
    # random root hidden states go there. Later rounds overwrite them with the draft's
    # output, which costs the same (every shape is fixed).
    draft_state = spec.draft_state
    slot_roots = np.array(draft_state.slots.draft)
    slot_roots[:batch] = root_hidden[:batch]
    state = runner.state  # the spec runner's too
    draft_state.slots = dataclasses.replace(draft_state.slots,
                                            draft=spec.tp.put_replicated(slot_roots))
    tree = DraftTree(rng.integers(vocab, size=(padded, setup.num_tokens)).astype(np.int32),
                     np.tile(setup.tree_parents, (padded, 1)))
    detail = np.int32(NO_LOGPROBS)  # as served to requests that want no log-probabilities

    def inputs_of(rows, root_hidden, sampling, suppress):
        return RoundInputs(rows.slots >= 0, rows.kv_lens, rows.root_tokens, root_hidden,
                           sampling, suppress)

    def draft_part(params, kv, rows, root_hidden, sampling, suppress, verified):
        """The round's draft work: grow the tree, then extend over the accepted path."""
        inputs = inputs_of(rows, root_hidden, sampling, suppress)
        tree, kv = spec.propose(params, kv, inputs, rows, shape)
        root, kv = spec.drafter.advance(params, kv, tree, verified, inputs, rows.page_table,
                                        rows.state_slots)
        return kv, (tree, root)

    def verify_part(params, kv, rows, tree, sampling, suppress, detail):
        inputs = inputs_of(rows, None, sampling, suppress)
        return spec.verify(params, kv, rows, inputs, tree, detail, shape)

    # Everything goes in as an argument: a closed-over array would be folded at compile time.
    verify = jax.jit(verify_part, donate_argnums=1)
    verify_args = (rows, tree, request_sampling, suppress, detail)
    _, verified = jax.jit(verify_part)(
        runner.program_params.arrays, state.kv_cache, *verify_args)  # not donated: the cache stays
    draft = jax.jit(draft_part, donate_argnums=1)
    whole = spec.rounds[shape]  # the programs SpecRunner.round runs, by batch bucket
    packed, packing = spec.packed_round_inputs(shape, rows, request_sampling, detail)
    device_arrays = jax.device_put(packed)

    def run_verify():
        state.kv_cache, out = verify(runner.program_params.arrays, state.kv_cache, *verify_args)
        return out

    def run_draft():
        draft_state.kv, out = draft(spec.drafter.params, draft_state.kv, rows, root_hidden,
                                    request_sampling, suppress, verified)
        return out

    def run_round_device():
        (state.kv_cache, draft_state.kv, draft_state.slots, state.lengths, state.last_tokens,
         out) = whole(
            len(rows.slots), *spec.state_args(), *device_arrays, packing=packing)
        return out

    catch_up_rows = [CatchUpRow(
        i, setup.pages(i), max(context - CATCH_UP_WIDTH, 0),
        rng.integers(vocab, size=CATCH_UP_WIDTH),
        rng.standard_normal((CATCH_UP_WIDTH, spec.feature_width)).astype(dtype))
        for i in range(batch)]

    def run_catch_up():
        spec.catch_up(catch_up_rows, spec.buckets.batch_padding(batch))
        return draft_state.slots  # what it writes: blocking on it waits for the catch-up

    deferred = shape.num_draft_tokens == 1 and spec.defers_draft
    ms = median_ms({"decode": decode,
                    "round": lambda: spec.round(rows, request_sampling, False, shape,
                                                num_rows=batch,
                                                want_logprobs=False).result().tokens,
                    "verify": run_verify, "device": run_round_device,
                    "draft": run_catch_up if deferred else run_draft},
                   repeats)
    draft_ms = ms["draft"] / CATCH_UP_WIDTH if deferred else ms["draft"]
    round_ms = ms["round"] + (draft_ms if deferred else 0.0)
    return Row(shape_name, batch, ms["decode"], ms["round"], ms["verify"], draft_ms,
               ms["device"], ms["round"] - ms["device"], round_ms / ms["decode"])


HEADER = (f"{'shape':7} {'bs':>3} {'decode ms':>10} {'round ms':>9} {'verify ms':>10} "
          f"{'draft ms':>9} {'round on device':>16} {'host ms':>8} {'break-even accept len':>22}")


def print_row(row: Row) -> None:
    print(f"{row.shape:7} {row.batch_size:>3} {row.decode_ms:>10.2f} {row.round_ms:>9.2f} "
          f"{row.verify_ms:>10.2f} {row.draft_ms:>9.2f} {row.round_device_ms:>16.2f} "
          f"{row.host_ms:>8.2f} {row.break_even_accept_length:>22.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows: list[Row] = []
    print(HEADER)
    for name in args.shapes.split(","):
        shape = parse_shape(name)
        setup = Setup(args, shape, max(batch_sizes))
        for batch in batch_sizes:
            rows.append(measure(setup, batch, args.context, args.repeats,
                                "/".join(map(str, shape))))
            print_row(rows[-1])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

