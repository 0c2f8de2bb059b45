"""The adaptive speculation policy: before each round, the draft shape (or none) that commits
the most tokens per second for the batch at hand.

For a batch of requests r in padded batch bucket b, each candidate shape X is scored

    rate(X) = sum_r L_r(X) / T(X, b)

where T(X, b) is the seconds one round of X takes at bucket b, and L_r(X) the tokens request r
is expected to commit in it: 1 for plain decoding, else

    L_r(X) = 1 + sum_{d=1..depth(X)} prod_{j<=d} q_r(family(X), j)

with q_r(f, j) request r's acceptance at draft depth j given depth j-1 was accepted, for the
family f of X (a chain, or a tree of topk > 1, whose rates are higher). The round takes the
argmax, except that a speculative shape must beat plain decoding by SPECULATION_MARGIN: its
estimates carry errors of a few percent, and a near tie gains nothing on average while
speculation's costs outside the round (longer emits, a draft to keep) are not in T. Where the
estimates come from:

- q_r: decayed counts of accepted / tried depths over the request's own speculative rounds,
  shrunk towards the server-wide counts (which the same rounds update, more slowly), so a new
  request starts from what the server has seen and a request the draft cannot predict soon
  stops paying for drafts. A family the request has not run yet starts from the server's
  rates scaled by how the request did against the server in the other family. The server's
  estimate of a depth no round has tried yet is that of the depth above it (INITIAL_RATE for
  the first): conditional acceptance changes slowly with depth (a head's rates fall a little,
  text copied from a prompt is accepted as long as the copy runs), so a draft accepted nine
  times in ten at depth 1 gets a deeper chain tried, where a fixed prior for deeper depths
  would keep the policy on the shallow chain that never measures them.
- T: the runner's warm-up timing of every (shape, bucket) program (`_timing`), times two
  factors learnt from the rounds served: the bucket's load (how much slower than at warm-up
  every shape runs now: machine load, longer contexts) and a speculative shape's own
  correction (a warm-up timing that misjudged it against plain's). Each round moves both by
  its log residual log(measured / believed), clipped to MAX_RESIDUAL, the load faster
  (LOAD_RATE) than the shape (SHAPE_RATE); a plain round moves the load alone, plain being
  what the corrections are relative to. So a burst of slow rounds, which slows every shape
  alike, mostly moves the load and leaves the comparison between shapes alone; a long run of
  plain rounds cannot make plain look cheaper than its warm-up timing against the shapes it
  leaves unmeasured; and a single outlier round (a first run, a pause of the host) moves a
  shape's correction by a few percent, while a shape whose rounds stay dearer than its
  warm-up timing against the rounds of other shapes around them (probes included)
  accumulates its correction over tens of rounds. Without the clip one outlier could price a
  shape out for good: a shape never chosen is never measured again.

The batch's end: where slots that requests free by finishing stay free (an offline batch run
to its end), speeding up some requests does not end the batch sooner; there each shape is
scored by how much of the batch's remaining work a round does, which the request expected
to end last decides (policy/refills.py), in place of sum_r L_r(X).

Probes: plain rounds measure no acceptance, and a policy that keeps speculating never times
plain rounds. So after a run of rounds on one side (plain, or speculating) the policy runs one
round on the other (the best speculative shape, or plain), and doubles the run before the next
probe (up to MAX_PROBE_INTERVAL) while the same side keeps winning. A speculative probe waits
while no shape could win even if every drafted row accepted every depth (at the shapes'
warm-up timings).

Admission: a draft costs before any round, in its pass over the prompt. So a new request gets
a draft only where a round of typical requests (the server-wide rates) at the batch bucket it
joins would speculate: some shape X with b * L(X) / T(X, b) > SPECULATION_MARGIN * b / T(plain,
b). Without one its rows commit one token per round (L_r = 1 for every shape) whatever shape
the round takes. One refused request in EXPLORE_EVERY gets a draft anyway, so that the
server-wide rates do not stay where speculation last stopped paying, but only where it could
be measured: where the batch it joins, with its drafted requests and this one, could beat
plain if every drafted row accepted every depth (the probe rule). Elsewhere a lone draft
would never see a speculative round, and its pass over the prompt would be pure cost.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sgl_jax.speculative.policy.acceptance import (
    Acceptance,
    Calibration,
    batch_rates,
    record_each,
)
from sgl_jax.speculative.policy.refills import Refills, batch_end_progress
from sgl_jax.speculative.policy.report import Choice, policy_info, shape_name
from sgl_jax.speculative.policy.request_lengths import (
    draft_counts,
    node_survival,
    packed_budget,
    round_tokens,
    row_tokens,
)
from sgl_jax.speculative.spec_config import TreeShape

PLAIN = TreeShape(num_steps=0, topk=1, num_draft_tokens=1)  # the root alone: one token
REQUEST_DECAY = 0.9  # a request's counts fade over about ten rounds
SERVER_DECAY = 0.995  # the server's over a few hundred request-rounds
# Shares of a round's log cost residual taken by its bucket's load and by its shape's factor.
LOAD_RATE, SHAPE_RATE = 0.5, 0.2
MAX_RESIDUAL = math.log(1.5)  # the most one round's log cost residual counts for
MIN_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 4, 256  # rounds on one side between probes
SPECULATION_MARGIN = 1.10  # a speculative shape's rate must exceed plain's by this factor
EXPLORE_EVERY = 32  # of the requests the rule refuses a draft, one in this many gets one


def candidate_shapes(ceiling: TreeShape) -> tuple[TreeShape, ...]:
    """What an adaptive round may take under the flags' shape: plain decoding, a one-step
    chain, a chain as deep as the flags, and the flags' shape itself."""
    chain = TreeShape(ceiling.num_steps, 1, ceiling.num_steps + 1)
    return tuple(dict.fromkeys([PLAIN, TreeShape(1, 1, 2), chain, ceiling]))


