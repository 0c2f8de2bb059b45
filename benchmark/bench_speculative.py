"""Speculative decoding against plain decoding on the same prompts, offline (Engine API).

For each draft shape and batch size: output tokens per second without and with speculation,
the speedup, the accept rate (accept length / draft tokens, as the seed model cards report
it), the accept length (tokens per verify round) and the acceptance rate of each draft
position (acc_0, acc_1, ...). Prints a table, writes JSON and a PNG of throughput against
batch size. Each configuration runs once untimed first, so no compilation is timed. The plain
engine stays loaded beside each speculative one and the two take turns batch by batch, so
each row's ratio compares runs interleaved in time (a shared VM's speed drifts by 10-20%
over minutes).

The two shapes of the seed cards are built in: chain (steps 5, topk 1, 6 draft tokens) and
tree (steps 3, topk 4, 8 draft tokens); `adaptive` lets the policy pick each round's shape
(plain, a one-step chain, a 3-step chain or the tree), with the tree as its ceiling.
--algorithm picks the drafter: EAGLE3 (default), EAGLE, STANDALONE, or NGRAM, which drafts
from the text itself (the request's prompt and output, and recent responses) and loads no draft
model. NGRAM's shapes: chain (steps 5, topk 1, 6 draft tokens), tree (steps 6, topk 4, 12 draft
tokens; topk only bounds the branching) and adaptive under that tree. `per-request` is
adaptive with per-request verification lengths (--speculative-per-request-lengths: packed
chain rounds, each request verifying the prefix its measured acceptance earns). Every row
also records the share of the batch's rounds that speculated (all but the `plain` ones of
rounds_by_shape).

    # real checkpoints (a GPU machine)
    python benchmark/bench_speculative.py --model-path meta-llama/Llama-3.1-8B-Instruct \\
        --draft-model-path lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B --dtype bfloat16
    # anywhere: a random Llama-style target and a random EAGLE3 head built locally
    python benchmark/bench_speculative.py --batch-sizes 1,4 --output-len 32
    # a near copy of the target as a STANDALONE draft: high acceptance, no cheaper draft
    python benchmark/bench_speculative.py --draft noisy-copy
    # the demo pair on real questions (the seed cards' tables): MT-Bench, HumanEval, ShareGPT
    python benchmark/bench_speculative.py --model-path demo --draft-model-path demo \\
        --dataset mtbench --batch-sizes 1,8,32 --output-len 256
    # model-free drafting where the answer copies the prompt, and where it cannot pay
    python benchmark/bench_speculative.py --model-path demo --algorithm NGRAM \\
        --dataset code-edits --shapes chain,tree,adaptive --batch-sizes 1,8,32 --output-len 256
    python benchmark/bench_speculative.py --model-path demo --algorithm NGRAM \\
        --dataset mtbench --batch-sizes 1,8,32 --output-len 256

With --dataset, every prompt is a user message (quote-turns: a conversation) rendered with
the target's chat template (a HumanEval prompt is asked to be completed), generation is greedy
and stops at EOS or --output-len, and each batch size runs all the prompts, --batch-size at a
time. Greedy speculation must give the very tokens of plain decoding: the rows count the
prompts whose outputs differ (float rounding in a batched verify can flip a near tie; anything
more is a bug), over every pass with --repeats, which runs the prompts that many times per
engine (a batch-64 row of 64 prompts is otherwise one wave, whose ratio moves by several
points between runs). The ShareGPT prompts come after the file's first --sharegpt-skip
conversations, which drafts trained on the file's start (the demo head included) never saw.
`mixed` alternates a HumanEval prompt (predictable code) with a request to continue a list of
random words (text no draft predicts), so every batch holds both.

    python benchmark/bench_speculative.py --model-path demo --draft-model-path demo \\
        --dataset mixed --shapes chain,tree,adaptive --batch-sizes 1,8,32 --num-prompts 32

Two datasets whose answers repeat text already in the prompt, the case model-free drafting is
for. `code-edits`: functions of 15-60 lines from pure-Python standard library modules
(CODE_EDIT_MODULES: textwrap, json, shlex, csv, difflib, ...; the list is fixed for a given
Python version), each with one small change to make (rename a parameter or a local variable,
add a docstring line, or change a default value; picked by a checksum of the function's name)
and a request to output the whole function. `quote-turns`: the user's first turn of a ShareGPT
conversation (after --sharegpt-skip) and the dataset's reply as history, then a user turn
asking to repeat the reply word for word or to quote part of it; conversations whose rendered
prompt exceeds --max-prompt-tokens (1200: the demo model's context is 2048) are left out.
MT-Bench is the opposite case: fresh answers that no lookup in the text predicts.
`edits-and-chat` alternates a code edit with an MT-Bench question, so every batch holds
requests a lookup drafts well and requests it cannot: the case per-request lengths are for.

    python benchmark/bench_speculative.py --model-path demo --algorithm NGRAM \\
        --dataset quote-turns --batch-sizes 1,8,32 --num-prompts 64 --output-len 256
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib
import inspect
import json
import re
import sys
import tempfile
import textwrap
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = {
    "chain": {"speculative_num_steps": 5, "speculative_eagle_topk": 1,
              "speculative_num_draft_tokens": 6, "speculative_adaptive": False},
    "tree": {"speculative_num_steps": 3, "speculative_eagle_topk": 4,
             "speculative_num_draft_tokens": 8, "speculative_adaptive": False},
    # The policy's choice each round, under the seed cards' wide tree (it prices each shape
    # from the warm-up's timings).
    "adaptive": {"speculative_num_steps": 3, "speculative_eagle_topk": 4,
                 "speculative_num_draft_tokens": 8, "speculative_adaptive": True},
}


# NGRAM drafts by looking the text up, so a deeper draft costs it next to nothing: its tree
# goes six steps deep, topk only bounding how many continuations branch at a node.
NGRAM_SHAPES = {
    "chain": SHAPES["chain"],
    "tree": {"speculative_num_steps": 6, "speculative_eagle_topk": 4,
             "speculative_num_draft_tokens": 12, "speculative_adaptive": False},
    "adaptive": {"speculative_num_steps": 6, "speculative_eagle_topk": 4,
                 "speculative_num_draft_tokens": 12, "speculative_adaptive": True},
}
# NEXTN: the seed's command for Qwen3-Next's own module (3/1/4), and the shared tree shapes.
NEXTN_SHAPES = {
    "chain": {"speculative_num_steps": 3, "speculative_eagle_topk": 1,
              "speculative_num_draft_tokens": 4, "speculative_adaptive": False},
    "tree": SHAPES["tree"],
    "adaptive": SHAPES["adaptive"],
}
# DFLASH: one block forward drafts every step, so its chain goes 7 deep (the CPU-trained
# demo head's block is 8); its tree takes each position's top 3 within 16 nodes.
DFLASH_SHAPES = {
    "chain": {"speculative_num_steps": 7, "speculative_eagle_topk": 1,
              "speculative_num_draft_tokens": 8, "speculative_adaptive": False},
    "tree": {"speculative_num_steps": 7, "speculative_eagle_topk": 3,
             "speculative_num_draft_tokens": 16, "speculative_adaptive": False},
    "adaptive": {"speculative_num_steps": 7, "speculative_eagle_topk": 3,
                 "speculative_num_draft_tokens": 16, "speculative_adaptive": True},
}
# `per-request`: each drafter's adaptive shape with per-request verification lengths.
for _shapes in (SHAPES, NGRAM_SHAPES, NEXTN_SHAPES, DFLASH_SHAPES):
    _shapes["per-request"] = {**_shapes["adaptive"], "speculative_per_request_lengths": True}
ALGORITHMS = ("EAGLE3", "EAGLE", "STANDALONE", "NGRAM", "NEXTN", "DFLASH", "DSPARK")

DATASETS = ("random", "mtbench", "humaneval", "sharegpt", "mixed", "code-edits", "quote-turns",
            "edits-and-chat")
SHAREGPT_PROMPTS = 200
# --concurrent: prompts per engine turn, in batch sizes (the more, the less of a turn is its
# tail, where fewer than a batch of requests are left).
CONCURRENT_GROUP = 4

# Pure-Python standard library modules whose functions the code-edits prompts rewrite.
CODE_EDIT_MODULES = ("textwrap", "json.decoder", "json.encoder", "shlex", "csv", "difflib",
                     "fnmatch", "calendar", "statistics", "configparser", "string", "glob",
                     "heapq", "bisect", "pprint", "tokenize", "urllib.parse", "email.utils",
                     "functools", "ipaddress")
DOCSTRING_LINE = "This copy was edited for review."
# The last user turn of a quote-turns conversation, in turn ({topic}: a word of the reply).
QUOTE_REQUESTS = (
    "Repeat your previous answer word for word.",
    "Repeat your previous answer word for word, but add a one-sentence summary at the end.",
    'Quote the part of your previous answer about "{topic}", word for word.',
    "Quote the first paragraph of your previous answer word for word, then explain it in one "
    "sentence.",
)


@dataclass
class Row:
    shape: str
    batch_size: int
    baseline_tok_s: float
    speculative_tok_s: float
    speedup: float
    accept_rate: float  # accept length / draft tokens
    accept_length: float  # tokens per verify round
    position_rates: list[float | None] = field(default_factory=list)  # acc_0, acc_1, ...
    dataset: str = "random"
    num_prompts: int = 0
    outputs_differing: int = 0  # prompts whose speculative output differs from plain decoding
    rounds_by_shape: dict[str, int] = field(default_factory=dict)  # what the rounds took
    # requests finished with_draft / without_draft (the adaptive policy's admission rule)
    finished_requests: dict[str, int] = field(default_factory=dict)
    repeat_speedups: list[float] = field(default_factory=list)  # each --repeats pass's own
    algorithm: str | None = None  # the drafter (None: rows written before it was recorded)
    # rounds that verified a draft / all rounds (plain ones included), from rounds_by_shape
    speculated_round_share: float | None = None
    # the policy's warm-up timing of each shape's round in the row's batch bucket
    # (spec_round_ms), and its price at the row's end (spec_believed_round_ms)
    round_ms: dict[str, float] = field(default_factory=dict)
    believed_round_ms: dict[str, float] = field(default_factory=dict)
    # the drafter's own scores against verification at the row's end (spec_draft_confidence:
    # ece of the raw scores, calibrated_ece of the policy's estimates; {} where none count)
    draft_confidence: dict[str, float] = field(default_factory=dict)
    concurrent: bool = False  # served at a concurrency of batch_size, not in waves
    # each engine's scheduler over its timed turns ("plain", "speculative"): phases_between
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="target checkpoint; default: a random one built here")
    p.add_argument("--draft-model-path", help="draft checkpoint; default: built here")
    p.add_argument("--algorithm", default="EAGLE3", choices=ALGORITHMS,
                   help="the drafter; NGRAM drafts from the text itself and loads no draft "
                        "model (its shapes: chain 5/1/6, tree 6/4/12, adaptive); NEXTN runs "
                        "the target's own MTP module (Qwen3-Next; a built target gets one "
                        "fitted to its greedy continuations of the prompts; chain 3/1/4); "
                        "DFLASH takes a DFlash head (chain 7/1/8, tree 7/3/16), DSPARK a "
                        "DSpark head (the same shapes)")
    p.add_argument("--draft", default="random-eagle3", choices=["random-eagle3", "noisy-copy"],
                   help="the draft built when --draft-model-path is not given (an EAGLE "
                        "head for --algorithm EAGLE, a noisy copy for STANDALONE)")
    p.add_argument("--preset", default="llama", help="architecture of the built target")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--dataset", default="random", choices=DATASETS,
                   help="random token ids of --input-len, or real questions")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="real datasets: the first N prompts (default: all; ShareGPT 200)")
    p.add_argument("--sharegpt-skip", type=int, default=12000,
                   help="ShareGPT conversations at the file's start never drawn (the demo head "
                        "trained on the first 12000)")
    p.add_argument("--max-prompt-tokens", type=int, default=1200,
                   help="code-edits and quote-turns: leave out longer prompts (the demo "
                        "model's context is 2048 tokens)")
    p.add_argument("--shapes", default="chain,tree")
    p.add_argument("--num-steps", type=int, default=None,
                   help="every shape's draft depth (a chain verifies N + 1 tokens), e.g. 3 "
                        "for a DFlash head with a block of 4; default: each shape's own")
    p.add_argument("--batch-sizes", default="1,4,16,32")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every prompt this many times per engine (from an emptied prefix "
                        "cache each time): a row's speedup is over all of them, and the spread "
                        "of each pass's own is printed")
    p.add_argument("--concurrent", action="store_true",
                   help="serve each batch size as a server at that concurrency (a request "
                        f"starts as one finishes, in turns of {CONCURRENT_GROUP} batches of "
                        "prompts) instead of in waves that each run to their end")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", help="write the rows here")
    p.add_argument("--output-png", help="plot tokens/s against batch size here")
    p.add_argument("--replot", nargs="+", metavar="JSON",
                   help="run nothing: plot the rows of these --output-json files into "
                        "--output-png")
    return p.parse_args(argv)


def build_models(args: argparse.Namespace, workdir: Path) -> tuple[str, str | None, str]:
    """(target path, draft path, algorithm), building random checkpoints when none is given.
    NGRAM has no draft model: its draft path is None."""
    from sgl_jax.demo import demo_draft_path, demo_model_path
    from sgl_jax.testing import write_noisy_copy
    from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft, write_tiny_eagle_draft

    target = str(demo_model_path()) if args.model_path == "demo" else args.model_path
    if args.algorithm == "NGRAM":
        if args.draft_model_path is not None:
            raise SystemExit("--algorithm NGRAM drafts from the text and loads no draft model: "
                             "leave out --draft-model-path")
        return target or build_target(args, workdir), None, "NGRAM"
    if args.algorithm == "NEXTN":
        if args.draft_model_path is not None:
            raise SystemExit("--algorithm NEXTN drafts with the target's own MTP module: "
                             "leave out --draft-model-path")
        if target is None:
            from sgl_jax.testing.mtp import fit_mtp_tensors

            target = build_target(args, workdir)
            fit_mtp_tensors(target, random_prompt_ids(args, target), new_tokens=args.output_len)
        return target, None, "NEXTN"
    if args.draft_model_path == "demo":
        return target, str(demo_draft_path()), "EAGLE3"
    target = target or build_target(args, workdir)
    if args.draft_model_path is not None:
        return target, args.draft_model_path, args.algorithm
    if args.draft == "noisy-copy" or args.algorithm == "STANDALONE":
        return target, str(write_noisy_copy(target, workdir / "draft", relative_noise=0.03)), \
            "STANDALONE"
    config = json.loads((Path(target) / "config.json").read_text())
    if args.algorithm == "DFLASH":  # random: the round's cost, nothing accepted
        from sgl_jax.testing.dflash import write_tiny_dflash_draft

        return target, str(write_tiny_dflash_draft(workdir / "draft", config)), "DFLASH"
    if args.algorithm == "DSPARK":  # random, as DFLASH's; its block holds the 7-deep chain
        from sgl_jax.testing.dspark import write_tiny_dspark_draft

        return target, str(write_tiny_dspark_draft(workdir / "draft", config)), "DSPARK"
    if args.algorithm == "EAGLE":
        return target, str(write_tiny_eagle_draft(workdir / "draft", config)), "EAGLE"
    return target, str(write_tiny_eagle3_draft(workdir / "draft", config,
                                               intermediate_size=3 * config["hidden_size"])), \
        "EAGLE3"


def build_target(args: argparse.Namespace, workdir: Path) -> str:
    """A random target of --preset, --hidden-size and --num-layers."""
    from sgl_jax.testing import write_tiny_checkpoint

    heads = max(args.hidden_size // 64, 1)
    return str(write_tiny_checkpoint(
        workdir / "target", args.preset, hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=64, intermediate_size=3 * args.hidden_size))


def shapes_for(algorithm: str) -> dict[str, dict[str, Any]]:
    """The engine settings of each named draft shape for the drafter."""
    return {"NGRAM": NGRAM_SHAPES, "NEXTN": NEXTN_SHAPES, "DFLASH": DFLASH_SHAPES,
            "DSPARK": DFLASH_SHAPES}.get(algorithm, SHAPES)


def with_depth(shapes: dict[str, dict[str, Any]], num_steps: int | None
               ) -> dict[str, dict[str, Any]]:
    """The shapes with `num_steps` draft steps each (None: as they are); a chain's draft
    tokens follow its depth, a tree keeps its node budget."""
    if num_steps is None:
        return shapes
    deeper = {}
    for name, shape in shapes.items():
        shape = {**shape, "speculative_num_steps": num_steps}
        if shape["speculative_eagle_topk"] == 1:
            shape["speculative_num_draft_tokens"] = num_steps + 1
        deeper[name] = shape
    return deeper


def warm_up(engine: Any, prompts: list[list[int]], batch_size: int) -> None:
    """Run every wave of the prompts once, short and untimed, then empty the prefix cache, so
    every timed prompt is prefilled in full (a speculative engine reuses one page less of a
    cached prompt than a plain one, as its draft's last cached slot depends on the next
    token, so warm prompts would favour the plain engine). Every wave, not only the first:
    a program's first run costs more than later ones (tens of ms on a CPU), and a plain
    engine's warm-up compiles its prefill buckets without running them where a speculative
    one runs each, so a prompt length met first in a timed wave slowed the plain engine
    alone (batch-1 rows where both ran the same programs read 1.07-1.08x). Where the first
    pass left background builds, they are waited for and the waves run again: a CPU server
    builds a batch bucket's programs once a batch first needs it and the adaptive policy
    times each new shape on its first use, so without that the timed rounds shared the two
    cores with compiles (per-request lengths, with twice the shapes, read 0.75x at batch 8
    with 3% of its rounds drafted)."""
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    for _ in range(2):
        for first in range(0, len(prompts), batch_size):
            engine.generate(input_ids=prompts[first: first + batch_size],
                            sampling_params=params)
        if not engine.get_server_info()["programs_building"]:
            break
        engine.wait_for_programs()
    if not engine.flush_cache():
        raise RuntimeError("the prefix cache could not be emptied after the warm-up")


def paired_generate(engines: list[Any], prompts: list[list[int]], output_len: int,
                    batch_size: int, *, ignore_eos: bool, repeats: int = 1,
                    concurrent: bool = False
                    ) -> list[tuple[float, list[list[int]], list[float], dict[str, Any]]]:
    """Per engine: output tokens per second over all prompts, `repeats` times (each from an
    emptied prefix cache, as the first); the outputs of every repeat; each repeat's
    tokens per second; and its scheduler's phases over its own timed turns
    (phases_between), with the programs traced meanwhile ("compilations": a compile stall,
    or a build in the background, that the timing includes). The prompts run in turns:
    waves of batch_size, each to its end, or (`concurrent`) groups of CONCURRENT_GROUP *
    batch_size served with batch_size requests in flight, the next starting as one
    finishes. The engines take turns, so a machine
    whose speed drifts over minutes (a shared VM's memory bandwidth does) weighs on each
    alike, and in alternating order. `outputs` keep the prompts' order whatever the turns."""
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": ignore_eos}
    seconds = np.zeros((repeats, len(engines)))
    tokens = np.zeros((repeats, len(engines)))
    outputs: list[list[list[int]]] = [[] for _ in engines]
    phases: list[dict[str, Any]] = [{} for _ in engines]
    turn_size = batch_size * (CONCURRENT_GROUP if concurrent else 1)
    for repeat in range(repeats):
        if repeat:
            for engine in engines:
                engine.flush_cache()
        for turn, first in enumerate(range(0, len(prompts), turn_size)):
            # Who goes first alternates, so neither engine always meets a drifting machine
            # right after the other.
            order = list(enumerate(engines))
            for i, engine in order if (repeat + turn) % 2 == 0 else order[::-1]:
                before = engine.get_server_info()
                start = time.perf_counter()
                outs = serve(engine, prompts[first: first + turn_size], params, batch_size)
                seconds[repeat, i] += time.perf_counter() - start
                after = engine.get_server_info()
                phases[i] = {**phases_between(before["scheduler_phases"],
                                              after["scheduler_phases"], phases[i]),
                             "compilations": phases[i].get("compilations", 0)
                             + after["num_compilations"] - before["num_compilations"]}
                outputs[i] += [o["output_ids"] for o in outs]
                tokens[repeat, i] += sum(len(o["output_ids"]) for o in outs)
    return [(tokens[:, i].sum() / seconds[:, i].sum(), outputs[i],
             list(tokens[:, i] / seconds[:, i]), phases[i]) for i in range(len(engines))]


def phases_between(before: dict[str, Any], after: dict[str, Any],
                   total: dict[str, Any] | None = None) -> dict[str, Any]:
    """`total` plus what the scheduler's phases (/get_server_info's scheduler_phases:
    idle seconds, and per kind of step its count, rows, launch and settle seconds) added
    from `before` to `after`."""
    total = total or {}
    added = {}
    for key, value in after.items():
        if isinstance(value, dict):
            added[key] = {k: total.get(key, {}).get(k, 0) + v - before[key][k]
                          for k, v in value.items()}
        else:
            added[key] = total.get(key, 0) + value - before[key]
    return added


def serve(engine: Any, prompts: list[list[int]], params: dict[str, Any], in_flight: int
          ) -> list[dict[str, Any]]:
    """The outputs of `prompts`, in their order, with at most `in_flight` requests running:
    all at once when there are no more (a wave), else each next as one finishes."""
    if len(prompts) <= in_flight:
        return engine.generate(input_ids=prompts, sampling_params=params)

    async def all_of_them() -> list[dict[str, Any]]:
        slots = asyncio.Semaphore(in_flight)

        async def one(prompt: list[int]) -> dict[str, Any]:
            async with slots:
                return await engine.async_generate(input_ids=prompt, sampling_params=params)
        return await asyncio.gather(*(one(prompt) for prompt in prompts))
    return asyncio.run(all_of_them())


def acceptance_since(engine: Any, before: dict[str, Any]) -> tuple[float, list[float]]:
    """Accept length and per-position rates of the rounds run since `before` was read."""
    after = engine.get_server_info()
    rounds = max(after["spec_verify_rounds"] - before["spec_verify_rounds"], 1)
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    counts = np.subtract(after["spec_accepted_per_position"],
                         before["spec_accepted_per_position"])
    drafted = np.subtract(after["spec_drafted_per_position"],
                          before["spec_drafted_per_position"])
    rates = [a / d if d else None for a, d in zip(counts.tolist(), drafted.tolist(), strict=True)]
    return 1 + accepted / rounds, rates  # None: a depth no round drafted


def counts_since(engine: Any, before: dict[str, Any], key: str) -> dict[str, int]:
    """The server-info counts under `key` (e.g. rounds per shape) since `before` was read."""
    after = engine.get_server_info()[key]
    return {name: n - before[key].get(name, 0) for name, n in after.items()}


def speculated_share(rounds_by_shape: dict[str, int]) -> float | None:
    """Share of the batch's rounds that verified a draft (every shape but `plain`), None when
    no round ran."""
    total = sum(rounds_by_shape.values())
    return 1 - rounds_by_shape.get("plain", 0) / total if total else None


def load_prompts(args: argparse.Namespace, target: str, tokenizer: Any) -> list[list[int]]:
    """Token ids of the prompts: random ids, or the dataset's conversations through the chat
    template."""
    if args.dataset == "random":
        config = Path(target) / "config.json"
        vocab = (json.loads(config.read_text())["vocab_size"] if config.is_file()
                 else len(tokenizer))
        return random_prompt_ids(args, target, vocab)
    from sgl_jax.tokenizer.chat_template import ChatTemplate

    template = ChatTemplate(tokenizer)
    return [template.encode(messages) for messages in conversations(args, tokenizer, template)]


def random_prompt_ids(args: argparse.Namespace, target: str, vocab: int | None = None
                      ) -> list[list[int]]:
    """--dataset random's prompts: as many as the largest batch, of --input-len ids each."""
    if vocab is None:
        vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    count = max(int(b) for b in args.batch_sizes.split(","))
    rng = np.random.default_rng(args.seed)
    return rng.integers(3, vocab, (count, args.input_len)).tolist()


def conversations(args: argparse.Namespace, tokenizer: Any, template: Any
                  ) -> list[list[dict[str, str]]]:
    """The message lists to render: one user turn, or (quote-turns) a ShareGPT exchange and
    a request to repeat or quote its reply. Code edits and quote turns rendered by `template`
    longer than --max-prompt-tokens are left out."""
    from sgl_jax import datasets

    def measure(messages: list[dict[str, str]]) -> int:
        return len(template.encode(messages))

    if args.dataset == "quote-turns":
        found = quote_turn_conversations(
            datasets.iter_sharegpt_exchanges(skip=args.sharegpt_skip), measure,
            args.num_prompts or SHAREGPT_PROMPTS, max_tokens=args.max_prompt_tokens)
    elif args.dataset in ("code-edits", "edits-and-chat"):
        found = [m for e in code_edits() if measure(m := [{"role": "user", "content": e.request}])
                 <= args.max_prompt_tokens][: args.num_prompts]
        if args.dataset == "edits-and-chat":
            chat = [[{"role": "user", "content": q.turns[0]}] for q in datasets.load_mt_bench()]
            pairs = zip(found, chat, strict=False)  # as many pairs as the shorter list
            found = [m for pair in pairs for m in pair][: args.num_prompts]
    else:
        return [[{"role": "user", "content": q}] for q in questions(args, tokenizer)]
    if not found:
        raise SystemExit(f"no {args.dataset} prompts found within --max-prompt-tokens "
                         f"{args.max_prompt_tokens}"
                         + (f" (--sharegpt-skip {args.sharegpt_skip} may skip the whole file)"
                            if args.dataset == "quote-turns" else ""))
    return found


def questions(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    from sgl_jax import datasets

    if args.dataset == "mixed":
        code = ["Complete this Python function.\n\n" + p.prompt for p in datasets.load_humaneval()]
        found = [text for pair in zip(code, random_word_requests(tokenizer, len(code), args.seed),
                                      strict=True) for text in pair]
    elif args.dataset == "mtbench":
        found = [q.turns[0] for q in datasets.load_mt_bench()]
    elif args.dataset == "humaneval":
        found = ["Complete this Python function.\n\n" + p.prompt
                 for p in datasets.load_humaneval()]
    else:
        def count(text):
            return len(tokenizer.encode(text, add_special_tokens=False))
        found = [p.prompt for p in datasets.sample_sharegpt(
            args.num_prompts or SHAREGPT_PROMPTS, count, seed=args.seed,
            output_len=args.output_len, skip=args.sharegpt_skip)]
    if not found:
        raise SystemExit(f"no {args.dataset} prompts found (--sharegpt-skip {args.sharegpt_skip} "
                         "may skip the whole file)")
    return found[: args.num_prompts]


def random_word_requests(tokenizer: Any, count: int, seed: int) -> list[str]:
    """Requests to continue lists of 40 words drawn at random from the tokenizer's
    vocabulary: text that no draft can predict."""
    words = sorted({w.strip() for w in tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
                    if w.strip().isalpha() and len(w.strip()) >= 4})
    rng = np.random.default_rng(seed)
    return ["Continue this list of random words with forty more: "
            + ", ".join(rng.choice(words, 40)) for _ in range(count)]


@dataclass(frozen=True)
class CodeEdit:
    """A function of a Python module and one small change to make to it."""

    module: str  # e.g. "json.decoder"
    qualname: str  # "dedent", or "Class.method"
    source: str  # its lines in the module's file, decorators included, dedented
    change: str  # e.g. "rename the parameter `text` to `text_arg`"

    @property
    def request(self) -> str:
        """The user message: the whole function, the change, and to answer with all of it."""
        return (f"Rewrite this function from Python's `{self.module}` module with one change: "
                f"{self.change}. Change nothing else, and output the whole rewritten function "
                f"in one Python code block.\n\n```python\n{self.source}```")


def code_edits(modules: Iterable[str] = CODE_EDIT_MODULES, *, min_lines: int = 15,
               max_lines: int = 60) -> list[CodeEdit]:
    """Every function of `modules` (top-level, or a top-level class's method) of min_lines to
    max_lines lines, each with one change picked by a checksum of its name, ordered by that
    checksum (so any first N mixes modules). The same list every run of a given Python version:
    the standard library's source differs between versions."""
    edits = [CodeEdit(module, name, source, edit_change(f"{module}.{name}", source))
             for module in modules for name, source in module_functions(module)
             if min_lines <= len(source.splitlines()) <= max_lines]
    return sorted(edits, key=lambda e: (zlib.crc32(f"{e.module}.{e.qualname}".encode()),
                                        e.module, e.qualname))


def module_functions(module_name: str) -> list[tuple[str, str]]:
    """(qualified name, dedented source) of the module's functions and its classes' methods, in
    file order. A name defined twice is left out (which one is live depends on the code around
    it), and so is a method whose text does not dedent to code of its own (a string in it
    spans lines indented less than the method)."""
    lines = inspect.getsource(importlib.import_module(module_name)).splitlines(keepends=True)
    found = []
    for node in ast.parse("".join(lines)).body:
        members = ([(f"{node.name}.", m) for m in node.body] if isinstance(node, ast.ClassDef)
                   else [("", node)])
        for prefix, f in members:
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([d.lineno for d in f.decorator_list] + [f.lineno])
                text = "".join(lines[first - 1: f.end_lineno]).rstrip("\n") + "\n"
                found.append((prefix + f.name, textwrap.dedent(text)))
    defined = Counter(name for name, _ in found)
    return [(name, source) for name, source in found
            if defined[name] == 1 and not source[0].isspace() and _parses(source)]


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def edit_change(key: str, source: str) -> str:
    """One small change to the function in `source`, picked by `key`'s checksum among those it
    allows: rename its first parameter, rename its first local variable, add a docstring line,
    change its first plain default value."""
    function = ast.parse(source).body[0]
    options = [change for change in (rename_parameter(function), rename_local(function),
                                     docstring_line(function), change_default(function, source))
               if change is not None]
    return options[zlib.crc32(key.encode()) % len(options)]


def _fresh_name(name: str, function: ast.AST, suffix: str) -> str:
    taken = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)} | {
        a.arg for a in ast.walk(function) if isinstance(a, ast.arg)}
    new = f"{name}_{suffix}"
    while new in taken:
        new += "_"
    return new


