"""On-device sampling for a batch where every row has its own sampling parameters.

Runs inside the model's jitted step: logits f32[S, V] in, next tokens out, no host round trip.

Pipeline, in this order (each step is one small function below):

1. Penalties, from the row's slot in `PenaltyState` (vLLM's order):
   repetition (HF/CTRL, over prompt and output tokens: logit / rp if logit > 0 else logit * rp),
   then frequency (logit -= fp * count) and presence (logit -= pp * [count > 0]) over output tokens.
   A row with slot < 0 has no state: it is not penalised.
2. `logit_bias` added (OpenAI's, sparse: ids and values per row), then tokens the row's grammar
   forbids (a bit clear in `allowed`) and `suppress_ids` -> -inf (min_new_tokens bans EOS and
   stop ids this way), for greedy rows too.
3. Greedy rows (temperature == 0): argmax of the penalised logits.
4. Sampling rows: divide by temperature, softmax, then on the descending sort
   top-k (exactly k ranks; ties keep the lower token id),
   top-p on the top-k distribution renormalised (vLLM's `apply_top_k_top_p` and FlashInfer's
   `top_k_first` order; SGLang's torch fallback instead cuts on the un-renormalised cumsum):
   keep the smallest prefix whose mass reaches top_p, the top token always,
   min-p: drop p < min_p * p_max. The top token survives every filter and every filter keeps a
   prefix of the sort, and p / p_max is unchanged by renormalising, so min-p gives the same
   set whether it runs first or last.
   The kept mass is renormalised and drawn from by inverse CDF with one uniform whose key is
   `fold_in(key(seed), position)`: a request's draw depends on its own seed and output position,
   never on its row or the other rows. (The float reductions that build the CDF may round
   differently for another bucket size; a draw only changes if u falls within that rounding of
   a CDF boundary.)

Log-probabilities are those of the model's RAW distribution, log_softmax of the logits given
to `sample` before penalties, suppression, temperature and filters: that is what the OpenAI API
reports for the model, and it does not change with the sampling knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.sampling_fields import ROW_FIELDS, neutral_rows


def _neutral(cls: type, rows: int, **widths: int) -> SamplingBatch:
    """`rows` greedy rows without penalties, biases or grammar, as host arrays; `widths` gives
    the 2-D fields' widths by name: E (suppressed ids), M (logit_bias entries), W (bitmask
    words)."""
    return cls(**neutral_rows(rows, widths))


def _sampling_batch_class() -> type:
    """A frozen dataclass with one array field per row of ROW_FIELDS, in the table's order, and
    a pytree, so jitted steps take it whole. Its fields are generated so that the table stays
    the one list of them; its docstring lists each field's shape and meaning."""
    cls = make_dataclass(
        "SamplingBatch", [(f.name, jax.Array) for f in ROW_FIELDS], frozen=True,
        namespace={"neutral": classmethod(_neutral)})
    cls.__module__ = __name__  # so pickle finds it here
    cls.__doc__ = "Each row's sampling parameters at one step (sgl_jax.sampling_fields):\n" + (
        "\n".join(f"    {f.name}: {f.shape}; {f.meaning}" for f in ROW_FIELDS))
    return jax.tree_util.register_dataclass(cls)


# S rows of per-row sampling parameters, one field per row of ROW_FIELDS: its shapes, dtypes
# and meanings are in sgl_jax/sampling_fields.py (and SamplingBatch.__doc__).
SamplingBatch = _sampling_batch_class()


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    output_counts: jax.Array  # i32[R, V]; per slot, occurrences of each token in the output
    seen: jax.Array  # bool[R, V]; per slot, tokens in the prompt or the output


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SampleOutput:
    tokens: jax.Array  # i32[S]
    logprob: jax.Array  # f32[S]; raw log-probability of `tokens`
    top_logprob_ids: jax.Array  # i32[S, K]; by descending raw logprob
    top_logprobs: jax.Array  # f32[S, K]


# ---------------------------------------------------------------- penalty state (device side)


