"""SGLang-style native endpoints: /generate takes the Engine's own arguments."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sgl_jax.entrypoints.engine import Engine
from sgl_jax.entrypoints.openai.serving import sse

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("pass exactly one of text and input_ids")
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        return {"prompt": self.text, "input_ids": self.input_ids,
                "sampling_params": self.sampling_params, "stream": self.stream,
                "return_logprob": self.return_logprob,
                "top_logprobs_num": self.top_logprobs_num}


async def generate_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Each event is one Engine chunk (new text and ids of one output); then [DONE]."""
    async with aclosing(chunks):
        async for chunk in chunks:
            yield sse(chunk)
    yield sse("[DONE]")


def model_info(engine: Engine, served_model_name: str) -> dict[str, Any]:
    config = engine.model.config
    return {
        "model_path": engine.server_args.model_path,
        "tokenizer_path": engine.server_args.tokenizer_path or engine.server_args.model_path,
        "served_model_name": served_model_name,
        "architecture": config.architecture,
        "is_generation": True,
        "context_length": engine.context_length,
        "vocab_size": config.vocab_size,
        "dtype": np.dtype(engine.model.dtype).name,  # "float32", not "<class 'jax...'>"
    }
