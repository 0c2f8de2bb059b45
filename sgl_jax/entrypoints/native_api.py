"""SGLang-style native endpoints: /generate takes the Engine's own arguments, in SGLang's
request shape (GenerateReqInput), so SGLang's router and clients can call it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Annotated, Any

import numpy as np
from pydantic import Field, field_validator, model_validator

from sgl_jax.entrypoints.engine import Engine
from sgl_jax.entrypoints.openai.protocol import (
    SGLANG_GENERATE_DEFAULT_ONLY,
    SGLANG_SAMPLING_DEFAULT_ONLY,
    FieldError,
    StrictSchema,
    drop_unused,
)
from sgl_jax.entrypoints.openai.serving import sse
from sgl_jax.models.loader import read_hf_config

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
TokenText = Callable[[int], str]


class GenerateRequest(StrictSchema):
    unused_fields = SGLANG_GENERATE_DEFAULT_ONLY
    null_means_default = ("return_logprob", "top_logprobs_num")  # optional in SGLang

    model: str | None = None  # SGLang's router sends it (null unless the client named one)
    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False  # logprob entries gain the token's text, third

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("pass exactly one of text and input_ids")
        return self

    @field_validator("sampling_params")
    @classmethod
    def _sglang_sampling_params(cls, params: Any) -> Any:
        if isinstance(params, list):
            return [_engine_sampling_params(p) for p in params]
        return None if params is None else _engine_sampling_params(params)

    def engine_kwargs(self) -> dict[str, Any]:
        return {"prompt": self.text, "input_ids": self.input_ids,
                "sampling_params": self.sampling_params, "stream": self.stream,
                "return_logprob": self.return_logprob,
                "top_logprobs_num": self.top_logprobs_num}


def _engine_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling parameters as the Engine names them: null means the default (but an
    unbounded max_new_tokens is refused by the Engine), sampling_seed is `seed`, and SGLang's
    keys we do not implement are accepted only unused."""
    params = drop_unused(params, SGLANG_SAMPLING_DEFAULT_ONLY)
    params = {k: v for k, v in params.items() if v is not None or k == "max_new_tokens"}
    if "sampling_seed" in params:
        if "seed" in params:
            raise FieldError("sampling_seed", "pass seed or sampling_seed, not both")
        params["seed"] = params.pop("sampling_seed")
    return params


async def generate_stream(chunks: AsyncIterator[dict[str, Any]],
                          token_text: TokenText | None = None) -> AsyncIterator[str]:
    """Each event is one Engine chunk (new text and ids of one output); then [DONE]."""
    async with aclosing(chunks):
        async for chunk in chunks:
            yield sse(chunk if token_text is None else with_token_texts(chunk, token_text))
    yield sse("[DONE]")


def with_token_texts(output: dict[str, Any] | list[dict[str, Any]], token_text: TokenText
                     ) -> dict[str, Any] | list[dict[str, Any]]:
    """An Engine output (or list) whose logprob entries (logprob, id) become SGLang's
    (logprob, id, text), as with return_text_in_logprobs."""
    if isinstance(output, list):
        return [with_token_texts(one, token_text) for one in output]
    meta = dict(output["meta_info"])
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = [(lp, t, token_text(t))
                                         for lp, t in meta["output_token_logprobs"]]
        meta["output_top_logprobs"] = [[(lp, t, token_text(t)) for lp, t in top]
                                       for top in meta["output_top_logprobs"]]
    return {**output, "meta_info": meta}


def model_info(engine: Engine, served_model_name: str) -> dict[str, Any]:
    """/model_info: SGLang's keys (its router reads model_path, tokenizer_path, is_generation,
    model_type and architectures), then ours."""
    config = engine.model.config
    return {
        "model_path": engine.server_args.model_path,
        "tokenizer_path": engine.server_args.tokenizer_path or engine.server_args.model_path,
        "served_model_name": served_model_name,
        "is_generation": True,
        "model_type": read_hf_config(engine.model.model_dir).get("model_type"),
        "architectures": [config.architecture],
        "architecture": config.architecture,
        "context_length": engine.context_length,
        "vocab_size": config.vocab_size,
        "dtype": np.dtype(engine.model.dtype).name,  # "float32", not "<class 'jax...'>"
    }
