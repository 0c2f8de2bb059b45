"""The front door: requests in the Engine's terms (prompts or token ids, sampling dicts) made
into scheduler requests, checked before anything runs.

It owns what turning a request into tokens takes (the tokenizer, the EOS ids, grammars) and
what a request gets assigned (its id, its seed, its n copies).
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sgl_jax.grammar import GrammarCompiler
from sgl_jax.model_executor.model_runner import MAX_SUPPRESSED_IDS, MAX_TOP_LOGPROBS
from sgl_jax.models.config import ModelConfig
from sgl_jax.sampling_params import SamplingParams, model_sampling_defaults
from sgl_jax.scheduler.req import Req
from sgl_jax.server_args import ServerArgs
from sgl_jax.tokenizer import load_tokenizer
from sgl_jax.tokenizer.detokenizer import IncrementalDetokenizer

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
Params = dict[str, Any] | list[dict[str, Any]] | None
_SEED_STRIDE = 0x9E3779B1  # spreads the n samples of one seeded request over distinct seeds


@dataclass(frozen=True)
class RequestLimits:
    """What the runtime can serve a request."""

    context_length: int
    max_request_tokens: int  # prompt + generated tokens: the context or the KV pool
    speculative: bool  # penalties are refused with speculative decoding


class FrontDoor:
    def __init__(self, args: ServerArgs, config: ModelConfig, model_dir: str,
                 limits: RequestLimits):
        self.config = config
        self.limits = limits
        self.tokenizer = load_tokenizer(args.tokenizer_path or model_dir,
                                        trust_remote_code=args.trust_remote_code)
        generation_config = _generation_config(model_dir)
        self.eos_ids = self._collect_eos_ids(generation_config)
        # What the model's generation config recommends, for the OpenAI endpoints (the
        # Engine's own calls keep SamplingParams' defaults, as SGLang's do).
        self.model_sampling_defaults = model_sampling_defaults(generation_config)
        self.grammars = GrammarCompiler(self.tokenizer, config.vocab_size, self.eos_ids)
        self._rng = np.random.default_rng(args.random_seed)
        self._rng_lock = threading.Lock()  # requests are made on callers' threads
        self._request_ids = itertools.count()

    def make_requests(self, prompt: Prompt, sampling_params: Params, input_ids: InputIds,
                      return_logprob: bool, top_logprobs_num: int) -> tuple[list[Req], bool]:
        """The scheduler requests of one call (n per prompt), and whether the call gave a
        single prompt; a ValueError names the first problem."""
        token_batch, single = self._token_batch(prompt, input_ids)
        params = self._params_batch(sampling_params, len(token_batch))
        if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {top_logprobs_num}")
        reqs = []
        for ids, p in zip(token_batch, params, strict=True):
            self._check_request(ids, p)
            base_seed = p.seed if p.seed is not None else self._draw_seed()
            for i in range(p.n):
                seed = (base_seed + i * _SEED_STRIDE) % 2**32
                req = self._new_req(ids, p, seed, return_logprob, top_logprobs_num)
                req.grammar = p.grammar and self.grammars.constraint(*p.grammar)
                reqs.append(req)
        return reqs, single

    def _draw_seed(self) -> int:
        with self._rng_lock:
            return int(self._rng.integers(2**32))

    def _new_req(self, ids, params, seed, return_logprob, top_logprobs_num) -> Req:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_ids=ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop_strings=params.stop, include_stop_string=params.no_stop_trim,
        )
        return Req(
            rid=str(next(self._request_ids)), prompt_ids=list(ids), params=params, seed=seed,
            eos_ids=self.eos_ids, context_len=self.limits.context_length,
            detokenizer=detokenizer, return_logprob=return_logprob or top_logprobs_num > 0,
            top_logprobs_num=top_logprobs_num,
        )

    def _token_batch(self, prompt: Prompt, input_ids: InputIds) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            return [self.tokenizer(t).input_ids for t in texts], single
        single = bool(input_ids) and all(isinstance(t, (int, np.integer)) for t in input_ids)
        return ([list(input_ids)] if single else [list(ids) for ids in input_ids]), single

    @staticmethod
    def _params_batch(sampling_params: Params, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {n} prompts; pass one "
                    "dict for all or one per prompt"
                )
            return [SamplingParams.from_dict(p) for p in sampling_params]
        return [SamplingParams.from_dict(sampling_params)] * n

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        vocab, limits = self.config.vocab_size, self.limits
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        bad += [t for t in params.stop_token_ids if t >= vocab]
        bad += [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if limits.speculative and params.uses_penalties:
            raise ValueError("frequency_penalty, presence_penalty and repetition_penalty are "
                             "not supported with speculative decoding; leave them at their "
                             "defaults or start the server without --speculative-algorithm")
        total = len(ids) + params.max_new_tokens
        if total > limits.context_length:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                f"{total} exceeds the context length ({limits.context_length})"
            )
        if total > limits.max_request_tokens:
            raise ValueError(f"prompt + max_new_tokens = {total} tokens exceeds the KV pool "
                             f"({limits.max_request_tokens} tokens); raise max_total_tokens "
                             "or mem_fraction_static")
        stop_ids = (frozenset() if params.ignore_eos else self.eos_ids) | set(params.stop_token_ids)
        if params.min_new_tokens and len(stop_ids) > MAX_SUPPRESSED_IDS:
            raise ValueError(f"min_new_tokens supports at most {MAX_SUPPRESSED_IDS} EOS + stop "
                             f"token ids, got {len(stop_ids)}")

    def _collect_eos_ids(self, generation_config: dict[str, Any]) -> frozenset[int]:
        """EOS ids from config.json, generation_config.json and the tokenizer, together."""
        ids = set(self.config.eos_token_ids)
        eos = generation_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)


def _generation_config(model_dir: str) -> dict[str, Any]:
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
