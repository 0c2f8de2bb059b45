"""What a round is judged by: the batch's tokens a second, or how soon its last request ends.

The policy scores a shape by the tokens a round of it commits a second over the whole batch
(shape_policy.py). That is what a server gains where the slot a request frees by finishing early
takes another request at once: a queue, or clients that send their next request as one
ends. Where nobody takes it (an offline batch run to its end, a server between bursts), the
batch is done only when its last request is, and a drafted round that speeds up the requests
the draft predicts well, while a request it does not predict gains one token at a drafted
round's price, ends the batch later. So the policy watches whether freed slots are taken
(Refills) and, where they are not, scores a shape X by how much of the batch's remaining
work one round of it does. With r_i the tokens request i may still generate (its
max_new_tokens or the context, whichever ends first) and L_i(X) its expected tokens in a
round of X, the batch needs about max_i r_i / L_i(X) more rounds of X, so a round does

    progress(X) = 1 / max_i (r_i / L_i(X))

of it, and progress(X) / T(X, b) replaces the tokens a second. A request's end by a stop
token cannot be foreseen, so r_i is an upper bound, and the rule is a cautious one: a round
drafts only where it speeds up the request expected to end last. For one request the two
scores pick the same shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from sgl_jax.speculative.spec_config import TreeShape

# A freed slot counts as not taken once it has stayed free this many rounds and seconds: a
# client that sends its next request as one ends takes well under both.
REFILL_ROUNDS, REFILL_SECONDS = 8, 0.1


class Refills:
    """Whether the slots that finished requests free, while others still run, are taken by
    new requests within REFILL_ROUNDS rounds and REFILL_SECONDS. The batch runs to its end
    while one freed since the last admission is left free (it drains: its clients stopped
    sending), and from its first round where the busy period before it (from an idle
    scheduler to the next) drained without taking any, as each batch of an offline run does:
    a server's clients take the slots their requests free, and only their last ones drain."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.draining = False  # a slot freed since the last admission went untaken
        self.took = False  # a freed slot was taken in this busy period
        self.took_before = True  # ... in the one before (a new server: as a server's would)
        self.rounds = 0
        self.free: list[tuple[int, float]] = []  # (round, time) of each free slot, oldest first
        self.counts = {"taken": 0, "untaken": 0}  # freed slots settled, for /get_server_info
        self.clock = clock

    @property
    def batch_runs_to_its_end(self) -> bool:
        """Whether to judge rounds by the batch's end (the class's rule)."""
        return self.draining or not (self.took or self.took_before)

    def freed(self, batch_left: bool) -> None:
        """A request finished. `batch_left`: others are running or waiting; without any, the
        busy period is over, and the slots freed in it and still free went untaken."""
        if batch_left:
            self.free.append((self.rounds, self.clock()))
            return
        self._settle(len(self.free), taken=False)
        self.took_before, self.took, self.draining = self.took, False, False

    def joined(self) -> None:
        """A request is being admitted: it takes the oldest free slot, if any. (A request
        readmitted after retraction, or asking again while pages are short, counts too:
        either way the queue that fills freed slots is there.)"""
        self.draining = False
        if self.free:
            self._settle(1, taken=True)
            self.took = True

    def count_round(self) -> None:
        self.rounds += 1
        now = self.clock()
        expired = sum(self.rounds - start >= REFILL_ROUNDS and now - at >= REFILL_SECONDS
                      for start, at in self.free)
        self._settle(expired, taken=False)
        self.draining = self.draining or expired > 0

    def _settle(self, count: int, taken: bool) -> None:
        del self.free[:count]
        self.counts["taken" if taken else "untaken"] += count


def batch_end_progress(row_tokens: Mapping[TreeShape, np.ndarray], remaining: Sequence[int]
                       ) -> dict[TreeShape, float]:
    """Per shape, the share of the batch's remaining rounds one round of it does (the
    module's progress), from each request's expected tokens in a round, f64[R] by shape,
    and the tokens each may still generate (R of them)."""
    left = np.maximum(np.asarray(remaining, np.float64), 1.0)
    return {shape: float(1.0 / np.max(left / tokens)) for shape, tokens in row_tokens.items()}
