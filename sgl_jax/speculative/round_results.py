"""Reading a round's results on the host: each request's accepted run appended up to where
it finishes, and what the round tried."""

from __future__ import annotations

import numpy as np

from sgl_jax.model_executor.model_runner import StepOutput
from sgl_jax.scheduler.req import Req
from sgl_jax.speculative.round import RoundOutput


def tree_depths(parents: np.ndarray | None, rows: int) -> list[int]:
    """Per row of a round's trees (parents i32[rows, N]; None: no trees), the deepest draft
    node it verified: the draft positions the round tried (0 where a row had no draft)."""
    if parents is None:
        return [0] * rows
    depths = np.zeros(parents.shape, np.int32)
    for node in range(1, parents.shape[1]):
        parent = parents[:, node]
        depths[:, node] = np.where(parent >= 0, depths[np.arange(len(parent)),
                                                        np.maximum(parent, 0)] + 1, 0)
    return depths.max(axis=1).tolist()


def max_depth(req: Req, num_steps: int) -> int:
    """The deepest draft node the request's rounds verify: the flags' depth unless it asked
    for less (or for no speculation: 0)."""
    cap = req.params.max_draft_depth
    return num_steps if cap is None else min(cap, num_steps)


def as_round(output: RoundOutput | StepOutput) -> RoundOutput:
    """A decode step's results (a round where no request has a draft) as a plain round's."""
    if isinstance(output, RoundOutput):
        return output
    n = len(output.tokens)

    def one_token(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else array[:, None]

    return RoundOutput(
        tokens=one_token(output.tokens), num_accepted=np.zeros(n, np.int32),
        logprobs=one_token(output.logprobs), top_logprob_ids=one_token(output.top_logprob_ids),
        top_logprobs=one_token(output.top_logprobs), tree_tokens=None, tree_parents=None)


def emit_run(req: Req, output: RoundOutput, row: int, count: int) -> tuple[str, list[int]]:
    """Append a round's tokens one by one, stopping where the request finishes (EOS, a stop
    string, max_new_tokens or the context) so nothing past it is emitted."""
    text, tokens = "", []
    for j in range(count):
        token = int(output.tokens[row, j])
        top = []
        if req.top_logprobs_num:
            ids, values = output.top_logprob_ids[row, j], output.top_logprobs[row, j]
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        logprob = 0.0 if output.logprobs is None else float(output.logprobs[row, j])
        text += req.append_token(token, logprob, top)
        tokens.append(token)
        if req.finished:
            break
    return text, tokens
