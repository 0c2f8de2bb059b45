"""The FastAPI app: OpenAI endpoints, SGLang-style native endpoints, health and metrics.

Request bodies are parsed from raw JSON by the strict pydantic schemas, so every bad request
is a 4xx in OpenAI's error shape; unexpected failures are a 500 in the same shape.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_jax.entrypoints.engine import Engine
from sgl_jax.entrypoints.metrics import ServerMetrics
from sgl_jax.entrypoints.native_api import (
    GenerateRequest,
    generate_stream,
    model_info,
    with_token_texts,
)
from sgl_jax.entrypoints.openai.errors import APIError, bad_request, from_validation_error
from sgl_jax.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax.entrypoints.openai.serving import OpenAIServing, sse
from sgl_jax.server_args import ServerArgs
from sgl_jax.tokenizer.chat_template import ChatTemplate, resolve_chat_template

logger = logging.getLogger(__name__)

Schema = TypeVar("Schema", bound=BaseModel)
# Liveness probes work without the API key.
_OPEN_PATHS = frozenset({"/health"})


def create_app(engine: Engine, args: ServerArgs) -> FastAPI:
    config = args.http
    template = ChatTemplate(engine.tokenizer, resolve_chat_template(config.chat_template))
    template.check()
    serving = OpenAIServing(engine, config, template)
    metrics = ServerMetrics(engine, config.served_model_name) if config.enable_metrics else None
    app = FastAPI(title="sgl-jax", version=_version())
    _install_error_handlers(app)
    if config.api_key is not None:
        _install_api_key_check(app, config.api_key)
    _add_openai_routes(app, serving)
    _add_native_routes(app, engine, serving)
    _add_metrics_route(app, metrics)
    _document_request_bodies(app)
    return app


def _document_request_bodies(app: FastAPI) -> None:
    """Routes parse their bodies themselves (for OpenAI-shaped errors), so FastAPI cannot see
    the schemas: put them into /openapi.json, for client generators and API fuzzers."""
    bodies = {"/v1/chat/completions": ChatCompletionRequest,
              "/v1/completions": CompletionRequest, "/generate": GenerateRequest}
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = default_openapi()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            document["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": {
                    "$ref": f"#/components/schemas/{model.__name__}"}}}}
        return document

    app.openapi = openapi


async def parse_body(request: Request, schema: type[Schema]) -> Schema:
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(_guard_stream(events), media_type="text/event-stream")


async def _guard_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Headers are sent by the time a stream fails: report the error as an event."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except APIError as exc:
        yield sse(exc.body())
    except Exception as exc:
        logger.exception("stream failed")
        yield sse(APIError(500, f"internal error: {exc!r}").body())


def _reply(result: dict[str, Any] | AsyncIterator[str]) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return stream_response(result)


# ---------------------------------------------------------------------- routes


def _add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return _reply(await serving.chat(await parse_body(request, ChatCompletionRequest)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return _reply(await serving.completion(await parse_body(request, CompletionRequest)))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        serving.check_model(model)
        return serving.models()["data"][0]


def _add_native_routes(app: FastAPI, engine: Engine, serving: OpenAIServing) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response("ok")

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy only if the engine thread generates a token."""
        try:
            await engine.async_generate(input_ids=[0], sampling_params={"max_new_tokens": 1})
        except Exception as exc:
            raise APIError(503, f"the engine failed to generate: {exc!r}") from exc
        return Response("ok")

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        if body.model is not None:
            serving.check_model(body.model)
        try:
            result = await engine.async_generate(**body.engine_kwargs())
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        except RuntimeError as exc:  # the engine is shutting down
            raise APIError(503, str(exc), code="unavailable") from exc
        token_text = serving.token_text if body.return_text_in_logprobs else None
        if body.stream:
            return stream_response(generate_stream(result, token_text))
        return JSONResponse(result if token_text is None else with_token_texts(result, token_text))

    # SGLang's current names first (its router reads them), then the older ones.
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info(engine, serving.config.served_model_name)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        # The served name as resolved (the flag's default is the model path).
        return {**engine.get_server_info(), **serving.tools.info(),
                "served_model_name": serving.config.served_model_name}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if not engine.flush_cache():
            raise APIError(400, "the cache cannot be flushed while requests are running",
                           code="busy")
        return Response("the prefix cache was flushed")


def _add_metrics_route(app: FastAPI, metrics: ServerMetrics | None) -> None:
    @app.get("/metrics")
    def get_metrics() -> Response:  # render() waits for the engine thread: not on the loop
        if metrics is None:  # a bare 404 would leave the user guessing why
            raise APIError(404, "/metrics is off; start the server with --enable-metrics",
                           code="not_found")
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")


# ---------------------------------------------------------------------- errors and auth


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), code=_http_code(exc.status_code))
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        error = APIError(500, f"internal error: {exc!r}")
        return JSONResponse(error.body(), status_code=500)


def _http_code(status: int) -> str:
    return {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")


def _install_api_key_check(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_api_key(request: Request,
                            call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path in _OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            error = APIError(401, "missing or wrong API key; send 'Authorization: Bearer "
                                  "<key>'", code="invalid_api_key")
            return JSONResponse(error.body(), status_code=401)
        return await call_next(request)


def _version() -> str:
    from sgl_jax.version import __version__
    return __version__