def init_penalty_state(num_slots: int, vocab_size: int) -> PenaltyState:
    return PenaltyState(
        output_counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
        seen=jnp.zeros((num_slots, vocab_size), jnp.bool_),
    )


# vocab_argmax's block: a block's maximum is one vectorised reduction.
_ARGMAX_BLOCK = 128


def vocab_argmax(x: jax.Array) -> jax.Array:
    """x f[..., V] -> i32[...]: jnp.argmax over the vocabulary (the first maximum; x holds
    no NaN), in two reductions: the maxima of blocks of _ARGMAX_BLOCK ids,
    then the block that holds the first maximum. XLA:CPU lowers a one-pass argmax over a
    vocabulary to a scalar loop: 6.1 ms for 48 rows of 49152 ids, against 0.23 ms this way."""
    vocab = x.shape[-1]
    blocks = -(-vocab // _ARGMAX_BLOCK)
    if blocks * _ARGMAX_BLOCK != vocab:  # -inf padding never beats a real id, nor ties first
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * _ARGMAX_BLOCK - vocab)],
                    constant_values=-jnp.inf)
    blocked = x.reshape(*x.shape[:-1], blocks, _ARGMAX_BLOCK)
    block = jnp.argmax(jnp.max(blocked, axis=-1), axis=-1)  # [...]
    within = jnp.take_along_axis(blocked, block[..., None, None], axis=-2)[..., 0, :]
    return (block * _ARGMAX_BLOCK + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def vocab_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x f[..., V] -> its k largest values f[..., k] and their ids i32[..., k], ties to the
    lower id (as lax.top_k): k passes of vocab_argmax, each masking out the one before.
    Inside a round program XLA:CPU turned lax.top_k over a vocabulary into a sort of it (23
    of a one-layer DFlash head's 31 ms of drafting on the demo model)."""
    values, indices = [], []
    for _ in range(k):
        best = vocab_argmax(x)
        values.append(jnp.take_along_axis(x, best[..., None], -1)[..., 0])
        indices.append(best)
        x = jnp.where(jnp.arange(x.shape[-1]) == best[..., None], -jnp.inf, x)
    return jnp.stack(values, -1), jnp.stack(indices, -1)


def _drop_negative(index: jax.Array, bound: int) -> jax.Array:
    """Send padding (-1) out of bounds, so scatters with mode='drop' skip it instead of
    wrapping to the last row or column as negative indices otherwise would."""
    return jnp.where(index < 0, bound, index)


def reset_slots(
    state: PenaltyState,
    slots: jax.Array,  # i32[N]; -1 = padding
    prompt_ids: jax.Array,  # i32[N, L]; -1 = padding
    prompt_lens: jax.Array | None = None,  # i32[N]; ids at or past a row's length are ignored
) -> PenaltyState:
    """Start fresh requests in `slots`: zero their counts, mark their prompt tokens as seen."""
    num_slots, vocab = state.seen.shape
    rows = _drop_negative(slots, num_slots)  # i32[N]
    ids = prompt_ids
    if prompt_lens is not None:
        in_prompt = jnp.arange(ids.shape[1])[None, :] < prompt_lens[:, None]
        ids = jnp.where(in_prompt, ids, -1)
    ids = _drop_negative(ids, vocab)  # i32[N, L]
    counts = state.output_counts.at[rows].set(0, mode="drop")
    seen = state.seen.at[rows].set(False, mode="drop")
    seen = seen.at[rows[:, None], ids].set(True, mode="drop")
    return PenaltyState(output_counts=counts, seen=seen)


def record_tokens(
    state: PenaltyState,
    slots: jax.Array,  # i32[S]; -1 = no state
    tokens: jax.Array,  # i32[S]
    valid: jax.Array,  # bool[S]
) -> PenaltyState:
    """Count the tokens just emitted. A slot may repeat (several tokens per request, as in
    speculative decoding): the scatter-add counts each occurrence."""
    num_slots, vocab = state.seen.shape
    rows = _drop_negative(jnp.where(valid, slots, -1), num_slots)  # i32[S]
    cols = _drop_negative(tokens, vocab)  # i32[S]
    return PenaltyState(
        output_counts=state.output_counts.at[rows, cols].add(1, mode="drop"),
        seen=state.seen.at[rows, cols].set(True, mode="drop"),
    )


# ---------------------------------------------------------------- steps 1-2: logits the rows see


def _apply_penalties(
    logits: jax.Array,  # f32[S, V]
    params: SamplingBatch,
    penalties: PenaltyState,
    slots: jax.Array,  # i32[S]
) -> jax.Array:  # f32[S, V]
    has_state = (slots >= 0)[:, None]  # bool[S, 1]
    rows = jnp.maximum(slots, 0)  # a valid gather index; masked by has_state
    counts = jnp.where(has_state, penalties.output_counts[rows], 0).astype(logits.dtype)
    seen = has_state & penalties.seen[rows]  # bool[S, V]
    rp = params.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - params.frequency_penalty[:, None] * counts
    return logits - params.presence_penalty[:, None] * (counts > 0)


def _suppress(logits: jax.Array, suppress_ids: jax.Array) -> jax.Array:
    """logits f32[S, V], suppress_ids i32[S, E] -> f32[S, V] with the banned ids at -inf."""
    rows = jnp.arange(logits.shape[0])[:, None]
    cols = _drop_negative(suppress_ids, logits.shape[1])
    return logits.at[rows, cols].set(-jnp.inf, mode="drop")


def _add_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits f32[S, V], ids i32[S, M], values f32[S, M] -> f32[S, V] with the biases added."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, _drop_negative(ids, logits.shape[1])].add(values, mode="drop")


def unpack_bitmask(words: jax.Array, vocab: int) -> jax.Array:
    """i32[S, W] -> bool[S, vocab]: bit t of word w says whether id 32w + t is allowed."""
    bits = jnp.right_shift(words[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(jnp.bool_)


def any_logit_edits(params: SamplingBatch) -> jax.Array:  # bool[]
    """Whether a logit bias, a grammar or a suppressed id changes any row's logits (penalties
    aside): where none does, a greedy row's token is the argmax of its raw logits."""
    return (jnp.any(params.bias_ids >= 0) | jnp.any(params.suppress_ids >= 0)
            | jnp.any(params.allowed != -1))


def penalised_logits(
    logits: jax.Array,  # f32[S, V]
    params: SamplingBatch,
    penalties: PenaltyState | None,  # None: no row has penalties
    slots: jax.Array | None,  # i32[S]
) -> jax.Array:  # f32[S, V]
    """The logits a row's sampling sees: penalised, biased, then with the ids its grammar
    forbids and its suppressed ids at -inf."""
    logits = logits.astype(jnp.float32)
    if penalties is not None:
        logits = _apply_penalties(logits, params, penalties, slots)
    logits = _add_bias(logits, params.bias_ids, params.bias_values)
    logits = jnp.where(unpack_bitmask(params.allowed, logits.shape[1]), logits, -jnp.inf)
    return _suppress(logits, params.suppress_ids)


# ---------------------------------------------------------------- step 4: the filtered distribution


def _top_k_mask(rank: jax.Array, top_k: jax.Array) -> jax.Array:
    """rank i32[1, V], top_k i32[S] -> bool[S, V]. Off (TOP_K_OFF) keeps every rank, as
    any k < 1 or k >= V does."""
    vocab = rank.shape[1]
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    return rank < k[:, None]


def _top_p_mask(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """probs f32[S, V] sorted descending and renormalised after top-k -> bool[S, V].

    A token is kept when the mass strictly before it is still short of top_p; rank 0 always.
    top_p >= 1 is tested explicitly because the float cumsum of the tail can round past 1."""
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p[:, None]
    keep = keep.at[:, 0].set(True)
    return keep | (top_p[:, None] >= 1.0)


def _min_p_mask(probs: jax.Array, min_p: jax.Array) -> jax.Array:
    """probs f32[S, V] sorted descending -> bool[S, V]; the ratio to p_max ignores scaling."""
    return probs >= min_p[:, None] * probs[:, :1]


def _renormalise(probs: jax.Array, keep: jax.Array) -> jax.Array:
    kept = jnp.where(keep, probs, 0.0)
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


def _sorted_filtered_probs(
    logits: jax.Array,  # f32[S, V], penalised and suppressed
    params: SamplingBatch,
) -> tuple[jax.Array, jax.Array]:  # (f32[S, V] probs by descending rank, i32[S, V] token ids)
    """The distribution a sampling row draws from, in sorted order; greedy rows are garbage."""
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    order = jnp.argsort(scaled, axis=-1, descending=True, stable=True).astype(jnp.int32)
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    rank = jnp.arange(probs.shape[1])[None, :]
    keep = _top_k_mask(rank, params.top_k)
    keep &= _top_p_mask(_renormalise(probs, keep), params.top_p)
    keep &= _min_p_mask(probs, params.min_p)
    return _renormalise(probs, keep), order


def filtered_probs(
    logits: jax.Array,  # f32[S, V]
    params: SamplingBatch,
    penalties: PenaltyState | None,
    slots: jax.Array | None,  # i32[S]
) -> jax.Array:  # f32[S, V]
    """The distribution `sample` draws each row from, in vocabulary order; greedy rows give the
    one-hot of their argmax. (Also the target distribution speculative verification needs.)"""
    penalised = penalised_logits(logits, params, penalties, slots)
    sorted_probs, order = _sorted_filtered_probs(penalised, params)
    rows = jnp.arange(logits.shape[0])[:, None]
    probs = jnp.zeros_like(sorted_probs).at[rows, order].set(sorted_probs)
    greedy = jax.nn.one_hot(vocab_argmax(penalised), logits.shape[1], dtype=probs.dtype)
    return jnp.where((params.temperature == 0)[:, None], greedy, probs)


# ---------------------------------------------------------------- the draw


def row_uniform(seed: jax.Array, position: jax.Array, stream: int = 0) -> jax.Array:
    """u32[], i32[] -> f32[] in [0, 1), a function of (seed, position, stream) alone; streams
    other than 0 give independent draws for the same output position."""
    key = jax.random.fold_in(jax.random.key(seed), position)
    return jax.random.uniform(key if stream == 0 else jax.random.fold_in(key, stream))


def _draw(
    sorted_probs: jax.Array,  # f32[S, V], descending, renormalised
    order: jax.Array,  # i32[S, V]
    seed: jax.Array,  # u32[S]
    position: jax.Array,  # i32[S]
) -> jax.Array:  # i32[S]
    """Inverse CDF: rank r is chosen when cdf[r-1] <= u * total < cdf[r]; zero-mass ranks have
    an empty interval. Scaling u by the total, and capping at the last positive rank, keeps
    float rounding of the cumsum from ever picking a filtered-out token."""
    u = jax.vmap(row_uniform)(seed, position)  # f32[S]
    cdf = jnp.cumsum(sorted_probs, axis=-1)
    rank = jnp.sum(cdf <= u[:, None] * cdf[:, -1:], axis=-1)
    last_kept = jnp.sum(sorted_probs > 0, axis=-1) - 1
    rank = jnp.minimum(rank, last_kept)
    return jnp.take_along_axis(order, rank[:, None], axis=-1)[:, 0]


def _unedited_greedy(params: SamplingBatch, slots: jax.Array | None) -> jax.Array:  # bool[]
    """Whether every row is greedy and nothing edits its logits: the raw argmax decides."""
    no_penalties = True if slots is None else jnp.all(slots < 0)
    return jnp.all(params.temperature == 0) & ~any_logit_edits(params) & no_penalties


def _edited_tokens(penalised: jax.Array, params: SamplingBatch) -> jax.Array:  # i32[S]
    return jax.lax.cond(jnp.all(params.temperature == 0), lambda x, p: vocab_argmax(x),
                        sampled_tokens, penalised, params)


def sampled_tokens(penalised: jax.Array, params: SamplingBatch) -> jax.Array:  # i32[S]
    greedy = vocab_argmax(penalised)
    drawn = _draw(*_sorted_filtered_probs(penalised, params), params.seed, params.position)
    return jnp.where(params.temperature == 0, greedy, drawn)


# How much of the raw log-probabilities a step computes, an i32[] input (so one program
# serves every mix of requests): nothing (zeros: no pass over the vocabulary), each row's
# token's, or those and the top K.
NO_LOGPROBS, TOKEN_LOGPROBS, TOP_LOGPROBS = 0, 1, 2


def logprob_detail(token: bool, top: bool) -> np.int32:
    """The detail a step computes for requests wanting their tokens' and top log-probs."""
    return np.int32(TOP_LOGPROBS if top else TOKEN_LOGPROBS if token else NO_LOGPROBS)


def raw_logprobs(
    logits: jax.Array,  # f32[R, V]
    tokens: jax.Array,  # i32[S]
    detail: jax.Array,  # i32[]: NO_LOGPROBS, TOKEN_LOGPROBS or TOP_LOGPROBS
    k: int,  # static
    rows: jax.Array | None = None,  # i32[S]: the row of logits each token came from
) -> tuple[jax.Array, jax.Array, jax.Array]:  # f32[S], i32[S, K], f32[S, K]
    """The tokens' raw log-probabilities and the top k ids and theirs, as far as `detail`
    asks (zeros beyond), from their rows of `logits` (default: row i for token i, R = S).
    Each is a logit less its row's logsumexp, so a token's value equals its entry among the
    top ones exactly. The rows are read inside the branch taken: none where none is wanted."""
    count = tokens.shape[0]

    def picked(logits: jax.Array) -> jax.Array:  # f32[S, V]
        return logits if rows is None else logits[rows]

    def nothing(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.zeros(count, jnp.float32), jnp.zeros((count, k), jnp.int32),
                jnp.zeros((count, k), jnp.float32))

    def token_only(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        token, _ = _token_logprobs(picked(logits), tokens)
        return token, *nothing(logits)[1:]

    def with_top(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        logits = picked(logits)
        token, lse = _token_logprobs(logits, tokens)
        if k == 0:  # lax.top_k rejects k=0; callers still get arrays of a fixed rank
            return token, *nothing(logits)[1:]
        values, ids = jax.lax.top_k(logits, k)
        return token, ids.astype(jnp.int32), values - lse[:, None]

    return jax.lax.switch(detail, (nothing, token_only, with_top), logits.astype(jnp.float32))


def _token_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits f32[S, V], tokens i32[S] -> each token's logit less its row's logsumexp f32[S],
    and the logsumexps f32[S]."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse, lse


def sample(
    logits: jax.Array,  # f32[S, V]
    params: SamplingBatch,
    penalties: PenaltyState | None,  # None: no row has penalties
    slots: jax.Array | None,  # i32[S]; row -> penalty slot; -1 = none
    *,
    detail: jax.Array | int = TOKEN_LOGPROBS,  # i32[]: which raw log-probabilities to compute
    num_top_logprobs: int = 0,  # K, static
) -> SampleOutput:
    """Next token per row. One compiled function serves every batch, its branches picked at
    run time (lax.cond): a greedy batch whose logits nothing edits (no penalty, bias, grammar
    or suppressed id) takes the raw argmax, skipping the vocabulary-wide edits; an all-greedy
    batch skips the vocabulary sort."""
    tokens = jax.lax.cond(
        _unedited_greedy(params, slots),
        lambda x, *_: vocab_argmax(x.astype(jnp.float32)),
        lambda x, p, state, rows: _edited_tokens(penalised_logits(x, p, state, rows), p),
        logits, params, penalties, slots,  # operands, so host arrays become traced ones
    )
    logprob, top_ids, top_logprobs = raw_logprobs(logits, tokens, jnp.asarray(detail),
                                                  num_top_logprobs)
    return SampleOutput(tokens, logprob, top_ids, top_logprobs)
