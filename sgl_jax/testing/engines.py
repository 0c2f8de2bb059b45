"""Scenarios that tests run against any Engine."""

from __future__ import annotations

import time
from typing import Any


def walk_away_mid_run(engine: Any, prompts: list[list[int]], *, timeout_s: float = 10) -> None:
    """Stream three long greedy requests; after each one's first chunk, close the second while
    the others run, serve another request of five tokens meanwhile (checked), close the rest,
    and wait until no request runs."""
    params = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    streams = [engine.generate(input_ids=p, sampling_params=params, stream=True)
               for p in prompts[:3]]
    for stream in streams:
        next(stream)
    streams[1].close()  # walks away while the others run
    rest = engine.generate(input_ids=prompts[2], sampling_params={**params,
                                                                  "max_new_tokens": 5})
    assert len(rest["output_ids"]) == 5
    for stream in (streams[0], streams[2]):
        stream.close()
    deadline = time.time() + timeout_s
    while engine.get_server_info()["num_running_reqs"] and time.time() < deadline:
        time.sleep(0.05)


def printable_stop(text: str) -> str:
    """Three printable characters from the second half of text, first seen there."""
    for start in range(len(text) // 2, len(text) - 3):
        stop = text[start: start + 3]
        if stop.isprintable() and "\ufffd" not in stop and text.index(stop) == start:
            return stop
    raise AssertionError(f"no printable stop string in {text!r}")


def every_stop_rule(ids: list[int], stop: str) -> list[dict[str, Any]]:
    """Greedy sampling parameters for six requests, each ending by another rule: a stop token
    (ids: a greedy output of the first prompt), max_new_tokens, a stop token held back by
    min_new_tokens, EOS if it comes, one token, and the stop string `stop`."""
    def greedy(n: int, **extra: Any) -> dict[str, Any]:
        return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}

    return [greedy(24, stop_token_ids=[ids[5]]), greedy(9),
            greedy(20, stop_token_ids=[ids[0]], min_new_tokens=4),
            {"temperature": 0, "max_new_tokens": 30}, greedy(1), greedy(20, stop=[stop])]


def believe_round_costs(engine: Any, costs_ms: dict[str, float]) -> None:
    """The engine's adaptive policy believes a round of each shape costs costs_ms[its name]
    ("plain", "3/1/4", "3/1/4:2") whatever it measures, shapes it times while serving
    included: tests pick the shapes a round takes through the costs."""
    from sgl_jax.speculative.policy.shape_policy import shape_name

    policy = engine.runtime.scheduler.decoding.policy

    def believed(table: dict) -> dict:
        return {key: costs_ms[shape_name(key[0])] / 1000 for key in table}

    add = policy.add_round_seconds
    policy.seconds = lambda shape, bucket: costs_ms[shape_name(shape)] / 1000
    policy.add_round_seconds = lambda table, **kw: add(believed(table), **kw)
    policy.round_seconds = believed(policy.round_seconds)
