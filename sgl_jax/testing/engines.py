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
