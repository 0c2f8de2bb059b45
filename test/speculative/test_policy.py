"""The adaptive speculation policy on synthetic acceptance and costs: the formula, the choice
it implies at small and large batches, per-request estimates, cost drift and probing; rounds
judged by the batch's end where freed slots stay free (policy/refills.py)."""

import numpy as np
import pytest

from sgl_jax.speculative.policy import acceptance as A
from sgl_jax.speculative.policy import refills as E
from sgl_jax.speculative.policy import shape_policy as P
from sgl_jax.speculative.policy.acceptance_stats import AcceptanceStats
from sgl_jax.speculative.policy.refills import Refills, batch_end_progress
from sgl_jax.speculative.policy.shape_policy import (
    PLAIN,
    SPECULATION_MARGIN,
    SpeculationPolicy,
    candidate_shapes,
)
from sgl_jax.speculative.spec_config import TreeShape

TREE = TreeShape(3, 4, 8)
CHAIN1, CHAIN3 = TreeShape(1, 1, 2), TreeShape(3, 1, 4)


def costs(plain_ms, per_shape_ms, buckets=(1, 64)):
    """{(shape, bucket): seconds}: plain at plain_ms[b], the others at per_shape_ms[b][shape]."""
    table = {}
    for bucket in buckets:
        table[PLAIN, bucket] = plain_ms[bucket] / 1000
        for shape, ms in per_shape_ms[bucket].items():
            table[shape, bucket] = ms / 1000
    return table


def requests_with(policy, accepted_runs):
    """One acceptance record per request, fed the given rounds of TREE/CHAIN3 outcomes."""
    out = []
    for runs in accepted_runs:
        record = policy.new_request()
        for shape, accepted in runs:
            record.record(shape, accepted)
            policy.server.record(shape, accepted)
        out.append(record)
    return out


def test_candidates_stay_under_the_flags():
    assert candidate_shapes(TREE) == (PLAIN, CHAIN1, CHAIN3, TREE)
    assert candidate_shapes(TreeShape(5, 1, 6)) == (PLAIN, CHAIN1, TreeShape(5, 1, 6))
    assert candidate_shapes(TreeShape(1, 1, 2)) == (PLAIN, CHAIN1)


def expected_length(shape: TreeShape, rates: np.ndarray) -> float:
    """The policy's formula, written out: a round of `shape` (not packed) commits the bonus
    token plus each depth d reached, with chance q(1) ... q(d)."""
    length, survival = 1.0, 1.0
    for depth in range(shape.num_steps):
        survival *= rates[depth]
        length += survival
    return length


def test_depth_counts_record_tried_and_accepted_depths():
    counts = A.DepthCounts(depth=3, decay=1.0)
    counts.record(3, 1)  # depth 1 accepted, depth 2 tried and rejected, depth 3 not reached
    counts.record(3, 3)
    counts.record(1, 0)  # a one-step chain rejected at depth 1
    assert counts.tried.tolist() == [3, 2, 1]
    assert counts.accepted.tolist() == [2, 1, 1]
    prior = np.full(3, 0.5)
    assert A.PRIOR_WEIGHT == 2.0
    np.testing.assert_allclose(A.shrunk(counts, prior), [(2 + 1) / 5, (1 + 1) / 4, (1 + 1) / 3])


def test_a_batch_of_rounds_counts_like_its_rounds_one_by_one():
    one_by_one, batched = A.DepthCounts(3, decay=0.9), A.DepthCounts(3, decay=0.9)
    for accepted in (0, 2, 3, 1):
        one_by_one.record(3, accepted)
    batched.record(3, [0, 2, 3, 1])
    assert batched.tried.sum() == pytest.approx(one_by_one.tried.sum(), rel=0.2)
    no_decay = A.DepthCounts(3, decay=1.0)
    no_decay.record(3, [0, 2, 3, 1])
    assert no_decay.tried.tolist() == [4, 3, 2] and no_decay.accepted.tolist() == [3, 2, 1]


def test_a_round_records_each_request_as_its_own_record_would():
    shape = TreeShape(4, 1, 5)
    rounds = [(0, 4), (4, 4), (2, 3), (1, 1)]  # (accepted, depth verified) per request
    alone = [A.Acceptance(4, decay=0.9) for _ in rounds]
    together = [A.Acceptance(4, decay=0.9) for _ in rounds]
    for _ in range(3):
        for record, (accepted, steps) in zip(alone, rounds, strict=True):
            record.record(shape, accepted, steps)
        A.record_each(together, shape, *zip(*rounds, strict=True))
    for one, other in zip(alone, together, strict=True):
        np.testing.assert_array_equal(one.counts["chain"].tried, other.counts["chain"].tried)
        np.testing.assert_array_equal(one.counts["chain"].accepted,
                                      other.counts["chain"].accepted)
        assert one.version == other.version == 3 and not other.counts["tree"].tried.any()