def rename_parameter(function: ast.FunctionDef) -> str | None:
    a = function.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)
             if p.arg not in ("self", "cls")]
    if not names:
        return None
    return f"rename the parameter `{names[0]}` to `{_fresh_name(names[0], function, 'arg')}`"


def rename_local(function: ast.FunctionDef) -> str | None:
    """The first name the body assigns, unless it is a parameter, global or nonlocal."""
    skip = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)} | {"_"} | {
        n for s in ast.walk(function) if isinstance(s, ast.Global | ast.Nonlocal) for n in s.names}
    stores = [n for n in ast.walk(function) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store) and n.id not in skip]
    if not stores:
        return None
    name = min(stores, key=lambda n: (n.lineno, n.col_offset)).id
    return f"rename the local variable `{name}` to `{_fresh_name(name, function, 'var')}`"


def docstring_line(function: ast.FunctionDef) -> str:
    if ast.get_docstring(function) is None:
        return f'add "{DOCSTRING_LINE}" to it as a one-line docstring'
    return f'add "{DOCSTRING_LINE}" as the last line of its docstring'


def change_default(function: ast.FunctionDef, source: str) -> str | None:
    """The first parameter whose default is a literal number, bool or string, given another."""
    a = function.args
    positional = [*a.posonlyargs, *a.args]
    pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True),
             *((p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d)]
    for param, default in pairs:
        if isinstance(default, ast.Constant) and type(default.value) in (bool, int, float, str):
            return (f"change the default value of `{param.arg}` from "
                    f"`{ast.get_source_segment(source, default)}` to "
                    f"`{_other_value(default.value)!r}`")
    return None


