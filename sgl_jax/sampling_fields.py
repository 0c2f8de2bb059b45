"""The per-row sampling fields, in one table: what each row of a step's `SamplingBatch` holds.

A row of ROW_FIELDS gives a field's name, its host dtype, its neutral value (that of a greedy
row without penalties, biases or grammar: padding rows and warm-up), how the sampler reads it,
where a request's value comes from, and, for a field a request sets by the same name, the rule
that parameter must meet. Everything else is read from this table:

- `SamplingBatch` (layers/sampler.py) has one field per row, in this order;
- `SamplingBatch.neutral` (behind `greedy_sampling_batch`) fills rows with the neutral values;
- `SlotTable.join` copies the fields whose source is a request's parameter or attribute;
- `SamplingParams` checks its parameters against the rules, and MODEL_DEFAULT_FIELDS names
  those a model's generation config may default;
- the OpenAI schemas pass REQUEST_PARAMS on to the engine.

The table is numpy only, so request validation never imports JAX.

Shapes: S rows; a 2-D field is one of these widths wide, given by whoever builds a batch:
  E  ids a row can suppress (MAX_SUPPRESSED_IDS): EOS and stop ids while min_new_tokens holds
  M  logit_bias entries (MAX_LOGIT_BIAS)
  W  grammar bitmask words, ceil(V / 32)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

# The one spelling of "top-k off", in requests, SamplingParams and batches alike (the sampler
# also keeps every token for any k < 1 or k >= V, but nothing here writes those).
TOP_K_OFF = -1


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Param:
    """The request parameter (SamplingParams field) of a row field's name."""

    rule: str  # ends "<name> must be ..." in the error message
    ok: Callable[[Any], bool]  # whether a value meets the rule
    model_default: bool = False  # a model's generation_config.json may give its default


class Source(Enum):
    """Where a row's value comes from."""

    PARAMS = "the request's SamplingParams field of the same name, copied when it joins"
    REQ = "the Req attribute of the same name, copied when the request joins"
    JOIN = "built when the request joins, from other parameters"
    STEP = "written for each step"


@dataclass(frozen=True)
class RowField:
    name: str
    dtype: type[np.generic]
    neutral: int | float
    source: Source
    meaning: str  # how the sampler reads a value
    param: Param | None = None  # the request parameter of this name, if one sets the row
    width: str | None = None  # a 2-D field's width (E, M or W); None: one value per row

    @property
    def shape(self) -> str:
        """The field's host array, as comments write it: 'f32[S]', 'i32[S, E]'."""
        dtype = np.dtype(self.dtype)
        dims = "S" if self.width is None else f"S, {self.width}"
        return f"{dtype.kind}{dtype.itemsize * 8}[{dims}]"


ROW_FIELDS: tuple[RowField, ...] = (
    RowField("temperature", np.float32, 0.0, Source.PARAMS, "0 = greedy",
             Param("a number >= 0", lambda v: is_number(v) and v >= 0, model_default=True)),
    RowField("top_p", np.float32, 1.0, Source.PARAMS, ">= 1 = off",
             Param("in (0, 1]", lambda v: is_number(v) and 0 < v <= 1, model_default=True)),
    RowField("top_k", np.int32, TOP_K_OFF, Source.PARAMS, f"{TOP_K_OFF} = off",
             Param(f"{TOP_K_OFF} (off) or an integer in [1, 2**31)",  # an int32 row
                   lambda v: is_int(v) and (v == TOP_K_OFF or 1 <= v < 2**31),
                   model_default=True)),
    RowField("min_p", np.float32, 0.0, Source.PARAMS, "0 = off; drop p < min_p * p_max",
             Param("in [0, 1]", lambda v: is_number(v) and 0 <= v <= 1, model_default=True)),
    RowField("frequency_penalty", np.float32, 0.0, Source.PARAMS,
             "logit -= fp * count(token in output)",
             Param("in [-2, 2]", lambda v: is_number(v) and -2 <= v <= 2)),
    RowField("presence_penalty", np.float32, 0.0, Source.PARAMS,
             "logit -= pp * (count(token in output) > 0)",
             Param("in [-2, 2]", lambda v: is_number(v) and -2 <= v <= 2)),
    RowField("repetition_penalty", np.float32, 1.0, Source.PARAMS,
             "1 = off; over prompt and output tokens",
             Param("in (0, 2]", lambda v: is_number(v) and 0 < v <= 2, model_default=True)),
    # A request may leave its seed None; its row then holds the one the engine drew (Req.seed).
    RowField("seed", np.uint32, 0, Source.REQ, "a request's draws depend on its seed alone",
             Param("an integer in [0, 2**32)",
                   lambda v: v is None or (is_int(v) and 0 <= v < 2**32))),
    RowField("position", np.int32, 0, Source.STEP,
             "index in the request's output of the token being sampled"),
    RowField("suppress_ids", np.int32, -1, Source.JOIN,
             "ids banned at this step (EOS and stop ids while min_new_tokens holds); "
             "-1 = padding", width="E"),
    RowField("bias_ids", np.int32, -1, Source.JOIN, "logit_bias token ids; -1 = padding",
             width="M"),
    RowField("bias_values", np.float32, 0.0, Source.JOIN, "added to those ids' logits",
             width="M"),
    RowField("allowed", np.int32, -1, Source.STEP,
             "grammar bitmask: bit t of word w allows id 32w + t; -1 = every id", width="W"),
)

# The request parameters that set a row directly, in table order.
REQUEST_PARAMS = tuple(f.name for f in ROW_FIELDS if f.param is not None)
# Those a model's generation_config.json may give defaults for, as SGLang's and vLLM's OpenAI
# servers read them.
MODEL_DEFAULT_FIELDS = tuple(f.name for f in ROW_FIELDS if f.param and f.param.model_default)


def neutral_rows(rows: int, widths: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Host arrays of `rows` neutral rows, one per field; `widths` maps E, M and W to sizes."""
    return {f.name: np.full((rows,) if f.width is None else (rows, widths[f.width]),
                            f.neutral, f.dtype)
            for f in ROW_FIELDS}
