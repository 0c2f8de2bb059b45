"""OpenAI chat and text completions on top of the Engine: prompt building, tools, limits,
responses and server-sent-event streams."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from sgl_jax.entrypoints.engine import Engine
from sgl_jax.entrypoints.openai.chat_output import ChatOutput
from sgl_jax.entrypoints.openai.errors import APIError, bad_request
from sgl_jax.entrypoints.openai.protocol import (
    DEFAULT_MODEL,
    ChatCompletionRequest,
    CompletionRequest,
)
from sgl_jax.grammar import GrammarError
from sgl_jax.server_args import HttpConfig
from sgl_jax.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from sgl_jax.tokenizer.reasoning import ReasoningParser
from sgl_jax.tokenizer.token_bytes import TokenBytes

logger = logging.getLogger(__name__)

# Accepted in place of the served name: SGLang's default, which its clients send, and what
# SGLang's router sends for a request that named no model.
MODEL_ALIASES = (DEFAULT_MODEL, "unknown")
# A grammar that no token could continue ends the output as a stop; /generate says why.
_FINISH_REASONS = {"stop": "stop", "length": "length", "grammar_error": "stop"}


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class OpenAIServing:
    def __init__(self, engine: Engine, config: HttpConfig, chat_template: ChatTemplate):
        self.engine = engine
        self.config = config
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer
        self.context_length = engine.context_length
        self.sampling_defaults = (engine.model_sampling_defaults
                                  if config.sampling_defaults == "model" else {})
        if self.sampling_defaults:
            logger.info("OpenAI requests default to the model's generation config: %s",
                        self.sampling_defaults)
        self._token_texts: dict[int, str] = {}
        self._token_bytes = TokenBytes(engine.tokenizer)
        # Tools work without a flag: the format comes from the chat template when it
        # teaches one, else the built-in one is taught in the system message.
        self.tools = chat_template.choose_tool_format(config.tool_call_parser)
        logger.info("Tool calls: %s format (from %s; tools shown by the %s)",
                    self.tools.format.name, self.tools.source,
                    self.tools.info()["tools_shown_by"])

    # ------------------------------------------------------------------ models

    def check_model(self, name: str) -> None:
        if name != self.config.served_model_name and name not in MODEL_ALIASES:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.config.served_model_name}'",
                           param="model", code="model_not_found")

    def models(self) -> dict[str, Any]:
        card = {"id": self.config.served_model_name, "object": "model",
                "created": int(self.engine.started_at), "owned_by": "sgl-jax",
                "root": self.engine.server_args.model_path,
                "max_model_len": self.context_length}
        return {"object": "list", "data": [card]}

    # ------------------------------------------------------------------ chat completions

    async def chat(self, request: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(request.model)
        prompt_ids = self._chat_prompt(request)
        max_tokens = self._max_tokens([len(prompt_ids)], request.requested_max_tokens,
                                      "max_tokens", "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        _log_request(rid, request.user, len(prompt_ids))
        result = await self._generate(
            input_ids=prompt_ids,
            sampling_params={**request.sampling_params(max_tokens, self.sampling_defaults),
                             **self._tool_grammar(request)},
            stream=request.stream, return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs or 0,
            grammar_field="tools" if request.forced_tools else None,
        )
        head = {"id": rid, "created": int(time.time()), "model": self.config.served_model_name}
        if request.stream:
            return self._chat_stream(head, request, result)
        return self._chat_response(head, request, _as_list(result))

    def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        messages = [m.template_dict() for m in request.messages]
        try:
            return self.chat_template.encode(
                messages, tools=request.offered_tools, tool_format=self.tools,
                template_kwargs=request.chat_template_kwargs,
                continue_final_message=request.continue_final_message)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc

    def _tool_grammar(self, request: ChatCompletionRequest) -> dict[str, str]:
        """tool_choice 'required' or a named function: a grammar for calls in the server's
        format (one call, or several with parallel_tool_calls), each to one of the forced
        tools with arguments valid against its parameters."""
        forced = request.forced_tools
        if not forced:
            return {}
        parallel = request.max_tool_calls is None
        return {"ebnf": self.tools.format.grammar(forced, parallel=parallel)}

    def _chat_output(self, request: ChatCompletionRequest) -> ChatOutput:
        """A fresh splitter for one choice."""
        reasoning = None
        if self.config.reasoning_parser is not None and request.separate_reasoning:
            reasoning = ReasoningParser(self.config.reasoning_parser)
        tools = None
        if request.offered_tools:
            names = [tool["function"]["name"] for tool in request.offered_tools]
            tools = self.tools.format.parser(names, request.max_tool_calls)
        return ChatOutput(reasoning, tools, stream_reasoning=request.stream_reasoning)

    def _chat_response(self, head: dict, request: ChatCompletionRequest,
                       outputs: list[dict[str, Any]]) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(outputs):
            meta = out["meta_info"]
            output = self._chat_output(request)
            choices.append({
                "index": index, "message": output.message(out["text"]),
                "logprobs": self.chat_logprobs(meta) if request.logprobs else None,
                "finish_reason": output.finish_reason(_finish_reason(meta)),
            })
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": _usage([o["meta_info"] for o in outputs], request.n)}

    async def _chat_stream(self, head: dict, request: ChatCompletionRequest,
                           chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        outputs: dict[int, ChatOutput] = {}
        finals: dict[int, dict[str, Any]] = {}  # index -> final meta_info
        async with aclosing(chunks):
            async for chunk in chunks:
                index, meta = chunk["index"], chunk["meta_info"]
                if index not in outputs:
                    outputs[index] = self._chat_output(request)
                    yield sse(_chat_chunk(head, index, {"role": "assistant", "content": ""}))
                finished = "finish_reason" in meta
                if finished:
                    finals[index] = meta
                    _raise_if_aborted(meta)
                delta = outputs[index].delta(chunk["text"], final=finished)
                logprobs = self.chat_logprobs(meta) if request.logprobs else None
                if delta or (logprobs and logprobs["content"]):
                    yield sse(_chat_chunk(head, index, delta, logprobs=logprobs))
                if finished:
                    finish = outputs[index].finish_reason(_finish_reason(meta))
                    yield sse(_chat_chunk(head, index, {}, finish=finish))
        if request.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(_in_order(finals), request.n)})
        yield sse("[DONE]")

    def chat_logprobs(self, meta: dict[str, Any]) -> dict[str, Any]:
        content = []
        for (logprob, token), top in zip(meta["output_token_logprobs"],
                                         meta["output_top_logprobs"], strict=True):
            entry = self._token_logprob(token, logprob)
            entry["top_logprobs"] = [self._token_logprob(t, lp) for lp, t in top]
            content.append(entry)
        return {"content": content}

    def _token_logprob(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(self._token_bytes(token))}

    # ------------------------------------------------------------------ text completions

    async def completion(self, request: CompletionRequest
                         ) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(request.model)
        prompts = self._completion_prompts(request.prompt)
        max_tokens = self._max_tokens([len(p) for p in prompts], request.max_tokens,
                                      "max_tokens", "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        _log_request(rid, request.user, sum(len(p) for p in prompts))
        top = request.logprobs or 0
        result = await self._generate(
            input_ids=prompts,
            sampling_params=request.sampling_params(max_tokens, self.sampling_defaults),
            stream=request.stream, return_logprob=request.logprobs is not None,
            top_logprobs_num=top,
        )
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.config.served_model_name}
        echoes = self._echoes(request, prompts)
        if request.stream:
            return self._completion_stream(head, request, result, echoes)
        outputs = _as_list(result)
        choices = [
            {"index": index, "text": echoes[index] + out["text"],
             "logprobs": (self._completion_logprobs(out["meta_info"])
                          if request.logprobs is not None else None),
             "finish_reason": _finish_reason(out["meta_info"])}
            for index, out in enumerate(outputs)
        ]
        return {**head, "choices": choices,
                "usage": _usage([o["meta_info"] for o in outputs], request.n)}

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt[0], int):
            return [prompt]
        if isinstance(prompt[0], str):
            ids = [self.tokenizer(text).input_ids for text in prompt]
            if not all(ids):
                raise bad_request("every prompt must have at least one token", "prompt")
            return ids
        return prompt

    def _echoes(self, request: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """What each choice's text starts with: its prompt with echo, else nothing. Choices
        are prompt-major, n per prompt; token-id prompts are decoded."""
        if not request.echo:
            return [""] * (len(prompts) * request.n)
        texts = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        if not isinstance(texts[0], str):
            texts = [self.tokenizer.decode(ids) for ids in prompts]
        return [text for text in texts for _ in range(request.n)]

    async def _completion_stream(self, head: dict, request: CompletionRequest,
                                 chunks: AsyncIterator[dict[str, Any]], echoes: list[str]
                                 ) -> AsyncIterator[str]:
        finals: dict[int, dict[str, Any]] = {}  # index -> final meta_info
        offsets: dict[int, int] = {}
        async with aclosing(chunks):
            async for chunk in chunks:
                index, meta = chunk["index"], chunk["meta_info"]
                text = echoes[index] + chunk["text"]
                echoes[index] = ""  # the echoed prompt goes out once, ahead of the output
                finished = "finish_reason" in meta
                if finished:
                    finals[index] = meta
                    _raise_if_aborted(meta)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._completion_logprobs(meta, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(text)
                if text or finished or (logprobs and logprobs["tokens"]):
                    choice = {"index": index, "text": text, "logprobs": logprobs,
                              "finish_reason": _finish_reason(meta) if finished else None}
                    yield sse({**head, "choices": [choice]})
        if request.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(_in_order(finals), request.n)})
        yield sse("[DONE]")

    def _completion_logprobs(self, meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
        tokens = [self.token_text(t) for _, t in meta["output_token_logprobs"]]
        offsets = []
        for text in tokens:
            offsets.append(start)
            start += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in meta["output_token_logprobs"]],
            "top_logprobs": [{self.token_text(t): lp for lp, t in top}
                             for top in meta["output_top_logprobs"]],
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ shared

    def _max_tokens(self, prompt_lens: list[int], requested: int | None, param: str,
                    prompt_param: str) -> int:
        """The completion budget; the prompt plus it must fit the context length."""
        longest = max(prompt_lens)
        if longest >= self.context_length:
            raise bad_request(f"the prompt has {longest} tokens, but this model's context "
                              f"length is {self.context_length} tokens", prompt_param)
        if requested is None:  # all that fits, as vLLM does
            return max(self.engine.max_request_tokens - longest, 0)
        if longest + requested > self.context_length:
            raise bad_request(
                f"this model's context length is {self.context_length} tokens, but "
                f"{longest + requested} were requested ({longest} in the prompt + "
                f"{requested} for the completion); lower {param}", param,
            )
        return requested

    async def _generate(self, *, grammar_field: str | None = None, **kwargs: Any) -> Any:
        """`grammar_field`: the request field a grammar was built from, named by its errors."""
        try:
            return await self.engine.async_generate(**kwargs)
        except GrammarError as exc:
            message = str(exc) if grammar_field is None else (
                f"{grammar_field} cannot be enforced: {exc}")
            raise bad_request(message, grammar_field) from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        except RuntimeError as exc:  # the engine is shutting down
            raise APIError(503, str(exc), code="unavailable") from exc

    def token_text(self, token: int) -> str:
        """A token's own text (cached)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text


def _as_list(result: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return result if isinstance(result, list) else [result]


def _in_order(finals: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    return [finals[index] for index in sorted(finals)]


def _finish_reason(meta: dict[str, Any]) -> str:
    _raise_if_aborted(meta)
    return _FINISH_REASONS[meta["finish_reason"]["type"]]


def _raise_if_aborted(meta: dict[str, Any]) -> None:
    reason = meta["finish_reason"]
    if reason["type"] == "abort":
        raise APIError(503, f"the request was aborted: {reason['message']}", code="aborted")


def _usage(finals: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Each prompt counts once however many samples (n) it had."""
    firsts = finals[::n]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(m["completion_tokens"] for m in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)}}


def _chat_chunk(head: dict, index: int, delta: dict, *, logprobs: dict | None = None,
                finish: str | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {**head, "choices": [choice]}


def _log_request(rid: str, user: str | None, prompt_tokens: int) -> None:
    logger.info("Request %s: %d prompt tokens%s", rid, prompt_tokens,
                f", user {user!r}" if user else "")