def test_a_round_of_many_requests_counts_in_the_server_stats_as_each_one_would():
    rows = [(0, 4), (4, 4), (2, 3), (0, 0), (1, 1)]  # (accepted, draft depths); 0: no draft
    one_by_one, at_once = AcceptanceStats(4), AcceptanceStats(4)
    for accepted, steps in rows:
        one_by_one.record(accepted, steps)
    at_once.record_rounds(*zip(*rows, strict=True))
    assert at_once == one_by_one and at_once.rounds == 4 and at_once.accepted_tokens == 7
    assert at_once.accepted_per_position == [3, 2, 1, 1]
    counts = A.DepthCounts(3, decay=1.0)  # a numpy scalar counts like an int
    counts.record(np.int64(3), np.int32(1))
    assert counts.tried.tolist() == [1, 1, 0] and counts.accepted.tolist() == [1, 0, 0]


def test_decay_lets_recent_rounds_dominate():
    counts = A.DepthCounts(depth=1, decay=0.5)
    for _ in range(20):
        counts.record(1, 1)
    for _ in range(5):
        counts.record(1, 0)
    assert counts.accepted[0] / counts.tried[0] < 0.1


def test_plain_rounds_record_nothing():
    record = A.Acceptance(3, 1.0)
    record.record(PLAIN, 0)
    assert all(c.tried.sum() == 0 for c in record.counts.values())


def test_an_untried_depth_starts_from_the_rate_of_the_depth_above():
    """Only one-step chains ran, nine in ten accepted (0.85 after shrinking): depths 2 and 3
    take depth 1's rate, so a 3-deep chain (1 + .85 + .72 + .61 = 3.18 tokens in 20 ms here)
    beats the one-step chain (1.85 tokens in 13 ms) and is tried next. A fixed prior
    (INITIAL_RATE) would leave it at 1 + .85 * (1 + .6 + .36) = 2.67 tokens, below the
    one-step chain per second, and depth 2 would never be measured."""
    table = costs({1: 10}, {1: {CHAIN1: 13, CHAIN3: 20, TREE: 1000}}, buckets=(1,))
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, table, adaptive=True)
    reqs = requests_with(policy, [[(CHAIN1, 1)] * 9 + [(CHAIN1, 0)]])
    server = policy.server.rates("chain", None)
    assert server[1] == pytest.approx(server[0]) and server[2] == pytest.approx(server[0])
    assert server[0] == pytest.approx((9 + A.PRIOR_WEIGHT * A.INITIAL_RATE) / 12, rel=0.05)
    assert policy.choose(reqs, 1) == CHAIN3
    # Once depth 2 is measured as poor, depth 3 inherits that and the deep chain gives way.
    for _ in range(40):
        reqs[0].record(CHAIN3, 1)
        policy.server.record(CHAIN3, 1)
    rates = policy.server.rates("chain", None)
    assert rates[1] < 0.1 and rates[2] == pytest.approx(rates[1], abs=0.1)
    assert policy.choose(reqs, 1) == CHAIN1


SMALL_AND_LARGE = costs({1: 10, 64: 40}, {1: {CHAIN1: 12, CHAIN3: 13, TREE: 16},
                                          64: {CHAIN1: 70, CHAIN3: 160, TREE: 250}})


def test_high_acceptance_speculates_at_batch_1_and_not_at_64():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    good = [[(TREE, 3), (CHAIN3, 2), (TREE, 2), (CHAIN3, 3)] * 3]
    assert policy.choose(requests_with(policy, good), 1) != PLAIN
    # At 64 a chain round costs 4 plain steps and a tree round 6: no acceptance pays for that.
    assert policy.choose(requests_with(policy, good * 64), 64) in (PLAIN, CHAIN1)
    assert policy.last.tokens_per_s["plain"] == pytest.approx(64 / 0.040)