def _other_value(value: bool | int | float | str) -> bool | int | float | str:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if len(value) <= 1:
        return next(c for c in ";|-" if c != value)
    return value.upper() if value.upper() != value else value + "_"


def quote_request(reply: str, index: int) -> str:
    """The last user turn of quote-turns conversation `index`: QUOTE_REQUESTS in turn. The one
    about a topic names the reply's longest word (the first of them); a reply without a word
    of 6 letters or more gets the first request instead."""
    request = QUOTE_REQUESTS[index % len(QUOTE_REQUESTS)]
    if "{topic}" not in request:
        return request
    words = re.findall(r"\b[A-Za-z]{6,}\b", reply)
    return request.format(topic=max(words, key=len)) if words else QUOTE_REQUESTS[0]


def quote_turn_conversations(exchanges: Iterable[tuple[str, str]],
                             measure: Callable[[list[dict[str, str]]], int], num: int, *,
                             max_tokens: int = 1200, min_reply_words: int = 40
                             ) -> list[list[dict[str, str]]]:
    """Up to `num` conversations, in the exchanges' order: the user's turn, the assistant's reply
    from the data, and a user turn asking to repeat or quote that reply (`quote_request`). An
    exchange is left out when its reply has fewer than min_reply_words words (little to quote)
    or the conversation measures more than max_tokens (`measure`: e.g. the token count of the
    chat template's rendering)."""
    found: list[list[dict[str, str]]] = []
    for prompt, reply in exchanges:
        if len(found) == num:
            break
        if len(reply.split()) < min_reply_words:
            continue
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": quote_request(reply, len(found))}]
        if measure(messages) <= max_tokens:
            found.append(messages)
    return found


