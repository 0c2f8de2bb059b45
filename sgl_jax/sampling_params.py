"""Per-request sampling parameters, validated before anything runs; errors name the parameter."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from typing import Any

from sgl_jax.grammar import GRAMMAR_KINDS

logger = logging.getLogger(__name__)

MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
LOGIT_BIAS_RANGE = 100.0  # biases are clamped to [-100, 100], as OpenAI's range


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
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
        _require(_is_int(token) and token >= 0, "logit_bias", "a map from token ids to numbers",
                 token)
        _require(_is_number(value), "logit_bias", "a map from token ids to numbers", value)
        pairs.append((token, min(max(float(value), -LOGIT_BIAS_RANGE), LOGIT_BIAS_RANGE)))
    return tuple(sorted(pairs))


# The sampling fields a model's generation_config.json may give defaults for, as SGLang's
# and vLLM's OpenAI servers read them.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The defaults a model's generation config sets for MODEL_DEFAULT_FIELDS. transformers'
    `top_k` 0 (off) is -1 here; a value these parameters would refuse is left out, with a
    warning, so the model still serves. `do_sample` is not read (nor by SGLang or vLLM)."""
    defaults = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = generation_config.get(name)
        if value is None:
            continue
        value = -1 if name == "top_k" and value == 0 else value
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_lengths(p: SamplingParams) -> None:
    _require(_is_int(p.max_new_tokens) and p.max_new_tokens >= 0, "max_new_tokens",
             "an integer >= 0", p.max_new_tokens)
    _require(_is_int(p.min_new_tokens) and 0 <= p.min_new_tokens <= p.max_new_tokens,
             "min_new_tokens", "an integer between 0 and max_new_tokens", p.min_new_tokens)
    _require(_is_int(p.n) and 1 <= p.n <= 128, "n", "an integer between 1 and 128", p.n)


def _check_filters(p: SamplingParams) -> None:
    _require(_is_number(p.temperature) and p.temperature >= 0, "temperature", "a number >= 0",
             p.temperature)
    _require(_is_number(p.top_p) and 0 < p.top_p <= 1, "top_p", "in (0, 1]", p.top_p)
    _require(_is_int(p.top_k) and (p.top_k == -1 or p.top_k >= 1), "top_k",
             "-1 (off) or an integer >= 1", p.top_k)
    _require(_is_number(p.min_p) and 0 <= p.min_p <= 1, "min_p", "in [0, 1]", p.min_p)


def _check_penalties(p: SamplingParams) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(p, name)
        _require(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
    _require(_is_number(p.repetition_penalty) and 0 < p.repetition_penalty <= 2,
             "repetition_penalty", "in (0, 2]", p.repetition_penalty)


def _check_stops(p: SamplingParams) -> None:
    _require(all(isinstance(s, str) and s for s in p.stop), "stop",
             "a string or a list of non-empty strings", p.stop)
    _require(all(_is_int(t) and t >= 0 for t in p.stop_token_ids), "stop_token_ids",
             "a list of token ids >= 0", p.stop_token_ids)
    _require(p.seed is None or (_is_int(p.seed) and 0 <= p.seed < 2**32), "seed",
             "an integer in [0, 2**32)", p.seed)


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


_CHECKS = (_check_lengths, _check_filters, _check_penalties, _check_stops,
           _check_bias_and_grammar)