def test_the_choice_maximises_expected_tokens_per_second():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    reqs = requests_with(policy, [[(TREE, 1), (CHAIN3, 1), (TREE, 2), (CHAIN3, 0)] * 2] * 3)
    chosen = policy.choose(reqs, 1)
    expected = {}
    for shape in candidate_shapes(TREE):
        tokens = sum(expected_length(shape, r.rates(A.family(shape), policy.server))
                     for r in reqs)
        expected[shape] = tokens / SMALL_AND_LARGE[shape, 1]
    assert chosen == max(expected, key=expected.__getitem__)
    for shape, rate in expected.items():
        assert policy.last.tokens_per_s[P.shape_name(shape)] == pytest.approx(rate)


@pytest.mark.parametrize("advantage, expected", [(P.SPECULATION_MARGIN - 0.02, PLAIN),
                                                  (P.SPECULATION_MARGIN + 0.03, CHAIN1)])
def test_speculation_must_beat_plain_by_the_margin(advantage, expected):
    """A one-step chain whose expected rate is `advantage` times plain's: short of the margin
    it stays plain, past it the round speculates."""
    probe = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    reqs = requests_with(probe, [[(CHAIN1, 1), (CHAIN1, 0)] * 4])
    length = probe.expected_tokens(reqs, 1)[CHAIN1]
    table = costs({1: 10}, {1: {CHAIN1: 10 * length / advantage, CHAIN3: 1000, TREE: 1000}},
                  buckets=(1,))
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, table, adaptive=True)
    policy.server = probe.server
    assert policy.choose(reqs, 1) == expected and not policy.last.probe
    rates = policy.last.tokens_per_s
    assert rates["1/1/2"] / rates["plain"] == pytest.approx(advantage)


def test_an_unpredictable_request_falls_to_plain_while_the_server_estimate_stays_high():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    requests_with(policy, [[(TREE, 3)] * 30])  # the server has seen good text
    hopeless = requests_with(policy, [[(TREE, 0)] * 12])[0]
    newcomer = policy.new_request()
    assert policy.choose([newcomer], 1) != PLAIN  # a new request starts from the server's rates
    assert policy.choose([hopeless], 1) == PLAIN


def test_a_mixed_batch_weighs_every_request():
    table = costs({8: 10}, {8: {CHAIN1: 14, CHAIN3: 18, TREE: 30}}, buckets=(8,))
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, table, adaptive=True)
    predictable = requests_with(policy, [[(CHAIN3, 3), (TREE, 3)] * 10] * 4)
    hopeless = requests_with(policy, [[(CHAIN3, 0), (TREE, 0)] * 10] * 4)
    assert policy.choose(predictable, 8) != PLAIN
    assert policy.choose(hopeless, 8) == PLAIN
    mixed = policy.choose(predictable + hopeless, 8)
    lengths = policy.last.accept_lengths
    assert 1.0 < lengths[P.shape_name(mixed)] < 4.0


def test_a_bucket_whose_rounds_all_slow_down_prices_every_shape_higher():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    record = policy.new_request()
    for _ in range(30):
        for shape in (CHAIN3, PLAIN):
            policy.observe(shape, 1, 2 * SMALL_AND_LARGE[shape, 1],
                           [(record, 1, shape.num_steps)])
    for shape in (CHAIN3, PLAIN):  # the shapes served: their measured cost
        assert policy.seconds(shape, 1) == pytest.approx(2 * SMALL_AND_LARGE[shape, 1],
                                                         rel=0.01)
    # a shape not served takes the bucket's load, most of the slowdown
    assert 1.7 < policy.seconds(TREE, 1) / SMALL_AND_LARGE[TREE, 1] < 2.0
    assert policy.seconds(PLAIN, 64) == SMALL_AND_LARGE[PLAIN, 64]
    assert policy.rounds_by_shape["3/1/4"] == 30
    assert record.counts["chain"].tried[0] > 0


def test_a_provisional_timing_gives_way_to_a_clean_one_and_a_clean_one_stays():
    """A bucket timed while a background build shared the CPU is timed again once it is
    done: the new timings replace the provisional ones and what was learnt against them
    starts again; a clean timing is never replaced."""
    small = {key: s for key, s in SMALL_AND_LARGE.items() if key[1] == 1}
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, small, adaptive=True)
    contended = {(CHAIN3, 64): 0.5, (PLAIN, 64): 0.9}  # plain slowed more than the chain
    policy.add_round_seconds(contended, provisional=True)
    record = policy.new_request()
    for _ in range(5):
        policy.observe(CHAIN3, 64, 0.6, [(record, 1, 3)])
    assert policy.seconds(CHAIN3, 64) > 0.5
    policy.add_round_seconds({(CHAIN3, 64): 0.9, (PLAIN, 1): 99.0})  # clean, once idle
    assert policy.seconds(CHAIN3, 64) == 0.9  # replaced, correction and load reset
    assert policy.seconds(PLAIN, 64) == 0.9  # still provisional: no clean timing yet
    assert policy.round_seconds[PLAIN, 1] == small[PLAIN, 1]  # a clean timing stays
    assert policy.provisional == {(PLAIN, 64)}