def run(args: argparse.Namespace) -> list[Row]:
    from sgl_jax import Engine

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    shapes = args.shapes.split(",")
    real = args.dataset != "random"
    with tempfile.TemporaryDirectory() as tmp:
        target, draft, algorithm = build_models(args, Path(tmp))
        settings = with_depth(shapes_for(algorithm), args.num_steps)
        if unknown := [s for s in shapes if s not in settings]:
            raise SystemExit(f"unknown --shapes {unknown}: choose from {list(settings)}")
        # NGRAM needs no draft weights: no draft path goes to its engine.
        draft_args = {} if draft is None else {"speculative_draft_model_path": draft}
        # Every engine warms up as a server does, so no timed batch compiles a prefill length.
        common = dict(dtype=args.dtype, page_size=args.page_size,
                      precompile_bs_paddings=batch_sizes, max_running_requests=max(batch_sizes))
        if not real:
            common["context_length"] = args.input_len + args.output_len + 64
        with Engine(model_path=target, **common) as plain:
            plain.wait_for_programs()
            prompts = load_prompts(args, target, plain.tokenizer)
            rows = []
            for shape in shapes:
                with Engine(model_path=target, speculative_algorithm=algorithm,
                            **draft_args, **{**common, **settings[shape]}) as engine:
                    engine.wait_for_programs()  # no timed round shares the host with a compile
                    for b in batch_sizes:
                        chosen = prompts if real else prompts[:b]
                        for warmed in (plain, engine):  # the policy's first rounds too
                            warm_up(warmed, chosen, b)
                        before = engine.get_server_info()  # the timed turns' counts follow
                        ((base_tok_s, base_outputs, base_runs, base_phases),
                         (tok_s, outputs, runs, phases)) = (
                            paired_generate([plain, engine], chosen, args.output_len, b,
                                            ignore_eos=not real, repeats=args.repeats,
                                            concurrent=args.concurrent))
                        length, rates = acceptance_since(engine, before)
                        draft_tokens = settings[shape]["speculative_num_draft_tokens"]
                        differing = sum(a != c for a, c in zip(outputs, base_outputs,
                                                               strict=True))
                        rounds = counts_since(engine, before, "spec_rounds_by_shape")
                        after = engine.get_server_info()
                        rows.append(Row(shape, b, base_tok_s, tok_s, tok_s / base_tok_s,
                                        length / draft_tokens, length, rates, args.dataset,
                                        len(chosen), differing, rounds,
                                        counts_since(engine, before,
                                                     "spec_finished_requests"),
                                        [r / p for r, p in zip(runs, base_runs, strict=True)],
                                        algorithm, speculated_share(rounds),
                                        *(bucket_round_ms(after, b, key)
                                          for key in ("spec_round_ms",
                                                      "spec_believed_round_ms")),
                                        draft_confidence(after), args.concurrent,
                                        {"plain": base_phases, "speculative": phases}))
                        print_row(rows[-1])
                        save_rows(args, rows)  # a run cut short keeps what it measured
    return rows


