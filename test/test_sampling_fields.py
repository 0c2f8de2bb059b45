"""The table of per-row sampling fields against its readers: SamplingBatch has its fields,
SamplingParams and the OpenAI schemas its request parameters, greedy_sampling_batch its neutral
values; SlotTable.join copies what the table says; a neutral row samples the argmax (numpy as
the oracle) and, at temperature 1, leaves the softmax untouched (every filter off)."""

from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pytest

from sgl_jax.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax.layers import sampler
from sgl_jax.layers.sampler import PenaltyState, SamplingBatch
from sgl_jax.model_executor.model_runner import (
    MAX_SUPPRESSED_IDS,
    decode_columns,
    greedy_sampling_batch,
)
from sgl_jax.sampling_fields import REQUEST_PARAMS, ROW_FIELDS, TOP_K_OFF, Source
from sgl_jax.sampling_params import (
    MAX_LOGIT_BIAS,
    MODEL_DEFAULT_FIELDS,
    SamplingParams,
    model_sampling_defaults,
)
from sgl_jax.scheduler.slot_table import SlotTable

ROWS, VOCAB = 5, 70  # a vocabulary that is not a multiple of 32: the last bitmask word is partial


def test_sampling_batch_has_the_tables_fields_in_order():
    assert tuple(SamplingBatch.__dataclass_fields__) == tuple(f.name for f in ROW_FIELDS)


def test_request_parameters_are_sampling_params_and_schema_fields():
    row_names = {f.name for f in ROW_FIELDS}
    params = {f.name: f for f in fields(SamplingParams)}
    # SamplingParams' fields that name a row are exactly the table's request parameters
    assert set(params) & row_names == set(REQUEST_PARAMS)
    assert all(f.source in (Source.PARAMS, Source.REQ) for f in ROW_FIELDS if f.param)
    for schema in (ChatCompletionRequest, CompletionRequest):
        assert set(REQUEST_PARAMS) <= set(schema.model_fields)
    assert MODEL_DEFAULT_FIELDS == ("temperature", "top_p", "top_k", "min_p",
                                    "repetition_penalty")
    for field in ROW_FIELDS:  # neutral values and request defaults are valid requests
        if field.param is not None:
            assert field.param.ok(params[field.name].default), field.name
            assert field.param.ok(field.neutral), field.name


def test_greedy_sampling_batch_is_the_tables_neutral_rows():
    batch = greedy_sampling_batch(ROWS, VOCAB)
    widths = {"E": MAX_SUPPRESSED_IDS, "M": MAX_LOGIT_BIAS, "W": -(-VOCAB // 32)}
    for field in ROW_FIELDS:
        array = getattr(batch, field.name)
        shape = (ROWS,) if field.width is None else (ROWS, widths[field.width])
        assert (array.dtype, array.shape) == (np.dtype(field.dtype), shape), field.name
        assert (array == field.neutral).all(), field.name


def test_top_k_off_has_one_spelling():
    assert SamplingParams().top_k == TOP_K_OFF
    assert greedy_sampling_batch(1, VOCAB).top_k[0] == TOP_K_OFF
    assert model_sampling_defaults({"top_k": 0}) == {"top_k": TOP_K_OFF}  # transformers' off
    with pytest.raises(ValueError, match=r"top_k must be -1 \(off\) or >= 1"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=0)


# The messages SamplingParams gave before its checks were read from the table.
BAD_PARAMS = [
    ({"temperature": -0.1}, "temperature must be a number >= 0, got -0.1"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_k": 0}, "top_k must be -1 (off) or an integer in [1, 2**31), got 0"),
    ({"top_k": 2.0}, "top_k must be -1 (off) or an integer in [1, 2**31), got 2.0"),
    ({"top_k": 2**31}, "top_k must be -1 (off) or an integer in [1, 2**31), got 2147483648"),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3"),
    ({"presence_penalty": True}, "presence_penalty must be in [-2, 2], got True"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2], got 0.0"),
    ({"seed": 2**32}, "seed must be an integer in [0, 2**32), got 4294967296"),
]


@pytest.mark.parametrize("kwargs, message", BAD_PARAMS)
def test_row_parameters_are_refused_as_before(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_join_copies_what_the_table_says():
    table = SlotTable(num_slots=3, columns=decode_columns(2, 16), vocab_size=VOCAB)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                            frequency_penalty=0.5, presence_penalty=-0.5,
                            repetition_penalty=1.2, seed=11, logit_bias=((3, 2.0),))
    req = SimpleNamespace(slot=1, params=params, seed=11, stop_ids=lambda: frozenset({7}))
    table.join(req)
    for field in ROW_FIELDS:
        got = getattr(table.sampling, field.name)[1]
        if field.source is Source.PARAMS:
            assert got == np.asarray(getattr(params, field.name), field.dtype), field.name
    assert table.sampling.seed[1] == 11
    assert list(table.sampling.suppress_ids[1, :2]) == [7, -1]
    assert list(table.sampling.bias_ids[1, :2]) == [3, -1]
    assert list(table.sampling.bias_values[1, :2]) == [2.0, 0.0]


def _sample(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    rows, vocab = logits.shape
    state = PenaltyState(np.zeros((1, vocab), np.int32), np.zeros((1, vocab), bool))
    return sampler.sample(logits, batch, state, np.full(rows, -1, np.int32))


def test_a_neutral_row_samples_the_argmax():
    logits = np.random.default_rng(0).normal(size=(ROWS, VOCAB)).astype(np.float32) * 4
    tokens = _sample(logits, greedy_sampling_batch(ROWS, VOCAB)).tokens
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(logits, axis=-1))


def test_neutral_filters_leave_the_softmax_untouched():
    """A neutral row at temperature 1 draws from the model's own distribution: top-k, top-p
    and min-p at their neutral values filter nothing."""
    logits = np.random.default_rng(1).normal(size=(ROWS, VOCAB)).astype(np.float32)
    batch = greedy_sampling_batch(ROWS, VOCAB)
    batch.temperature[:] = 1.0
    state = PenaltyState(np.zeros((1, VOCAB), np.int32), np.zeros((1, VOCAB), bool))
    probs = sampler.filtered_probs(logits, batch, state, np.full(ROWS, -1, np.int32))
    expected = np.exp(logits - logits.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(probs), expected / expected.sum(axis=-1, keepdims=True),
                               rtol=1e-5, atol=1e-7)