def test_a_shape_is_priced_no_dearer_than_a_shape_that_does_all_its_work():
    """A one-step chain timed at four plain steps (the host paused while it ran) is believed
    to cost no more than the deeper chain, whose round does all its work, was timed at (not
    priced out for good); plain keeps its own timing (another program), and a packed round
    answers only to wider packings of its own tree."""
    assert TREE.includes(CHAIN3) and CHAIN3.includes(CHAIN1) and TREE.includes(TREE)
    assert not CHAIN3.includes(TREE) and not CHAIN1.includes(CHAIN3)
    assert PLAIN.includes(PLAIN) and not CHAIN1.includes(PLAIN) and not PLAIN.includes(CHAIN1)
    packed = [TreeShape(3, 4, 8, w) for w in (2, 4)]
    assert packed[1].includes(packed[0]) and not packed[0].includes(packed[1])
    assert not TREE.includes(packed[0]) and not packed[1].includes(CHAIN3)
    slow = costs({1: 10}, {1: {CHAIN1: 40, CHAIN3: 13, TREE: 16}}, buckets=(1,))
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, slow, adaptive=True)
    assert policy.seconds(CHAIN1, 1) == pytest.approx(0.013)
    assert policy.seconds(CHAIN3, 1) == pytest.approx(0.013)
    assert policy.seconds(TREE, 1) == pytest.approx(0.016)
    assert policy.seconds(PLAIN, 1) == pytest.approx(0.010)


def test_a_burst_of_slow_plain_rounds_does_not_make_speculation_look_cheap():
    """At batch 64 a one-step chain costs 1.75 plain steps and commits 1.42 tokens: plain
    wins. Five plain rounds slowed 1.45x by the machine (every shape would be) move the
    bucket's load, not plain's price against the chain's, so plain still wins on its rate."""
    table = costs({64: 290}, {64: {CHAIN1: 508, CHAIN3: 900, TREE: 1700}}, buckets=(64,))
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, table, adaptive=True)
    batch = requests_with(policy, [[(CHAIN1, 1), (CHAIN1, 0)] * 10] * 64)
    for _ in range(2):  # (a fourth plain round in a row would be followed by a probe)
        assert policy.choose(batch, 64) == PLAIN and not policy.last.probe
        policy.observe(PLAIN, 64, 0.290, [(r, 0, 0) for r in batch])
    for _ in range(5):
        policy.observe(PLAIN, 64, 1.45 * 0.290, [(r, 0, 0) for r in batch])
    assert policy.choose(batch, 64) == PLAIN and not policy.last.probe
    assert policy.seconds(CHAIN1, 64) / policy.seconds(PLAIN, 64) > 1.5


def test_probes_back_off_while_plain_keeps_winning():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    hopeless = requests_with(policy, [[(TREE, 0), (CHAIN3, 0)] * 20])
    probes = []
    for round_index in range(1, 200):
        shape = policy.choose(hopeless, 1)
        if shape != PLAIN:
            assert policy.last.probe
            probes.append(round_index)
    # streaks of 4, 8, 16, 32, 64 plain rounds, each followed by one probe
    assert probes == [4, 12, 28, 60, 124]


def test_a_speculating_policy_probes_plain_rounds_with_the_same_back_off():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    good = requests_with(policy, [[(TREE, 3), (CHAIN3, 3)] * 20])
    plain_rounds = [i for i in range(1, 200) if policy.choose(good, 1) == PLAIN]
    assert plain_rounds == [4, 12, 28, 60, 124]


