"""Per-request sampling parameters, validated before anything runs; errors name the parameter."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from typing import Any

from sgl_jax.grammar import GRAMMAR_KINDS
from sgl_jax.sampling_fields import (
    MODEL_DEFAULT_FIELDS,
    ROW_FIELDS,
    TOP_K_OFF,
    is_int,
    is_number,
)

logger = logging.getLogger(__name__)

MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
LOGIT_BIAS_RANGE = 100.0  # biases are clamped to [-100, 100], as OpenAI's range


@dataclass(frozen=True)
class SamplingParams:
    """A request's parameters. Those that set a sampling row directly (temperature to seed)
    are checked against their rules in sgl_jax.sampling_fields.ROW_FIELDS."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = TOP_K_OFF
    min_p: float = 0.0
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # CTRL / transformers semantics, over prompt and output
    seed: int | None = None  # None: drawn from the engine's random generator
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    # token id -> bias added to its logit before sampling (greedy included)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # At most one grammar: the output must match it (sgl_jax.grammar compiles it).
    json_schema: str | None = None  # a JSON schema, as a JSON string
    regex: str | None = None
    ebnf: str | None = None  # GBNF / EBNF with a `root` rule
    # Speculative decoding, per request (our extension; a server without it ignores both,
    # as both only take speculation away): false drafts nothing for this request; an integer
    # caps its draft depth below the server's --speculative-num-steps.
    speculative: bool = True
    speculative_num_steps: int | None = None

    def __post_init__(self) -> None:
        for check in _CHECKS:
            check(self)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def max_draft_depth(self) -> int | None:
        """The deepest draft this request takes (0: none), None for the server's."""
        return 0 if not self.speculative else self.speculative_num_steps

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, or None."""
        named = _grammars(self)
        return (named[0], getattr(self, named[0])) if named else None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        params = dict(params or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"unsupported sampling parameter(s) {unknown}; supported: {sorted(known)}"
            )
        if isinstance(params.get("stop"), str):
            params["stop"] = (params["stop"],)
        for name in ("stop", "stop_token_ids"):
            if params.get(name) is None:
                params.pop(name, None)
            elif not isinstance(params[name], (list, tuple)):
                raise ValueError(f"{name} must be a list, got {params[name]!r}")
            else:
                params[name] = tuple(params[name])
        if isinstance(params.get("json_schema"), dict):  # a schema given as an object
            params["json_schema"] = json.dumps(params["json_schema"])
        if params.get("logit_bias") is not None:
            params["logit_bias"] = _logit_bias_pairs(params["logit_bias"])
        else:
            params.pop("logit_bias", None)
        return cls(**params)


def _logit_bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """{token id (an int or its decimal string, as JSON keys are): bias} -> sorted pairs, each
    bias clamped to [-100, 100]."""
    if isinstance(bias, dict):
        bias = bias.items()
    pairs = []
    for token, value in bias:
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        _require(is_int(token) and token >= 0, "logit_bias", "a map from token ids to numbers",
                 token)
        _require(is_number(value), "logit_bias", "a map from token ids to numbers", value)
        pairs.append((token, min(max(float(value), -LOGIT_BIAS_RANGE), LOGIT_BIAS_RANGE)))
    return tuple(sorted(pairs))


def model_sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The defaults a model's generation config sets for MODEL_DEFAULT_FIELDS. transformers'
    `top_k` 0 (off) is TOP_K_OFF here; a value these parameters would refuse is left out, with a
    warning, so the model still serves. `do_sample` is not read (nor by SGLang or vLLM)."""
    defaults = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = generation_config.get(name)
        if value is None:
            continue
        value = TOP_K_OFF if name == "top_k" and value == 0 else value
        try:
            SamplingParams(**{name: value})
        except ValueError as exc:
            logger.warning("generation_config.json: %s is ignored (%s)", name, exc)
            continue
        defaults[name] = value
    return defaults


def _require(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def _check_lengths(p: SamplingParams) -> None:
    _require(is_int(p.max_new_tokens) and p.max_new_tokens >= 0, "max_new_tokens",
             "an integer >= 0", p.max_new_tokens)
    _require(is_int(p.min_new_tokens) and 0 <= p.min_new_tokens <= p.max_new_tokens,
             "min_new_tokens", "an integer between 0 and max_new_tokens", p.min_new_tokens)
    _require(is_int(p.n) and 1 <= p.n <= 128, "n", "an integer between 1 and 128", p.n)


def _check_row_params(p: SamplingParams) -> None:
    """The parameters that set a sampling row, each against its rule in the table."""
    for field in ROW_FIELDS:
        if field.param is not None:
            value = getattr(p, field.name)
            _require(field.param.ok(value), field.name, field.param.rule, value)


def _check_stops(p: SamplingParams) -> None:
    _require(all(isinstance(s, str) and s for s in p.stop), "stop",
             "a string or a list of non-empty strings", p.stop)
    _require(all(is_int(t) and t >= 0 for t in p.stop_token_ids), "stop_token_ids",
             "a list of token ids >= 0", p.stop_token_ids)


def _grammars(p: SamplingParams) -> list[str]:
    """The grammar fields the request sets."""
    return [kind for kind in GRAMMAR_KINDS if getattr(p, kind) is not None]


def _check_bias_and_grammar(p: SamplingParams) -> None:
    _require(len(p.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
             f"at most {MAX_LOGIT_BIAS} entries", f"{len(p.logit_bias)} entries")
    _require(len({t for t, _ in p.logit_bias}) == len(p.logit_bias), "logit_bias",
             "one bias per token id", p.logit_bias)
    grammars = _grammars(p)
    _require(len(grammars) <= 1, "json_schema, regex and ebnf", "used one at a time", grammars)
    for kind in grammars:
        _require(isinstance(getattr(p, kind), str), kind, "a string", getattr(p, kind))


def _check_speculative(p: SamplingParams) -> None:
    _require(isinstance(p.speculative, bool), "speculative", "true or false", p.speculative)
    _require(p.speculative_num_steps is None or (is_int(p.speculative_num_steps)
                                                 and p.speculative_num_steps >= 1),
             "speculative_num_steps", "an integer >= 1 (or null: the server's)",
             p.speculative_num_steps)


_CHECKS = (_check_lengths, _check_row_params, _check_stops, _check_bias_and_grammar,
           _check_speculative)
