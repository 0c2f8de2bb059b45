"""The batched sampler against a numpy reference of the filtering pipeline, seeded draws
against their distribution, batch independence, greedy rows, penalty state and raw logprobs."""

import dataclasses
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.layers import sampler
from sgl_jax.layers.sampler import PenaltyState, SamplingBatch

S, V, E, R, M = 8, 48, 3, 6, 4  # rows, vocabulary, suppress width, penalty slots, bias width
W = -(-V // 32)  # grammar bitmask words

filtered_probs = jax.jit(sampler.filtered_probs)
sample = jax.jit(sampler.sample, static_argnames="num_top_logprobs")
reset_slots = jax.jit(sampler.reset_slots)
record_tokens = jax.jit(sampler.record_tokens)


def make_params(n: int = S, **fields) -> SamplingBatch:
    """Every knob off (temperature 1), overridden per field by a scalar or a length-n list."""
    defaults = dict(
        temperature=(1.0, np.float32),
        top_p=(1.0, np.float32),
        top_k=(0, np.int32),
        min_p=(0.0, np.float32),
        frequency_penalty=(0.0, np.float32),
        presence_penalty=(0.0, np.float32),
        repetition_penalty=(1.0, np.float32),
        seed=(np.arange(n), np.uint32),
        position=(0, np.int32),
    )
    arrays = {
        name: np.broadcast_to(np.asarray(fields.get(name, value), dtype), (n,)).copy()
        for name, (value, dtype) in defaults.items()
    }
    wide = {name: np.asarray(fields.get(name, np.full((n, width), fill)), dtype)
            for name, width, fill, dtype in (("suppress_ids", E, -1, np.int32),
                                             ("bias_ids", M, -1, np.int32),
                                             ("bias_values", M, 0.0, np.float32),
                                             ("allowed", W, -1, np.int32))}
    return SamplingBatch(**arrays, **wide)


def empty_state() -> PenaltyState:
    return PenaltyState(np.zeros((R, V), np.int32), np.zeros((R, V), bool))


NO_SLOTS = np.full(S, -1, np.int32)


# ---------------------------------------------------------------- numpy reference


def ref_penalised(logits, p: SamplingBatch, state: PenaltyState, slots, s):
    """Row s of the logits after penalties, logit bias, the grammar mask and suppression, in
    float64."""
    x = logits[s].astype(np.float64)
    if slots[s] >= 0:
        counts, seen = state.output_counts[slots[s]], state.seen[slots[s]]
        rp = float(p.repetition_penalty[s])
        x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
        x = x - float(p.frequency_penalty[s]) * counts - float(p.presence_penalty[s]) * (counts > 0)
    for token, bias in zip(p.bias_ids[s], p.bias_values[s], strict=True):
        if token >= 0:
            x[token] += float(bias)
    for token in range(V):
        word = int(p.allowed[s][token // 32]) & 0xFFFFFFFF
        if not word >> (token % 32) & 1:
            x[token] = -np.inf
    for token in p.suppress_ids[s]:
        if token >= 0:
            x[token] = -np.inf
    return x


def ref_row(logits, p: SamplingBatch, state: PenaltyState, slots, s):
    """The distribution row s is drawn from, written as a walk down the sorted tokens."""
    x = ref_penalised(logits, p, state, slots, s)
    out = np.zeros(V)
    if p.temperature[s] == 0:
        out[np.argmax(x)] = 1.0
        return out
    z = x / float(p.temperature[s])
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    ranked = list(np.argsort(-z, kind="stable"))
    k = int(p.top_k[s])
    if 0 < k < V:
        ranked = ranked[:k]
    top_k_mass = probs[ranked].sum()
    kept, mass = [], 0.0
    for token in ranked:  # top-p over the renormalised top-k distribution
        kept.append(token)
        mass += probs[token] / top_k_mass
        if p.top_p[s] < 1.0 and mass >= p.top_p[s]:
            break
    kept = [t for t in kept if probs[t] >= p.min_p[s] * probs.max()]
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def ref_filtered(logits, p, state, slots):
    p = jax.tree.map(np.asarray, p)
    state = jax.tree.map(np.asarray, state)
    return np.stack([ref_row(logits, p, state, slots, s) for s in range(len(slots))])


def ref_log_softmax(logits):
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------- hand-worked cases

BASE = np.array([0.5, 0.3, 0.15, 0.05])  # four live tokens, the rest of V at -inf


def padded(values, fill=0.0):
    row = np.full(V, fill)
    row[: len(values)] = values
    return row


LOG_BASE = np.log(BASE)

# (live logits of one row, its params, the expected distribution over the live tokens)
HAND_CASES = {
    "off": (LOG_BASE, dict(), BASE),
    "temperature_2": (LOG_BASE, dict(temperature=2.0), np.sqrt(BASE) / np.sqrt(BASE).sum()),
    "top_k_2": (LOG_BASE, dict(top_k=2), [0.625, 0.375, 0, 0]),
    "top_p_0.85": (LOG_BASE, dict(top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    # top-p cuts the renormalised top-3 (0.526, 0.316, 0.158): mass before the third is 0.842
    # >= 0.82. On the raw cumsum (0.8 < 0.82) the third token would survive.
    "top_k_3_then_top_p_0.82": (LOG_BASE, dict(top_k=3, top_p=0.82), [0.625, 0.375, 0, 0]),
    "min_p_0.35": (LOG_BASE, dict(min_p=0.35), [0.625, 0.375, 0, 0]),
    "top_p_0_keeps_top": (LOG_BASE, dict(top_p=0.0), [1, 0, 0, 0]),
    "suppress_top": (LOG_BASE, dict(suppress_ids=[0, -1, -1]), [0, 0.6, 0.3, 0.1]),
    # exactly 0.5 each: the first token already reaches top_p, the tie goes to the lower id
    "top_p_boundary_tie": ([1.0, 1.0], dict(top_p=0.5), [1, 0]),
}


def test_hand_worked_filters():
    cases = list(HAND_CASES.values())
    logits = np.stack([padded(live, fill=-np.inf) for live, _, _ in cases]).astype(np.float32)
    off = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, suppress_ids=[-1] * E)
    fields = {name: [knobs.get(name, off[name]) for _, knobs, _ in cases] for name in off}
    params = make_params(len(cases), **fields)
    expected = np.stack([padded(want) for _, _, want in cases])
    slots = np.full(len(cases), -1, np.int32)
    got = np.asarray(filtered_probs(logits, params, empty_state(), slots))
    np.testing.assert_allclose(got, expected, atol=1e-6)
    np.testing.assert_allclose(ref_filtered(logits, params, empty_state(), slots), expected)


def test_hand_worked_penalties():
    """Prompt token 0, output tokens 1 (twice) and 3: rp=2, fp=0.5, pp=0.25."""
    logits = np.full((S, V), -np.inf, np.float32)
    logits[:, :4] = [2.0, -1.0, 0.5, 1.0]
    counts = np.zeros((R, V), np.int32)
    counts[4, [1, 3]] = [2, 1]
    seen = counts > 0
    seen[4, 0] = True
    params = make_params(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    slots = np.full(S, 4, np.int32)
    slots[1] = -1  # no state: no penalty
    got = np.asarray(filtered_probs(logits, params, PenaltyState(counts, seen), slots))
    # token 0: 2/2; token 1: -1*2 - 0.5*2 - 0.25; token 2: untouched; token 3: 1/2 - 0.5 - 0.25
    want = padded(np.exp([1.0, -3.25, 0.5, -0.25]) / np.exp([1.0, -3.25, 0.5, -0.25]).sum())
    np.testing.assert_allclose(got[0], want, atol=1e-6)
    raw = np.exp(logits[1, :4]) / np.exp(logits[1, :4]).sum()
    np.testing.assert_allclose(got[1], padded(raw), atol=1e-6)


# ---------------------------------------------------------------- random cases, one knob at a time


def random_knob(rng, knob):
    """Parameters with only `knob` randomised (all of them for 'combined')."""
    draws = {
        "temperature": lambda: rng.choice([0.0, 0.3, 0.7, 1.0, 1.8], S),
        "top_k": lambda: rng.choice([-1, 0, 1, 3, 10, V - 1, V, V + 5], S),
        "top_p": lambda: rng.choice([0.05, 0.3, 0.6, 0.9, 0.99, 1.0], S),
        "min_p": lambda: rng.choice([0.0, 0.01, 0.1, 0.3, 0.9], S),
        "frequency_penalty": lambda: rng.uniform(-1.0, 2.0, S),
        "presence_penalty": lambda: rng.uniform(-1.0, 2.0, S),
        "repetition_penalty": lambda: rng.uniform(0.5, 2.5, S),
        "suppress_ids": lambda: rng.integers(-1, V, (S, E)),
        "logit_bias": lambda: (rng.integers(-1, V, (S, M)), rng.uniform(-100, 100, (S, M))),
        "allowed": lambda: random_bitmask(rng),
    }
    chosen = draws if knob == "combined" else {knob: draws[knob]}
    fields = {name: draw() for name, draw in chosen.items()}
    if "logit_bias" in fields:
        fields["bias_ids"], fields["bias_values"] = fields.pop("logit_bias")
    return make_params(**fields)


def random_bitmask(rng):
    """i32[S, W] allowing about half the ids, and always the first of each row's choice."""
    allowed = rng.random((S, W * 32)) < 0.5
    allowed[np.arange(S), rng.integers(0, V, S)] = True
    bits = (allowed.reshape(S, W, 32) << np.arange(32, dtype=np.uint64)).sum(-1)
    return bits.astype(np.uint32).view(np.int32)


def random_state(rng):
    counts = rng.integers(0, 4, (R, V)) * (rng.random((R, V)) < 0.3)
    seen = (counts > 0) | (rng.random((R, V)) < 0.2)  # the prompt's tokens
    return PenaltyState(counts.astype(np.int32), seen)


@pytest.mark.parametrize(
    "knob",
    [
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "suppress_ids",
        "logit_bias",
        "allowed",
        "combined",
    ],
)
def test_filtered_probs_match_reference(knob):
    rng = np.random.default_rng(zlib.crc32(knob.encode()))
    for _ in range(4):
        logits = (rng.normal(size=(S, V)) * 3).astype(np.float32)
        params, state = random_knob(rng, knob), random_state(rng)
        slots = rng.integers(-1, R, S).astype(np.int32)
        got = np.asarray(filtered_probs(logits, params, state, slots))
        np.testing.assert_allclose(got, ref_filtered(logits, params, state, slots), atol=1e-6)


# ---------------------------------------------------------------- the draw


def test_draws_follow_the_filtered_distribution():
    """20000 draws of one request at positions 0..N-1: frequencies within 5 binomial sigma of
    the reference probabilities, and no token outside the support."""
    n = 20000
    rng = np.random.default_rng(0)
    row = (rng.normal(size=V) * 2).astype(np.float32)
    knobs = dict(temperature=0.8, top_k=12, top_p=0.95, min_p=0.03, frequency_penalty=0.7)
    state = random_state(rng)
    banned = np.tile([int(np.argmax(row)), -1, -1], (n, 1))
    params = make_params(n, **knobs, seed=1234, position=np.arange(n), suppress_ids=banned)
    slots = np.full(n, 2, np.int32)
    one = jax.tree.map(lambda a: a[:1], params)
    want = ref_filtered(row[None], one, state, slots[:1])[0]
    assert 4 <= np.count_nonzero(want) < 12  # the filters bite, several tokens remain

    tokens = np.asarray(sample(np.tile(row, (n, 1)), params, state, slots).tokens)
    freq = np.bincount(tokens, minlength=V) / n
    assert np.all(freq[want == 0] == 0)
    sigma = np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-12), np.abs(freq - want) / (sigma + 1e-12)


def flat_requests(rng, n):
    """Near-uniform rows, so a draw keyed on anything but (seed, position) would differ."""
    logits = (rng.normal(size=(n, V)) * 0.1).astype(np.float32)
    params = make_params(
        n,
        temperature=rng.uniform(0.8, 1.5, n),
        top_k=rng.choice([0, 30, 40], n),
        seed=rng.integers(0, 2**32, n),
        position=rng.integers(0, 1000, n),
    )
    return logits, params


def tokens_of(logits, params, slots=None):
    slots = np.full(len(logits), -1, np.int32) if slots is None else slots
    return np.asarray(sample(logits, params, empty_state(), slots).tokens)


def concat(a, b):
    return jax.tree.map(lambda x, y: np.concatenate([np.asarray(x), np.asarray(y)]), a, b)


def test_tokens_independent_of_row_and_batch():
    rng = np.random.default_rng(1)
    logits, params = flat_requests(rng, S)
    alone = tokens_of(logits, params)

    reverse = slice(None, None, -1)
    reversed_tokens = tokens_of(logits[reverse], jax.tree.map(lambda a: a[reverse], params))
    np.testing.assert_array_equal(reversed_tokens[reverse], alone)

    # half the requests at other rows beside strangers, some of them greedy
    stranger_logits, strangers = flat_requests(rng, S // 2)
    strangers = dataclasses.replace(strangers, temperature=np.array([0, 2, 0, 1], np.float32))
    half = jax.tree.map(lambda a: a[: S // 2], params)
    mixed = tokens_of(np.concatenate([stranger_logits, logits[: S // 2]]), concat(strangers, half))
    np.testing.assert_array_equal(mixed[S // 2 :], alone[: S // 2])

    # and in a larger bucket
    wide = tokens_of(np.concatenate([logits, logits[::-1]]), concat(params, params))
    np.testing.assert_array_equal(wide[:S], alone)


def test_seed_and_position_drive_the_sequence():
    rng = np.random.default_rng(2)
    row = (rng.normal(size=V) * 0.1).astype(np.float32)
    logits = np.tile(row, (S, 1))

    def sequence(seed):
        params = make_params(seed=seed, position=np.arange(S))
        return tokens_of(logits, params)

    np.testing.assert_array_equal(sequence(7), sequence(7))
    assert not np.array_equal(sequence(7), sequence(8))
    assert len(set(sequence(7).tolist())) > 1  # positions differ, so do the draws


# ---------------------------------------------------------------- greedy rows


def test_greedy_is_argmax_whatever_the_filters():
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(S, V)) * 0.1).astype(np.float32)
    params = make_params(
        temperature=0.0, top_k=[0, 5, 40, 0, 5, 40, 0, 5], top_p=0.9, min_p=0.0, position=5
    )
    np.testing.assert_array_equal(tokens_of(logits, params), logits.argmax(-1))
    # the same rows in a batch that also samples
    mixed = dataclasses.replace(params, temperature=np.array([0, 0, 0, 0, 0, 0, 0, 1], np.float32))
    np.testing.assert_array_equal(tokens_of(logits, mixed)[:7], logits[:7].argmax(-1))


@pytest.mark.parametrize("vocab", [13, 128, 300, 1000])
def test_vocab_argmax_is_the_first_maximum(vocab):
    """Against numpy's argmax: ties within and across blocks of ids, a row of -inf, a
    vocabulary that is not a multiple of the block, and a leading batch axis."""
    rng = np.random.default_rng(vocab)
    x = rng.integers(0, 4, (3, 5, vocab)).astype(np.float32)  # every row full of ties
    x[0, 0] = -np.inf
    x[1, 2, -1] = 9.0  # the maximum in the last, padded block
    got = jax.jit(sampler.vocab_argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    bf16 = jax.jit(sampler.vocab_argmax)(jnp.asarray(x, jnp.bfloat16))
    np.testing.assert_array_equal(bf16, np.argmax(x, axis=-1))


@pytest.mark.parametrize("vocab", [13, 300])
def test_vocab_top_k_is_lax_top_k_ties_included(vocab):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.integers(0, 4, (2, 3, vocab)), jnp.float32)  # many ties
    for k in (1, 3, 5):
        values, ids = sampler.vocab_top_k(x, k)
        want_values, want_ids = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(values, want_values)
        np.testing.assert_array_equal(ids, want_ids)


def test_greedy_honours_suppress_ids_and_penalties():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(S, V)).astype(np.float32)
    order = np.argsort(-logits, axis=-1)
    suppress = np.full((S, E), -1, np.int32)
    suppress[0, :2] = order[0, :2]  # ban the two best: the third wins
    counts = np.zeros((R, V), np.int32)
    counts[3, order[1, 0]] = 1  # row 1's best was already emitted
    state = PenaltyState(counts, counts > 0)
    params = make_params(temperature=0.0, presence_penalty=100.0, suppress_ids=suppress)
    slots = np.array([-1, 3, -1, -1, -1, -1, -1, -1], np.int32)
    tokens = np.asarray(sample(logits, params, state, slots).tokens)
    assert tokens[0] == order[0, 2]
    assert tokens[1] == order[1, 1]
    np.testing.assert_array_equal(tokens[2:], logits[2:].argmax(-1))


# ---------------------------------------------------------------- penalty state


def test_reset_slots_touches_only_the_given_rows():
    rng = np.random.default_rng(5)
    state = random_state(rng)
    slots = np.array([2, -1, 0], np.int32)
    prompts = np.array([[5, 7, 11], [1, 2, 3], [9, -1, -1]], np.int32)
    lens = np.array([2, 3, 1], np.int32)  # token 11 lies past row 0's prompt
    new = reset_slots(state, slots, prompts, lens)
    counts, seen = np.asarray(new.output_counts), np.asarray(new.seen)

    want_counts, want_seen = state.output_counts.copy(), state.seen.copy()
    want_counts[[0, 2]] = 0
    want_seen[[0, 2]] = False
    want_seen[2, [5, 7]] = True
    want_seen[0, 9] = True
    np.testing.assert_array_equal(counts, want_counts)
    np.testing.assert_array_equal(seen, want_seen)

    without_lens = reset_slots(state, slots, prompts)
    assert np.asarray(without_lens.seen)[2, 11]


def test_record_tokens_counts_valid_rows_only():
    state = PenaltyState(np.zeros((R, V), np.int32), np.zeros((R, V), bool))
    slots = np.array([1, 1, -1, 3, 4, 1, -1, -1], np.int32)
    tokens = np.array([4, 4, 6, 8, 9, 5, 0, 0], np.int32)
    valid = np.array([1, 1, 1, 0, 1, 1, 0, 0], bool)
    new = record_tokens(state, slots, tokens, valid)
    want = np.zeros((R, V), np.int32)
    want[1, 4], want[1, 5], want[4, 9] = 2, 1, 1
    np.testing.assert_array_equal(np.asarray(new.output_counts), want)
    np.testing.assert_array_equal(np.asarray(new.seen), want > 0)


def test_prompt_tokens_get_repetition_but_not_frequency_or_presence():
    logits = np.zeros((S, V), np.float32)
    logits[:, :3] = [2.0, 2.0, 2.0]  # token 0 in the prompt, token 1 in the output
    state = reset_slots(sampler.init_penalty_state(R, V), np.array([0]), np.array([[0]]))
    state = record_tokens(state, np.array([0]), np.array([1]), np.array([True]))
    slots = np.zeros(S, np.int32)

    def penalised(**knobs):
        probs = np.asarray(filtered_probs(logits, make_params(**knobs), state, slots))[0]
        return np.log(probs / probs[2])[:2] + 2.0  # logits relative to the untouched token 2

    np.testing.assert_allclose(penalised(repetition_penalty=2.0), [1.0, 1.0], atol=1e-5)
    np.testing.assert_allclose(penalised(frequency_penalty=0.5), [2.0, 1.5], atol=1e-5)
    np.testing.assert_allclose(penalised(presence_penalty=0.75), [2.0, 1.25], atol=1e-5)


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_the_raw_logits():
    rng = np.random.default_rng(6)
    logits = (rng.normal(size=(S, V)) * 2).astype(np.float32)
    params = random_knob(rng, "combined")
    state, slots = random_state(rng), rng.integers(-1, R, S).astype(np.int32)
    out = sample(logits, params, state, slots, detail=sampler.TOP_LOGPROBS, num_top_logprobs=5)
    raw = ref_log_softmax(logits)
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprob, raw[np.arange(S), tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_logprob_ids, np.argsort(-raw, axis=-1)[:, :5])
    np.testing.assert_allclose(out.top_logprobs, np.sort(raw, axis=-1)[:, ::-1][:, :5], atol=1e-5)
    row, column = np.nonzero(np.asarray(out.top_logprob_ids) == tokens[:, None])
    # a token's value is exactly its entry among the top ones
    np.testing.assert_array_equal(np.asarray(out.top_logprobs)[row, column],
                                  np.asarray(out.logprob)[row])

    token_only = sample(logits, params, state, slots, detail=sampler.TOKEN_LOGPROBS,
                        num_top_logprobs=5)
    np.testing.assert_array_equal(token_only.logprob, out.logprob)
    assert not np.asarray(token_only.top_logprobs).any()

    nothing = sample(logits, params, state, slots, detail=sampler.NO_LOGPROBS, num_top_logprobs=5)
    assert not np.asarray(nothing.logprob).any() and not np.asarray(nothing.top_logprobs).any()

    none = sample(logits, params, state, slots)
    assert none.top_logprob_ids.shape == (S, 0) and none.top_logprobs.shape == (S, 0)
    assert none.top_logprob_ids.dtype == jnp.int32
    for other in (token_only, nothing, none):
        np.testing.assert_array_equal(other.tokens, tokens)


def test_all_greedy_batch_skips_the_sort():
    """One compiled function: a lax.cond between the raw argmax (no edits, no sort) and the
    edited logits, under which a second lax.cond's greedy branch holds no sort."""
    logits = np.zeros((S, V), np.float32)
    jaxpr = jax.make_jaxpr(sampler.sample)(logits, make_params(), empty_state(), NO_SLOTS)

    def two_way_conds(eqns):  # the other: raw_logprobs' switch of three
        return [eqn for eqn in eqns
                if eqn.primitive.name == "cond" and len(eqn.params["branches"]) == 2]

    def sorts(jaxpr) -> bool:
        return re.search(r"\bsort\[", str(jaxpr)) is not None

    (outer,) = two_way_conds(jaxpr.eqns)
    raw, edited = outer.params["branches"][1], outer.params["branches"][0]  # true is [1]
    assert not sorts(raw) and sorts(edited)
    (inner,) = two_way_conds(edited.jaxpr.eqns)
    assert sorted(sorts(branch) for branch in inner.params["branches"]) == [False, True]


def test_only_edited_greedy_batches_build_the_edited_logits(monkeypatch):
    """Run eagerly, lax.cond calls just the branch it picks: a greedy batch that nothing edits
    takes the raw argmax without the edited logits; a penalty, a bias, a grammar or a
    suppressed id alone, on one row, takes the edited branch, which moves that row's token."""
    edited = []

    def counted(*args):
        edited.append(True)
        return penalised_logits(*args)

    penalised_logits = sampler.penalised_logits
    monkeypatch.setattr(sampler, "penalised_logits", counted)
    logits = np.random.default_rng(8).normal(size=(S, V)).astype(np.float32)
    best, second = np.argsort(-logits[2])[:2]
    counts = np.zeros((R, V), np.int32)
    counts[1, best] = 1
    only_second = np.full((S, W), -1, np.int32)
    only_second[2] = 0
    only_second[2, second // 32] = 1 << (second % 32)
    one_row = lambda fill, value, width: np.where(  # noqa: E731
        np.arange(S)[:, None] == 2, value, np.full((S, width), fill))
    slots_row2 = np.where(np.arange(S) == 2, 1, -1).astype(np.int32)
    cases = {
        "penalty": (make_params(temperature=0.0, presence_penalty=100.0), slots_row2),
        "bias": (make_params(temperature=0.0, bias_ids=one_row(-1, [best, -1, -1, -1], M),
                             bias_values=one_row(0.0, [-100.0, 0, 0, 0], M)), NO_SLOTS),
        "grammar": (make_params(temperature=0.0, allowed=only_second), NO_SLOTS),
        "suppressed": (make_params(temperature=0.0, suppress_ids=one_row(-1, [best, -1, -1], E)),
                       NO_SLOTS),
    }
    with jax.disable_jit():
        plain = sampler.sample(logits, make_params(temperature=0.0),
                               PenaltyState(counts, counts > 0), NO_SLOTS)
        assert not edited
        np.testing.assert_array_equal(plain.tokens, logits.argmax(-1))
        for name, (params, slots) in cases.items():
            edited.clear()
            tokens = np.asarray(sampler.sample(logits, params, PenaltyState(counts, counts > 0),
                                               slots).tokens)
            assert edited, name
            assert tokens[2] == second, name
            np.testing.assert_array_equal(np.delete(tokens, 2), np.delete(logits.argmax(-1), 2))


def test_only_batches_that_sample_take_the_sampling_branch(monkeypatch):
    """Run eagerly, lax.cond calls just the branch it picks: a tripwire on the sampling branch."""

    def tripwire(penalised, params):
        raise AssertionError("sampling branch taken")

    monkeypatch.setattr(sampler, "sampled_tokens", tripwire)
    logits = np.random.default_rng(7).normal(size=(S, V)).astype(np.float32)
    with jax.disable_jit():
        greedy = sampler.sample(logits, make_params(temperature=0.0), empty_state(), NO_SLOTS)
        np.testing.assert_array_equal(greedy.tokens, logits.argmax(-1))
        with pytest.raises(AssertionError, match="sampling branch taken"):
            mixed = make_params(temperature=[0, 0, 0, 0, 0, 0, 0, 1])
            sampler.sample(logits, mixed, empty_state(), NO_SLOTS)