def beating_plain(tokens: Mapping[TreeShape, float], seconds: Mapping[TreeShape, float]
                  ) -> list[TreeShape]:
    """The speculative shapes whose tokens per second beat plain's (both mappings hold
    PLAIN) by SPECULATION_MARGIN."""
    plain = tokens[PLAIN] / seconds[PLAIN]
    return [s for s in tokens
            if s != PLAIN and tokens[s] / seconds[s] > SPECULATION_MARGIN * plain]


@dataclass(frozen=True)
class _Judged:
    """A round's candidate shapes as choose weighs them."""

    lengths: dict[TreeShape, float]  # expected tokens over the batch
    seconds: dict[TreeShape, float]  # believed cost of a round
    rates: dict[TreeShape, float]  # what is maximised: tokens (or batch-end progress) a second
    winners: list[TreeShape]  # the speculative shapes that beat plain (beating_plain)
    by_end: bool  # judged by the batch's end (policy/refills.py)


class SpeculationPolicy:
    """Picks each round's shape among `shapes` (adaptive), or always the flags' shape."""

    def __init__(self, shapes: Sequence[TreeShape], ceiling: TreeShape,
                 round_seconds: Mapping[tuple[TreeShape, int], float], adaptive: bool):
        self.adaptive = adaptive and len(shapes) > 1 and bool(round_seconds)
        self.shapes = tuple(shapes) if self.adaptive else (ceiling,)
        self.ceiling = ceiling
        self.depth = max(s.num_steps for s in shapes)
        self.round_seconds = dict(round_seconds)
        menu = tuple(dict.fromkeys((PLAIN, *self.shapes)))
        self._includers = {shape: [s for s in menu if s.includes(shape)] for shape in menu}
        self.load: dict[int, float] = {}  # bucket -> slowdown against warm-up, every shape
        self.correction: dict[tuple[TreeShape, int], float] = {}  # a shape's own, beyond load
        self.provisional: set[tuple[TreeShape, int]] = set()  # see add_round_seconds
        self.server = Acceptance(self.depth, SERVER_DECAY)
        self.calibration = Calibration(self.depth, SERVER_DECAY)  # the drafter's own scores
        # Plain rounds are counted whatever the menu: grammar-constrained batches take them.
        self.rounds_by_shape = {shape_name(s): 0 for s in dict.fromkeys((PLAIN, *self.shapes))}
        self.masked_rounds = 0  # rounds whose trees a grammar masked
        self.probe_interval = MIN_PROBE_INTERVAL
        self.streak = 0  # rounds in a row whose best shape was on the same side
        self.streak_plain = True  # that side: plain, or speculating
        self.finished_requests = {"with_draft": 0, "without_draft": 0}
        self.refills = Refills()  # whether freed slots are taken: see policy/refills.py
        self.last: Choice | None = None
        self._row_tokens: tuple | None = None  # expected_row_tokens' last (key, records, answer)

    def add_round_seconds(self, round_seconds: Mapping[tuple[TreeShape, int], float], *,
                          provisional: bool = False) -> None:
        """Timings of buckets compiled after start-up. A key already known keeps its timing
        unless that one was provisional (taken while a background build shared the CPU):
        the new one replaces it, and what was learnt against it (the bucket's load, the
        shape's correction) starts again."""
        for key, seconds in round_seconds.items():
            if key in self.round_seconds and key not in self.provisional:
                continue
            if key in self.provisional:
                self.provisional.discard(key)
                self.correction.pop(key, None)
                self.load.pop(key[1], None)
            self.round_seconds[key] = seconds
            if provisional:
                self.provisional.add(key)

    def new_request(self) -> Acceptance:
        """A new request's acceptance record (request_state.DraftState.acceptance)."""
        return Acceptance(self.depth, REQUEST_DECAY)

    def admits_draft(self, bucket: int, rid: str, drafted_peers: int = 0) -> bool:
        """Whether request `rid` joining a batch of padded size `bucket`, `drafted_peers` of
        whose requests have a draft, gets one (its prefill runs the draft too): where a batch
        of typical requests would speculate; else for one request in EXPLORE_EVERY (picked
        by its id, so asking again gives the same answer) where the batch could then
        speculate at all. Always, without an adaptive policy."""
        if not self.adaptive or self._typical_batch_speculates(bucket):
            return True
        return (zlib.crc32(rid.encode()) % EXPLORE_EVERY == 0 and bool(self._could_win(
            bucket, drafted_peers + 1, self._timed(self.shapes, bucket), bucket)))

    def pays_alone(self, record: Acceptance) -> bool:
        """Whether a request with this record, alone in the smallest batch bucket timed,
        would take a speculative round (always, without an adaptive policy): a draft that
        could not pay even there is not worth keeping up to date through plain rounds."""
        if not self.adaptive:
            return True
        bucket = min(b for _, b in self.round_seconds)
        shapes = self._timed(self.shapes, bucket)
        survival = self._survival([record])
        tokens = {s: float(row_tokens(s, survival, bucket, 1)[0]) if s != PLAIN else 1.0
                  for s in shapes}
        return bool(beating_plain(tokens, {s: self.seconds(s, bucket) for s in shapes}))

    def count_finished(self, drafted: bool, batch_left: bool = True, *,
                       held_slot: bool = True) -> None:
        """A request finished; where it `held_slot` in the running batch, that slot is free
        (Refills.freed; `batch_left`: others are running or waiting)."""
        self.finished_requests["with_draft" if drafted else "without_draft"] += 1
        if held_slot:
            self.refills.freed(batch_left)

    def _typical_batch_speculates(self, bucket: int) -> bool:
        typical = {kind: np.tile(np.cumprod(self.server.rates(kind, None)), (bucket, 1))
                   for kind in ("chain", "tree")}
        shapes = self._timed(self.shapes, bucket)
        return bool(beating_plain(round_tokens(shapes, typical, bucket, bucket),
                                  {s: self.seconds(s, bucket) for s in shapes}))

    def _timed(self, shapes: Sequence[TreeShape], bucket: int) -> tuple[TreeShape, ...]:
        """Those of `shapes` timed in `bucket`: a shape whose program a CPU server is still
        building in the background has no timing yet, and is not taken until it has."""
        return tuple(s for s in shapes if (s, bucket) in self.round_seconds)

    def seconds(self, shape: TreeShape, bucket: int) -> float:
        return (self._timing(shape, bucket) * self.load.get(bucket, 1.0)
                * self.correction.get((shape, bucket), 1.0))

    def _timing(self, shape: TreeShape, bucket: int) -> float:
        """Its timing, capped by those of shapes whose rounds do all its work (includes): one
        slow timing would otherwise price a shape out for good (it is never timed again)."""
        return min(self.round_seconds[s, bucket] for s in self._includers.get(shape, [shape])
                   if (s, bucket) in self.round_seconds)

    def choose(self, requests: Sequence[Acceptance | None], bucket: int, *,
               menu: Sequence[TreeShape] | None = None,
               remaining: Sequence[int] | None = None,
               offered: Callable[[], Sequence[bool]] | None = None) -> TreeShape:
        """The shape of the next round for requests' records (None: a request without a
        draft), among `menu` when given (plain always allowed): a batch holding a
        grammar-constrained request may take only plain rounds and the flags' shape, whose
        trees the host masks. Only shapes timed in `bucket` are taken (_timed). With
        `remaining` (the tokens each request may still generate), a round is judged by the
        batch's end while freed slots stay free (policy/refills.py), else by its tokens a second.

        `offered`, for a drafter that proposes on the host: which requests have a draft to
        offer this round (the others count as without one). It is asked only where the round
        could draft were every record's draft offered (`_may_draft`): a proposal costs host
        time, and fewer drafts only make speculating worse, so a round that would stay plain
        with all of them stays plain without asking."""
        shapes = self.shapes if menu is None else tuple(
            s for s in self.shapes if s in menu or s == PLAIN)
        if not self.adaptive:
            return shapes[0] if shapes else PLAIN
        self.refills.count_round()
        shapes = self._timed(shapes, bucket)
        if set(shapes) <= {PLAIN} or all(r is None for r in requests):
            return PLAIN  # nothing to measure either: no row has a draft
        judged = self._judge(requests, bucket, shapes, remaining)
        if offered is not None and self._may_draft(judged, requests, shapes, bucket):
            requests = [r if has else None for r, has in zip(requests, offered(), strict=True)]
            if all(r is None for r in requests):
                return PLAIN
            judged = self._judge(requests, bucket, shapes, remaining)
        best = max(judged.winners, key=judged.rates.__getitem__) if judged.winners else PLAIN
        drafted = sum(r is not None for r in requests)
        probe = self._probe(best, judged.rates,
                            self._could_win(len(requests), drafted, shapes, bucket))
        chosen = best if probe is None else probe
        self.last = Choice(chosen, bucket, probe is not None, judged, max(len(requests), 1))
        return chosen

    def _judge(self, requests: Sequence[Acceptance | None], bucket: int,
               shapes: Sequence[TreeShape], remaining: Sequence[int] | None) -> _Judged:
        per_row = self.expected_row_tokens(requests, bucket)
        lengths = {s: float(per_row[s].sum()) for s in shapes}
        seconds = {s: self.seconds(s, bucket) for s in shapes}
        by_end = remaining is not None and self.refills.batch_runs_to_its_end
        judged = (batch_end_progress({s: per_row[s] for s in shapes}, remaining) if by_end
                  else lengths)
        return _Judged(lengths, seconds, {s: judged[s] / seconds[s] for s in shapes},
                       beating_plain(judged, seconds), by_end)

    def _may_draft(self, judged: _Judged, requests: Sequence[Acceptance | None],
                   shapes: Sequence[TreeShape], bucket: int) -> bool:
        """Whether a round judged so could take a speculative shape: one beats plain, or a
        speculative probe is due (see _probe) and could win."""
        if judged.winners:
            return True
        probe_due = self.streak_plain and self.streak + 1 >= self.probe_interval
        drafted = sum(r is not None for r in requests)
        return probe_due and bool(self._could_win(len(requests), drafted, shapes, bucket))

    def _could_win(self, rows: int, drafted: int, shapes: Sequence[TreeShape], bucket: int
                   ) -> list[TreeShape]:
        """The speculative shapes that would beat plain for `rows` requests if every one of
        the `drafted` with a draft accepted every depth, at the shapes' warm-up timings (a
        learnt correction is what a probe may refute)."""
        most = {s: rows + drafted * s.num_steps for s in shapes}
        return beating_plain({s: min(most[s], s.verify_width * bucket) if s.verify_width
                              else most[s] for s in shapes},
                             {s: self._timing(s, bucket) for s in shapes})

    def _probe(self, best: TreeShape, rates: dict[TreeShape, float],
               could_win: Sequence[TreeShape]) -> TreeShape | None:
        """The other side's shape when this round should probe it, else None. A speculative
        probe takes one of `could_win` (see _could_win); without one, no acceptance could
        change the choice (a batch mostly of requests without a draft), and it waits."""
        plain = best == PLAIN
        if plain != self.streak_plain:
            self.streak, self.streak_plain, self.probe_interval = 0, plain, MIN_PROBE_INTERVAL
        self.streak += 1
        if self.streak < self.probe_interval or (plain and not could_win):
            return None
        self.streak = 0
        self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        if not plain:
            return PLAIN
        return max(could_win, key=rates.__getitem__)

    def expected_tokens(self, requests: Sequence[Acceptance | None], bucket: int
                        ) -> dict[TreeShape, float]:
        """Per shape, the tokens a round in batch bucket `bucket` is expected to commit over
        the whole batch (one per request without a draft, None)."""
        return {s: float(t.sum()) for s, t in self.expected_row_tokens(requests, bucket).items()}

    def expected_row_tokens(self, requests: Sequence[Acceptance | None], bucket: int
                            ) -> dict[TreeShape, np.ndarray]:
        """Per shape, f64[R]: the tokens a round in batch bucket `bucket` is expected to
        commit for each request (one for a request without a draft, None); read-only. The
        last answer is kept while no record changes: plain rounds record nothing, and a
        batch keeps its requests for many rounds."""
        key = (bucket, self.server.version,
               tuple(None if r is None else (id(r), r.version) for r in requests))
        if self._row_tokens is not None and self._row_tokens[0] == key:
            return self._row_tokens[2]
        drafted = [i for i, r in enumerate(requests) if r is not None]
        survival = self._survival([requests[i] for i in drafted]) if drafted else None
        tokens = {}
        for shape in self.shapes:
            tokens[shape] = np.ones(len(requests))
            if drafted:
                tokens[shape][drafted] = row_tokens(shape, survival, bucket, len(requests))
        # The records are held with the key, so no other record can take one of their ids.
        self._row_tokens = (key, list(requests), tokens)
        return tokens

    def _survival(self, drafted: Sequence[Acceptance]) -> dict[str, np.ndarray]:
        """f64[R, D] by family (trees only where a shape is one): each request's chance of
        acceptance down to each depth."""
        kinds = ("chain", "tree") if any(s.topk > 1 for s in self.shapes) else ("chain",)
        return {kind: np.cumprod(batch_rates(drafted, kind, self.server), axis=1)
                for kind in kinds}

    def verify_counts(self, requests: Sequence[Acceptance | None], shape: TreeShape,
                      bucket: int) -> np.ndarray:
        """i32[R]: the draft nodes each request verifies in a packed round of `shape` (none
        for a request without a draft); see policy/request_lengths.py."""
        counts = np.zeros(len(requests), np.int32)
        drafted = [i for i, r in enumerate(requests) if r is not None]
        if drafted:
            survival = self._survival([requests[i] for i in drafted])
            counts[drafted] = draft_counts(node_survival(shape, survival),
                                           packed_budget(shape, bucket, len(requests)))
        return counts

    def observe(self, shape: TreeShape, bucket: int, seconds: float,
                outcomes: Sequence[tuple[Acceptance | None, int, int]], *,
                masked: bool = False, timed: bool = True) -> None:
        """A round of `shape` took `seconds`; each request's record, its accepted count and
        the depth it verified (the shape's, or its own in a packed round); a request without
        a draft (None) measures nothing. `masked`: a grammar masked its trees (counted
        apart, and its cost not learnt: the host's masks make it dearer than the same shape
        free). Not `timed`: its seconds include compiling (not learnt)."""
        self.rounds_by_shape[shape_name(shape)] += 1
        self.masked_rounds += masked
        outcomes = [outcome for outcome in outcomes if outcome[0] is not None]
        if outcomes:
            records, accepted, steps = zip(*outcomes, strict=True)
            if self.adaptive:  # a fixed shape reads no request's estimates
                record_each(records, shape, accepted, steps)
            self.server.record(shape, accepted, steps)
        if self.adaptive and timed and not masked and (shape, bucket) in self.round_seconds:
            residual = math.log(max(seconds, 1e-9) / self.seconds(shape, bucket))
            residual = min(max(residual, -MAX_RESIDUAL), MAX_RESIDUAL)
            self.load[bucket] = self.load.get(bucket, 1.0) * math.exp(LOAD_RATE * residual)
            if shape != PLAIN:
                key = (shape, bucket)
                self.correction[key] = (self.correction.get(key, 1.0)
                                        * math.exp(SHAPE_RATE * residual))

    def info(self) -> dict:
        """What /get_server_info and /metrics show: the shapes chosen and why."""
        return policy_info(self)
