"""The offline Python API: `sgl_jax.Engine(model_path=..., **server_args).generate(...)`."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

from sgl_jax.mem_cache.page_allocator import PageAllocator
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models.loader import load_model
from sgl_jax.sampling_params import SamplingParams
from sgl_jax.scheduler.req import Req
from sgl_jax.scheduler.static_batch import run_static_batch
from sgl_jax.server_args import ServerArgs
from sgl_jax.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
Params = dict[str, Any] | list[dict[str, Any]] | None


class Engine:
    """Loads a model once and generates for one prompt or a batch of prompts."""

    def __init__(self, model_path: str | None = None, **server_args: Any):
        if model_path is None:
            raise ValueError("Engine needs model_path (a local directory or a Hugging Face id)")
        self.server_args = ServerArgs(model_path=model_path, **server_args)
        args = self.server_args
        self.model = load_model(model_path, dtype=args.dtype, revision=args.revision)
        self.tokenizer = load_tokenizer(args.tokenizer_path or self.model.model_dir)
        self.context_length = args.context_length or self.model.config.max_position_embeddings
        self._allocator = PageAllocator(args.num_pages)
        self._runner: ModelRunner | None = ModelRunner(
            self.model,
            num_pages=args.num_pages,
            page_size=args.page_size,
            attention_backend=args.attention_backend,
        )
        self._eos_ids = self._collect_eos_ids()
        self._request_ids = itertools.count()
        logger.info("Engine ready: %s, %s", self.model.config.architecture, args)

    def generate(
        self, prompt: Prompt = None, sampling_params: Params = None, input_ids: InputIds = None
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """One prompt (a str or a list of ids) gives a dict; a batch gives a list of dicts."""
        if self._runner is None:
            raise RuntimeError("the engine has been shut down")
        batch_ids, single = self._token_batch(prompt, input_ids)
        params = self._params_batch(sampling_params, len(batch_ids))
        reqs = [
            Req(str(next(self._request_ids)), ids, p)
            for ids, p in zip(batch_ids, params, strict=True)
        ]
        for req in reqs:
            self._check_request(req)
        run_static_batch(self._runner, self._allocator, reqs, self._eos_ids)
        outputs = [self._output(req) for req in reqs]
        return outputs[0] if single else outputs

    def shutdown(self) -> None:
        """Release the KV cache and weights; the engine cannot generate afterwards."""
        self._runner = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _token_batch(self, prompt: Prompt, input_ids: InputIds) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            return [self.tokenizer(t).input_ids for t in texts], single
        single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
        return ([list(input_ids)] if single else [list(ids) for ids in input_ids]), single

    def _params_batch(self, sampling_params: Params, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {n} prompts; pass one "
                    "dict for all or one per prompt"
                )
            return [SamplingParams.from_dict(p) for p in sampling_params]
        return [SamplingParams.from_dict(sampling_params)] * n

    def _check_request(self, req: Req) -> None:
        vocab = self.model.config.vocab_size
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if total > self.context_length:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.params.max_new_tokens}) = {total} exceeds the context length "
                f"({self.context_length})"
            )

    def _output(self, req: Req) -> dict[str, Any]:
        return {
            "text": self.tokenizer.decode(req.output_ids, skip_special_tokens=True),
            "output_ids": req.output_ids,
            "meta_info": {
                "id": req.rid,
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": len(req.output_ids),
                "finish_reason": req.finish_reason,
            },
        }

    def _collect_eos_ids(self) -> frozenset[int]:
        """EOS ids from config.json, generation_config.json and the tokenizer, together."""
        ids = set(self.model.config.eos_token_ids)
        generation_config = Path(self.model.model_dir) / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)
