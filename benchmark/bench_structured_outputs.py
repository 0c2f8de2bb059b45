"""The throughput cost of a JSON schema: the same chat prompts with and without a schema, plain
and with speculative decoding, offline (Engine API).

For each engine (plain, or with the draft) and batch size: output tokens per second of free
answers and of schema-constrained answers, their ratio, and whether every constrained answer
validated; with speculation also the accept length of the free and of the constrained
rounds, whose trees the grammar masks node by node (docs/server.md). Grammars compile before
the timed run (a compiled grammar is cached), so the figures are the per-step cost: the host
computing each row's token bitmask (each tree node's, with speculation), and the mask on the
device. The prefix cache is emptied after each warm-up, so both runs prefill every prompt.

    python benchmark/bench_structured_outputs.py                      # the demo pair
    python benchmark/bench_structured_outputs.py --batch-sizes 1,16 --num-prompts 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUBJECTS = ["a cat", "a city", "a car", "a book", "a planet", "a river", "a chef", "a song",
            "a bridge", "a tree", "a storm", "a robot", "a garden", "a ship", "a mountain",
            "a museum"]
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "summary", "tags", "rating"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "summary": {"type": "string", "maxLength": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                  "minItems": 1, "maxItems": 4},
                         "rating": {"type": "integer", "minimum": 1, "maximum": 5}}}


@dataclass
class Row:
    engine: str
    batch_size: int
    free_tok_s: float
    schema_tok_s: float
    ratio: float
    valid: int  # constrained answers that parse and validate
    num_prompts: int
    free_accept_length: float | None = None  # tokens per speculative round; None: plain
    schema_accept_length: float | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="target; default: the demo model")
    p.add_argument("--draft-model-path", default=None,
                   help="EAGLE3 head; default: the demo head (with the demo model)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--engines", default="plain,eagle3")
    p.add_argument("--output-json")
    return p.parse_args(argv)


def prompts(engine: Any, count: int) -> list[list[int]]:
    from sgl_jax.tokenizer.chat_template import ChatTemplate

    template = ChatTemplate(engine.tokenizer)
    return [template.encode([{"role": "user", "content": f"Describe {SUBJECTS[i % 16]} as "
                                                         "JSON with a name, a summary, tags "
                                                         "and a rating."}])
            for i in range(count)]


def timed(engine: Any, ids: list[list[int]], params: dict, batch: int
          ) -> tuple[float, list, float | None]:
    """Output tokens/s over every prompt, the outputs, and the accept length (None without
    speculation)."""
    engine.generate(input_ids=ids[:batch], sampling_params={**params, "max_new_tokens": 4})
    if not engine.flush_cache():
        raise RuntimeError("the prefix cache could not be emptied after the warm-up")
    before = engine.get_server_info()
    outputs, start = [], time.perf_counter()
    for first in range(0, len(ids), batch):
        outputs += engine.generate(input_ids=ids[first: first + batch], sampling_params=params)
    elapsed = time.perf_counter() - start
    return (sum(len(o["output_ids"]) for o in outputs) / elapsed, outputs,
            accept_length_since(engine, before))


def accept_length_since(engine: Any, before: dict) -> float | None:
    after = engine.get_server_info()
    if "spec_verify_rounds" not in after:
        return None
    rounds = after["spec_verify_rounds"] - before["spec_verify_rounds"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return 1 + accepted / max(rounds, 1)


def valid_count(outputs: list[dict]) -> int:
    import jsonschema

    count = 0
    for out in outputs:
        try:
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
            count += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return count


def run(args: argparse.Namespace) -> list[Row]:
    from sgl_jax import Engine

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    free = {"temperature": 0, "max_new_tokens": args.output_len}
    constrained = {**free, "json_schema": json.dumps(SCHEMA)}
    rows = []
    for name in args.engines.split(","):
        spec = {} if name == "plain" else {
            "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
            "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8,
            "speculative_draft_model_path": args.draft_model_path}
        # Every prompt pads to the same buckets, which the untimed first batch compiles; the
        # speculative engine takes the flags' tree (the adaptive policy needs the warm-up).
        with Engine(model_path=args.model_path, max_running_requests=max(batch_sizes),
                    precompile_bs_paddings=batch_sizes, skip_server_warmup=True,
                    **spec) as engine:
            ids = prompts(engine, args.num_prompts)
            for batch in batch_sizes:
                free_tok_s, _, free_length = timed(engine, ids, free, batch)
                schema_tok_s, outputs, schema_length = timed(engine, ids, constrained, batch)
                rows.append(Row(name, batch, free_tok_s, schema_tok_s,
                                schema_tok_s / free_tok_s, valid_count(outputs), len(ids),
                                free_length, schema_length))
                print_row(rows[-1])
    return rows


def print_row(row: Row) -> None:
    lengths = "" if row.free_accept_length is None else (
        f"   accept len free {row.free_accept_length:.2f}, schema {row.schema_accept_length:.2f}")
    print(f"{row.engine:7} {row.batch_size:>3} {row.free_tok_s:>10.1f} {row.schema_tok_s:>12.1f}"
          f" {row.ratio:>6.2f}x {row.valid:>4}/{row.num_prompts}{lengths}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"{'engine':7} {'bs':>3} {'free tok/s':>10} {'schema tok/s':>12} {'ratio':>7} valid")
    rows = run(args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
