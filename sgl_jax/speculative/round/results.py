"""Reading a round's results on the host: each request's accepted run appended up to where
it finishes, and what the round tried."""

from __future__ import annotations

import numpy as np

from sgl_jax.grammar import allow_eos_at_dead_ends, fill_tree_bitmasks
from sgl_jax.model_executor.model_runner import bitmask_words
from sgl_jax.scheduler.req import Req
from sgl_jax.speculative.round.output import NODE_ACCEPTED, NODE_UNTRIED, RoundOutput
from sgl_jax.speculative.round.program import RoundRows


def verified_depths(output: RoundOutput, steps: int) -> list[int]:
    """The deepest draft node each row of a round verified: in a packed round the deepest of
    those its program chose, in any other the shape's depth `steps`."""
    if output.deepest_verified is None:
        return [steps] * len(output.num_accepted)
    return output.deepest_verified.tolist()


def node_outcomes(output: RoundOutput, rows: list[int]) -> tuple[np.ndarray, ...]:
    """For acceptance.Calibration: `rows`' draft scores f32[R, N], parents and node depths
    i32[R, N] each, and which nodes verification tried (verified, with their parent on the
    accepted path) and accepted (on it), bool[R, N] each (a packed round's: among the nodes
    it verified)."""
    # every row (the usual case): views of the round's results, not copies
    pick = slice(None) if len(rows) == len(output.num_accepted) else rows
    outcomes = output.outcomes[pick]
    return (output.tree_scores[pick], output.tree_parents[pick], output.node_depths[pick],
            outcomes != NODE_UNTRIED, outcomes == NODE_ACCEPTED)


def max_depth(req: Req, num_steps: int) -> int:
    """The deepest draft node the request's rounds verify: the flags' depth unless it asked
    for less (or for no speculation: 0)."""
    cap = req.params.max_draft_depth
    return num_steps if cap is None else min(cap, num_steps)


def emit_run(req: Req, output: RoundOutput, row: int, count: int) -> list[int]:
    """Append a round's `count` tokens up to where the request finishes (EOS, a stop id,
    max_new_tokens or the context), so nothing past it is emitted; returns those taken."""
    run = output.tokens[row, :count].tolist()
    logprobs = None if output.logprobs is None else output.logprobs[row, :count].tolist()
    tops = None
    if req.top_logprobs_num:
        tops = [list(zip(ids, values, strict=True)) for ids, values in zip(
            output.top_logprob_ids[row, :count].tolist(),
            output.top_logprobs[row, :count].tolist(), strict=True)]
    return run[: req.append_tokens(run, logprobs, tops)]


def tree_masks(reqs: list[Req], tokens: np.ndarray, parents: np.ndarray, vocab_size: int
               ) -> np.ndarray:
    """i32[B, N, W] over a masked round's padded batch (tokens, parents i32[B, N]): every id
    for free rows; for a constrained row the ids its grammar allows after each node's path
    (EOS alone at a dead end)."""
    masks = np.full((*tokens.shape, bitmask_words(vocab_size)), -1, np.int32)
    for row, req in enumerate(reqs):
        if req.grammar is not None:
            fill_tree_bitmasks(req.grammar, tokens[row], parents[row], masks[row])
            allow_eos_at_dead_ends(masks[row], req.eos_ids)
    return masks


def round_rows(reqs: list[Req], padded: int, hints, page_rows: np.ndarray, pages_per_seq: int,
               num_steps: int) -> RoundRows:
    """A round's row arrays over batch bucket `padded` (page_rows i32[n, P'] of the n
    requests): -1 where only the device knows the value yet."""
    n = len(reqs)

    def column(values, fill: int = 0) -> np.ndarray:
        array = np.full(padded, fill, np.int32)
        array[:n] = np.fromiter(values, np.int32, n)
        return array

    page_table = np.zeros((padded, pages_per_seq), np.int32)
    page_table[:n] = page_rows
    return RoundRows(
        slots=column((r.slot for r in reqs), fill=-1),
        page_table=page_table,
        kv_lens=column(-1 if r.inflight_extra else r.kv_len for r in reqs),
        root_tokens=column(-1 if r.num_inflight else r.last_token for r in reqs),
        min_new_tokens=column(r.params.min_new_tokens for r in reqs),
        state_slots=column(r.state_slot for r in reqs),
        max_depths=column(max_depth(r, num_steps) for r in reqs),
        hints=hints)