def bucket_round_ms(info: dict, batch_size: int, key: str = "spec_round_ms"
                    ) -> dict[str, float]:
    """The policy's round cost per shape (`key`: the warm-up timings, or
    spec_believed_round_ms) in the smallest timed bucket that holds `batch_size` requests
    ({} without an adaptive policy's timings)."""
    table = info.get(key) or {}
    fitting = sorted(int(bucket) for bucket in table if int(bucket) >= batch_size)
    return table[str(fitting[0])] if fitting else {}


def draft_confidence(info: dict) -> dict[str, float]:
    """The calibration of the drafter's scores since the engine started, decayed as the
    server keeps it ({} where no node was scored: a drafter that gives no scores)."""
    error = info.get("spec_draft_confidence") or {}
    return error if error.get("nodes") else {}


def save_rows(args: argparse.Namespace, rows: list[Row]) -> None:
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([asdict(r) for r in rows], indent=2))


HEADER = (f"{'dataset':11} {'shape':6} {'bs':>3} {'baseline tok/s':>15} {'spec tok/s':>11} "
          f"{'speedup':>8} {'accept rate':>12} {'accept len':>11} {'differ':>6}  "
          "per-position acceptance")


def print_row(row: Row) -> None:
    rates = " ".join("-" if r is None else f"{r:.2f}" for r in row.position_rates)
    print(f"{row.dataset:11} {row.shape:6} {row.batch_size:>3}{'c' if row.concurrent else ' '}"
          f"{row.baseline_tok_s:>15.1f} "
          f"{row.speculative_tok_s:>11.1f} {row.speedup:>7.2f}x {row.accept_rate:>11.1%} "
          f"{row.accept_length:>11.2f} {row.outputs_differing:>6}  [{rates}]"
          + (f"  rounds {row.rounds_by_shape}" if len(row.rounds_by_shape) > 1 else "")
          + (f"  speculated {row.speculated_round_share:.0%} of rounds"
             if row.speculated_round_share is not None and row.speculated_round_share < 1
             else "")
          + (f"  without a draft {row.finished_requests['without_draft']}"
             f"/{sum(row.finished_requests.values())} requests"
             if row.finished_requests.get("without_draft") else "")
          + ("  round ms " + ", ".join(f"{k} {v:.2f}" for k, v in row.round_ms.items())
             + " (priced at the end: "
             + ", ".join(f"{k} {v:.2f}" for k, v in row.believed_round_ms.items()) + ")"
             if len(row.round_ms) > 1 else "")
          + (f"  draft confidence ece {row.draft_confidence['ece']:.3f}, calibrated "
             f"{row.draft_confidence['calibrated_ece']:.3f} over "
             f"{row.draft_confidence['nodes']:.0f} nodes" if row.draft_confidence else "")
          + (f"  passes {min(row.repeat_speedups):.2f}-{max(row.repeat_speedups):.2f}x"
             if len(row.repeat_speedups) > 1 else ""),
          flush=True)
    for engine, phases in row.phases.items():
        print(f"    {engine} engine: {describe_phases(phases)}", flush=True)