def test_a_host_side_drafter_is_asked_only_for_rounds_that_may_draft():
    """NGRAM's proposals cost host time every round they are made: the policy asks for them
    only where a round could draft were every record's draft offered. For a hopeless request
    that is the speculative probes alone, and the rounds come out as without asking; a
    request whose draft is not offered counts as one without a draft."""
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    hopeless = requests_with(policy, [[(TREE, 0), (CHAIN3, 0)] * 20])
    asked = []
    for round_index in range(1, 130):
        def offered(index=round_index):
            asked.append(index)
            return [True]
        shape = policy.choose(hopeless, 1, offered=offered)
        assert (shape != PLAIN) == (round_index in (4, 12, 28, 60, 124))
    assert asked == [4, 12, 28, 60, 124]
    keen = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    good = requests_with(keen, [[(TREE, 3), (CHAIN3, 3)] * 20])
    assert keen.choose(good, 1) != PLAIN
    denied = []
    assert all(keen.choose(good, 1, offered=lambda: denied.append(1) or [False]) == PLAIN
               for _ in range(20))
    assert len(denied) == 20


def test_expected_tokens_are_kept_while_no_record_changes_and_follow_every_record():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    batch = requests_with(policy, [[(CHAIN3, 3), (TREE, 2)]] * 2) + [None]
    kept = policy.expected_row_tokens(batch, 64)
    assert policy.expected_row_tokens(list(batch), 64) is kept  # plain rounds change nothing
    before = policy.expected_tokens(batch, 64)
    batch[0].record(CHAIN3, 0)  # the request's own counts
    mine = policy.expected_tokens(batch, 64)
    assert mine[CHAIN3] < before[CHAIN3] and mine[TREE] < before[TREE]
    policy.server.record(TREE, [0, 0, 0])  # the server's
    assert policy.expected_tokens(batch, 64)[TREE] < mine[TREE]
    fresh = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    fresh.server = policy.server
    assert fresh.expected_tokens(batch, 64) == pytest.approx(policy.expected_tokens(batch, 64))


def test_a_shape_dearer_than_its_warm_up_timing_gives_way_once_plain_is_probed():
    """The warm-up timed CHAIN1 at 1.2 plain steps at bucket 1, but served rounds take 3: its
    own rounds and the plain probes correct the costs (each round's residual clipped, so
    over several rounds), and plain wins."""
    table = costs({1: 10}, {1: {CHAIN1: 12, CHAIN3: 40, TREE: 60}}, buckets=(1,))
    true_ms = {PLAIN: 10, CHAIN1: 30, CHAIN3: 40, TREE: 60}
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, table, adaptive=True)
    record = requests_with(policy, [[(CHAIN1, 1)] * 4])[0]
    chosen = []
    for _ in range(60):
        shape = policy.choose([record], 1)
        chosen.append((shape, policy.last.probe))
        policy.observe(shape, 1, true_ms[shape] / 1000,
                       [(record, 0 if shape == PLAIN else 1, shape.num_steps)])
    assert chosen[0] == (CHAIN1, False)
    assert all(shape == PLAIN or probe for shape, probe in chosen[-30:]), chosen
    # priced where its expected tokens no longer pay, plain at its true cost
    assert 0.020 < policy.seconds(CHAIN1, 1) <= 0.031
    rates = policy.last.tokens_per_s
    assert rates["1/1/2"] < P.SPECULATION_MARGIN * rates["plain"]
    assert policy.seconds(PLAIN, 1) == pytest.approx(0.010, rel=0.1)


# The demo model's EAGLE3 warm-up timings at bucket 1 on an H100 (2026-11-27, commit bb052c9)
GPU_LIKE = costs({1: 3.33}, {1: {CHAIN1: 2.78, CHAIN3: 2.77, TREE: 2.93}}, buckets=(1,))


def test_one_outlier_round_moves_a_shapes_price_against_plain_by_a_few_percent():
    """A shape's first served round 20 times its warm-up timing (a first run, a host pause),
    then plain rounds at their own: the shape keeps its price against plain within the clip
    (MAX_RESIDUAL times SHAPE_RATE), and a request drafting at the demo's rates still gets a
    draft and a speculative round."""
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, GPU_LIKE, adaptive=True)
    record = requests_with(policy, [[(TREE, 1), (TREE, 0), (TREE, 2)] * 3])[0]
    before = policy.seconds(TREE, 1) / policy.seconds(PLAIN, 1)
    policy.observe(TREE, 1, 20 * GPU_LIKE[TREE, 1], [(record, 1, 3)])
    for _ in range(20):
        policy.observe(PLAIN, 1, GPU_LIKE[PLAIN, 1], [(None, 0, 0)])
    after = policy.seconds(TREE, 1) / policy.seconds(PLAIN, 1)
    assert 1.0 < after / before <= np.exp(P.SHAPE_RATE * P.MAX_RESIDUAL) + 1e-9
    assert policy.admits_draft(1, "request-0")
    assert policy.choose([record], 1) != PLAIN


