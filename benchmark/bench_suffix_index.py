"""NGRAM's host-side index alone: microseconds a request of `SuffixIndex.propose_into` and a
token of `extend_many`, on code edits and chat, with acceptance simulated from the text that
follows.

Requests alternate between a code edit (bench_speculative's `code-edits` prompt; its answer
taken as the function's source in a code block, as a faithful edit mostly is) and a ShareGPT
exchange (the user's turn; the reply ShareGPT kept), tokenized with the demo model's
tokenizer. They run in waves of --batch; each round, every running request proposes a tree of
--nodes nodes (root included) and --depth levels in one call, as the engine's NGRAM does,
then commits what verification would accept, in one call too. Verification
is simulated: the tree's tokens are accepted down the path that matches the answer, then one
more token (the bonus) is committed, so the text grows as in serving and finished answers
join the recent responses. No model runs: the figures are the index's own cost on this
machine, which the engine pays once per request per drafted round.

    python benchmark/bench_suffix_index.py
    python benchmark/bench_suffix_index.py --pairs 48 --batch 32 --nodes 7 --depth 6

The digest covers every proposal (tokens, parents, probabilities to 5 decimals): two
versions of the index that print the same digest proposed the same trees.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
import time
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
try:
    import sgl_jax  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_HERE.parent))
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))
from bench_speculative import code_edits  # noqa: E402

from sgl_jax import datasets  # noqa: E402
from sgl_jax.speculative.drafters.ngram.suffix_index import SuffixIndex  # noqa: E402

MAX_PROMPT_TOKENS = 1500
MAX_ANSWER_TOKENS = 400


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=48, help="code edits, and as many chats")
    parser.add_argument("--batch", type=int, default=8, help="requests running at once")
    parser.add_argument("--nodes", type=int, default=7, help="tree nodes, the root included")
    parser.add_argument("--depth", type=int, default=6, help="tree depth below the root")
    return parser.parse_args(argv)


def requests(pairs: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per request, a code edit and a chat in turn."""
    from sgl_jax.demo import demo_model_path
    from sgl_jax.models.gguf import GGUFCheckpoint, find_gguf_file
    from sgl_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(GGUFCheckpoint(find_gguf_file(demo_model_path())).model_dir)
    edits = [(e.request, f"```python\n{e.source}```") for e in code_edits()[:pairs]]
    chats = itertools.islice(datasets.iter_sharegpt_exchanges(), pairs)
    found = []
    for edit, chat in zip(edits, chats, strict=False):
        for prompt, answer in (edit, chat):
            found.append((tokenizer.encode(prompt)[:MAX_PROMPT_TOKENS],
                          tokenizer.encode(answer)[:MAX_ANSWER_TOKENS]))
    return found


def accepted_run(tokens: np.ndarray, parents: np.ndarray, answer: list[int]) -> list[int]:
    """The answer's next tokens that the tree holds along one path from its root, then the
    bonus token (the answer's next one), as verification would commit them."""
    node, run = 0, []
    while len(run) < len(answer):
        children = np.flatnonzero((parents == node) & (tokens == answer[len(run)]))
        if not children.size:
            break
        node = int(children[0])
        run.append(answer[len(run)])
    return run + answer[len(run): len(run) + 1]


def run(args: argparse.Namespace) -> dict:
    work = requests(args.pairs)
    index = SuffixIndex()
    digest = hashlib.sha256()
    call_us, proposals, extend_seconds, committed = [], 0, 0.0, 0
    for first in range(0, len(work), args.batch):
        wave = dict(enumerate(work[first: first + args.batch]))
        done = dict.fromkeys(wave, 0)  # answer tokens committed so far
        for key, (prompt, _) in wave.items():
            index.add_request(key, prompt)
        while done:  # a round: every running request proposes, then commits
            keys = list(done)
            tokens, parents = np.empty((2, len(keys), args.nodes), np.int32)
            probs = np.empty((len(keys), args.nodes))
            start = time.perf_counter()
            index.propose_into(keys, args.depth, tokens, parents, probs)
            call_us.append((time.perf_counter() - start) * 1e6)
            proposals += len(keys)
            runs = []
            for row, key in enumerate(keys):
                for array in (tokens[row], parents[row],
                              np.round(probs[row].astype(np.float32), 5)):
                    digest.update(array.tobytes())
                runs.append(accepted_run(tokens[row], parents[row], wave[key][1][done[key]:]))
            start = time.perf_counter()
            index.extend_many(keys, runs)
            extend_seconds += time.perf_counter() - start
            for key, run in zip(keys, runs, strict=True):
                committed += len(run)
                done[key] += len(run)
                if done[key] >= len(wave[key][1]):
                    index.finish(key)
                    del done[key]
    us = np.array(call_us)
    return {"requests": len(work), "proposals": proposals,
            "propose_us_per_request": float(us.sum() / proposals),
            "call_us_p50": float(np.percentile(us, 50)),
            "call_us_p99": float(np.percentile(us, 99)),
            "extend_us_per_token": extend_seconds * 1e6 / max(committed, 1),
            "tokens_per_proposal": committed / proposals, "digest": digest.hexdigest()[:16]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(f"{result['requests']} requests, {result['proposals']} proposals "
          f"({args.nodes} nodes, depth {args.depth}, batch {args.batch}): propose "
          f"{result['propose_us_per_request']:.1f} us a request (a round's call: "
          f"{result['call_us_p50']:.1f} us median, {result['call_us_p99']:.1f} p99); extend "
          f"{result['extend_us_per_token']:.2f} us a token; {result['tokens_per_proposal']:.2f} "
          f"tokens committed a proposal; digest {result['digest']}")
    return result


if __name__ == "__main__":
    main()