def describe_phases(phases: dict[str, Any]) -> str:
    """One line of phases_between: per kind of step its count, rows each, and the engine
    thread's launch and settle ms each; then the seconds it waited for work and the programs
    it traced."""
    parts = []
    for kind in ("decode", "prefill"):
        phase = phases.get(kind)
        if phase and phase["steps"]:
            steps = phase["steps"]
            parts.append(f"{kind} {steps} steps x {phase['rows'] / steps:.1f} rows, launch "
                         f"{1e3 * phase['launch_s'] / steps:.2f} + settle "
                         f"{1e3 * phase['settle_s'] / steps:.2f} ms each")
    return "; ".join(parts + [f"idle {phases.get('idle_s', 0.0):.2f} s",
                              f"{phases.get('compilations', 0)} programs traced"])


def plot(rows: list[Row], path: str) -> None:
    """Output tokens/s against batch size, one panel per dataset: plain decoding and each
    shape of the rows (each drafter's apart, when the rows hold several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r.dataset for r in rows))
    several = len({r.algorithm for r in rows}) > 1
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        mine = sorted((r for r in rows if r.dataset == dataset), key=lambda r: r.batch_size)
        plain = {b: float(np.mean([r.baseline_tok_s for r in mine if r.batch_size == b]))
                 for b in dict.fromkeys(r.batch_size for r in mine)}
        ax.plot(list(plain), list(plain.values()), marker="s", color="grey", linestyle="--",
                label="plain")
        for algorithm, shape in dict.fromkeys((r.algorithm, r.shape) for r in mine):
            points = [r for r in mine if (r.algorithm, r.shape) == (algorithm, shape)]
            ax.plot([r.batch_size for r in points], [r.speculative_tok_s for r in points],
                    marker="o", label=f"{algorithm} {shape}" if several else shape)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens/s")
        ax.set_title(dataset)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def replot(json_paths: list[str], png: str) -> None:
    """One figure from the rows of earlier runs (e.g. batch size 1 and larger ones apart)."""
    rows = [Row(**row) for p in json_paths for row in json.loads(Path(p).read_text())]
    plot(rows, png)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        replot(args.replot, args.output_png)
        return 0
    print(HEADER)
    rows = run(args)
    if args.output_png:
        plot(rows, args.output_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