def test_plain_rounds_alone_leave_the_shapes_prices_against_plain_alone():
    """Served plain rounds 30% faster than their warm-up timing (overlap hides the host) are
    the bucket's load, not a correction of plain against the shapes they leave unmeasured."""
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, GPU_LIKE, adaptive=True)
    for _ in range(500):
        policy.observe(PLAIN, 1, 0.7 * GPU_LIKE[PLAIN, 1], [(None, 0, 0)])
    assert policy.seconds(PLAIN, 1) == pytest.approx(0.7 * GPU_LIKE[PLAIN, 1], rel=0.01)
    for shape in (CHAIN1, CHAIN3, TREE):  # (CHAIN1 takes CHAIN3's timing, 0.4% less)
        assert policy.seconds(shape, 1) / policy.seconds(PLAIN, 1) == pytest.approx(
            GPU_LIKE[shape, 1] / GPU_LIKE[PLAIN, 1], rel=0.005)


def test_without_adaptive_every_round_takes_the_flags_shape():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=False)
    hopeless = requests_with(policy, [[(TREE, 0)] * 20])
    assert all(policy.choose(hopeless, 1) == TREE for _ in range(10))
    assert policy.info()["spec_adaptive"] is False
    assert policy.info()["spec_shapes"] == ["3/4/8"]


def test_without_timings_the_policy_is_not_adaptive():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, {}, adaptive=True)
    assert not policy.adaptive and policy.choose([policy.new_request()], 1) == TREE


def test_info_reports_the_last_choice_and_its_reasons():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    policy.choose([policy.new_request()], 64)
    info = policy.info()
    assert info["spec_shapes"] == ["plain", "1/1/2", "3/1/4", "3/4/8"]
    last = info["spec_last_choice"]
    assert last["batch_bucket"] == 64
    assert last["round_ms"]["3/4/8"] == pytest.approx(250)
    assert last["tokens_per_s"]["3/4/8"] == pytest.approx(last["accept_length"]["3/4/8"] / 0.25)
    assert last["accept_length"]["plain"] == 1.0
    assert info["spec_believed_accept_rates"]["chain"] == [A.INITIAL_RATE] * 3
    assert info["spec_round_ms"] == {str(bucket): {P.shape_name(shape): pytest.approx(1000 * s)
                                                   for (shape, b), s in SMALL_AND_LARGE.items()
                                                   if b == bucket}
                                     for bucket in {b for _, b in SMALL_AND_LARGE}}


def typical_batch_speculates(policy, bucket):
    """The admission rule, from the formula: some shape's L(typical) / T beats plain's 1 / T
    by the margin."""
    rates = {kind: policy.server.rates(kind, None) for kind in ("chain", "tree")}
    plain = 1 / policy.seconds(PLAIN, bucket)
    return any(expected_length(s, rates[A.family(s)]) / policy.seconds(s, bucket)
               > P.SPECULATION_MARGIN * plain for s in policy.shapes if s != PLAIN)


def test_a_request_gets_a_draft_where_a_typical_batch_would_speculate():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    rids = [f"request-{i}" for i in range(640)]
    assert typical_batch_speculates(policy, 1) and not typical_batch_speculates(policy, 64)
    assert all(policy.admits_draft(1, rid) for rid in rids)
    # refused at batch 64: a lone draft there could not win even accepting every depth, so
    # it would never be measured (at 40 cost units a one-step chain costs 1.75 plain steps)
    assert not any(policy.admits_draft(64, rid) for rid in rids)
    # beside 60 drafted requests it could (64 + 61 tokens in 70 units against 64 in 40):
    # about one in EXPLORE_EVERY explores, the same ones on asking again; not beside 50
    at_64 = [policy.admits_draft(64, rid, 60) for rid in rids]
    assert 0.3 / P.EXPLORE_EVERY < np.mean(at_64) < 3 / P.EXPLORE_EVERY
    assert at_64 == [policy.admits_draft(64, rid, 60) for rid in rids]
    assert not any(policy.admits_draft(64, rid, 50) for rid in rids)
    # text the draft predicts well: the one-step chain pays even at batch 64
    requests_with(policy, [[(CHAIN3, 3), (TREE, 3)] * 40])
    assert typical_batch_speculates(policy, 64)
    assert all(policy.admits_draft(64, rid) for rid in rids)
    forced = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=False)
    assert all(forced.admits_draft(64, rid) for rid in rids)
    # text the draft cannot predict: refused even alone, where a lone draft still explores
    hopeless = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    requests_with(hopeless, [[(CHAIN3, 0), (TREE, 0)] * 40])
    assert not typical_batch_speculates(hopeless, 1)
    assert 0.3 / P.EXPLORE_EVERY < np.mean([hopeless.admits_draft(1, r) for r in rids]) < (
        3 / P.EXPLORE_EVERY)


def test_requests_without_a_draft_commit_one_token_a_round_and_measure_nothing():
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    assert all(policy.choose([None] * 3, 1) == PLAIN for _ in range(40))  # nor any probe
    good = requests_with(policy, [[(TREE, 3), (CHAIN3, 3)] * 5])[0]
    alone = policy.expected_tokens([good], 1)
    policy.choose([good, None, None], 1)
    for shape in policy.shapes:
        assert policy.last.accept_lengths[P.shape_name(shape)] == pytest.approx(
            (alone[shape] + 2) / 3)
    tried = policy.server.counts["tree"].tried.copy()
    policy.observe(TREE, 1, 0.016, [(None, 0, 3), (None, 0, 3)])
    np.testing.assert_array_equal(policy.server.counts["tree"].tried, tried)
    policy.observe(TREE, 1, 0.016, [(good, 3, 3), (None, 0, 3)])
    assert policy.server.counts["tree"].tried.sum() > tried.sum()
    policy.count_finished(True)
    policy.count_finished(False)
    policy.count_finished(False)
    assert policy.info()["spec_finished_requests"] == {"with_draft": 1, "without_draft": 2}


def test_no_speculative_probe_where_no_acceptance_could_win():
    """At batch 64 a one-step chain costs 1.75 plain steps (SMALL_AND_LARGE): with two rows
    of 64 drafted it could not win even if they accepted every depth, so plain rounds run
    without probes; with every row drafted the probes come back."""
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, SMALL_AND_LARGE, adaptive=True)
    hopeless = requests_with(policy, [[(TREE, 0)] * 10] * 64)
    mostly_undrafted = hopeless[:2] + [None] * 62
    assert all(policy.choose(mostly_undrafted, 64) == PLAIN for _ in range(100))
    chosen = [(policy.choose(hopeless, 64), policy.last.probe) for _ in range(100)]
    speculative = [probe for shape, probe in chosen if shape != PLAIN]
    assert len(speculative) >= 3 and all(speculative)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_rounds(refills: Refills, clock: Clock, count: int, seconds: float) -> None:
    for _ in range(count):
        clock.now += seconds
        refills.count_round()


def test_slots_taken_at_once_keep_rounds_judged_by_tokens():
    clock = Clock()
    refills = Refills(clock)
    for _ in range(20):
        refills.freed(batch_left=True)
        run_rounds(refills, clock, 2, 0.05)
        assert not refills.batch_runs_to_its_end
        refills.joined()
    assert not refills.free and refills.counts == {"taken": 20, "untaken": 0}


def test_a_slot_left_free_past_its_rounds_and_seconds_drains_the_batch():
    clock = Clock()
    refills = Refills(clock)
    refills.freed(batch_left=True)
    run_rounds(refills, clock, 3 * E.REFILL_ROUNDS, E.REFILL_SECONDS / (4 * E.REFILL_ROUNDS))
    assert len(refills.free) == 1 and not refills.batch_runs_to_its_end  # fast rounds: not yet
    refills.freed(batch_left=True)
    run_rounds(refills, clock, E.REFILL_ROUNDS - 1, 1.0)
    assert len(refills.free) == 1 and refills.counts["untaken"] == 1  # the older one
    assert refills.draining and refills.batch_runs_to_its_end
    refills.joined()  # a request admitted later takes the slot still free: not draining
    assert refills.counts == {"taken": 1, "untaken": 1} and not refills.batch_runs_to_its_end


def test_after_a_batch_that_took_no_freed_slot_the_next_is_judged_by_its_end():
    refills = Refills(Clock())
    refills.freed(batch_left=True)
    refills.freed(batch_left=True)
    refills.freed(batch_left=False)  # the last request of the batch: both slots untaken
    assert not refills.free and refills.counts == {"taken": 0, "untaken": 2}
    refills.joined()  # the next batch starts: no free slot to take
    assert refills.batch_runs_to_its_end  # from its first round
    refills.freed(batch_left=True)
    refills.joined()  # a freed slot taken: a server's clients came back
    assert not refills.batch_runs_to_its_end
    refills.freed(batch_left=True)
    refills.freed(batch_left=False)  # its tail drained, but it took one
    refills.joined()
    assert not refills.batch_runs_to_its_end


def test_progress_is_one_over_the_rounds_the_last_request_needs():
    tokens = {"a": [3.0, 1.0, 2.0], "b": [1.0, 1.0, 1.0]}
    remaining = [30, 20, 0]  # a request with nothing left counts one token
    rounds = {"a": max(30 / 3.0, 20 / 1.0, 1 / 2.0), "b": 30.0}
    progress = batch_end_progress({k: np.array(v) for k, v in tokens.items()}, remaining)
    assert progress == {k: pytest.approx(1.0 / v) for k, v in rounds.items()}


def reference_choice(policy, requests, remaining, table, bucket):
    """The rule written out: each shape's rounds to the batch's end from each request's
    expected tokens (the policy's formula), the fastest end unless plain is within the
    margin."""
    ends = {}
    for shape in candidate_shapes(TREE):
        tokens = [expected_length(shape, r.rates(A.family(shape), policy.server))
                  for r in requests]
        ends[shape] = max(left / t for left, t in zip(remaining, tokens, strict=True)) * table[
            shape, bucket]
    best = min(ends, key=ends.__getitem__)
    return best if ends[PLAIN] > SPECULATION_MARGIN * ends[best] else PLAIN


def finish_a_wave(policy):
    """Two requests finish while others run, and the batch then empties: neither slot was
    taken, so the policy judges rounds by the batch's end."""
    policy.count_finished(True, batch_left=True)
    policy.count_finished(True, batch_left=True)
    policy.count_finished(True, batch_left=False)
    assert policy.refills.batch_runs_to_its_end


@pytest.mark.parametrize("hopeless_left", [100, 60, 5])
def test_a_batch_run_to_its_end_drafts_only_where_it_ends_the_batch_sooner(hopeless_left):
    """Seven requests the draft predicts and one it does not, 100 tokens left each but the
    hopeless one's `hopeless_left`. Judged by tokens the round drafts whatever; judged by the
    batch's end it drafts only where the hopeless request will not be the last to end."""
    table = costs({8: 10}, {8: {CHAIN1: 14, CHAIN3: 18, TREE: 30}}, buckets=(8,))
    policy = SpeculationPolicy(candidate_shapes(TREE), TREE, table, adaptive=True)
    predictable = requests_with(policy, [[(CHAIN3, 3), (TREE, 3)] * 10] * 7)
    hopeless = requests_with(policy, [[(CHAIN3, 0), (TREE, 0)] * 10])
    batch, remaining = predictable + hopeless, [100] * 7 + [hopeless_left]
    assert policy.choose(batch, 8, remaining=remaining) != PLAIN
    assert policy.last.judged_by == "tokens"
    finish_a_wave(policy)
    chosen = policy.choose(batch, 8, remaining=remaining)
    assert policy.last.judged_by == "batch end" and not policy.last.probe
    assert chosen == reference_choice(policy, batch, remaining, table, 8)
    assert (chosen == PLAIN) == (hopeless_left == 100)
    # Without the tokens left (a caller that does not know them) rounds stay judged by tokens.
    assert policy.choose(batch, 8) != PLAIN and policy.last.judged_by == "tokens"


def test_one_request_is_judged_alike_either_way():
    table = costs({1: 10}, {1: {CHAIN1: 12, CHAIN3: 13, TREE: 16}}, buckets=(1,))
    by_tokens = SpeculationPolicy(candidate_shapes(TREE), TREE, table, adaptive=True)
    by_end = SpeculationPolicy(candidate_shapes(TREE), TREE, table, adaptive=True)
    finish_a_wave(by_end)
    for runs in ([(TREE, 3), (CHAIN3, 2)] * 4, [(TREE, 1), (CHAIN3, 0)] * 4,
                 [(TREE, 0), (CHAIN3, 0)] * 4):
        choices = [policy.choose(requests_with(policy, [runs]), 1, remaining=[50])
                   for policy in (by_tokens, by_end)]
        assert choices[0] == choices[1]
    assert by_end.last.judged_by == "batch end"
