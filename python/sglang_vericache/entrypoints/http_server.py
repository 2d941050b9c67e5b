"""The HTTP server: the app, its error handlers and API-key check, SGLang's health and generation
endpoints, and the launcher; the admin endpoints (admin_routes.py) and the OpenAI-compatible ones
(openai/http_routes.py) are mounted as routers.

The contract is docs/SGLANG_API.md (read off SGLang 0.5.23). Native errors are
`{"error": {"message": ...}}`; OpenAI errors use SGLang's ErrorResponse shape. Bad input is a 4xx.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from collections.abc import AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from sglang_vericache.entrypoints import admin_routes
from sglang_vericache.entrypoints.http_common import native_error, read_json, set_tokenizer_manager, tm
from sglang_vericache.entrypoints.openai import http_routes as openai_routes
from sglang_vericache.entrypoints.openai.tool_parser_detect import detect_tool_call_parser
from sglang_vericache.entrypoints.openai.utils import SSE_DONE, json_response, openai_error
from sglang_vericache.managers.req_input import GenerateReqInput
from sglang_vericache.managers.tokenizer_manager import GenerateError, TokenizerManager
from sglang_vericache.sampling.sampling_params import InvalidRequest

logger = logging.getLogger(__name__)

app = FastAPI()
# Paths open without the API key, like SGLang (probes and Prometheus scraping).
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
HEALTH_GENERATE_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------- errors and auth


def error_for(request: Request, message: str, status_code: int) -> Response:
    if request.url.path.startswith("/v1/"):
        return openai_error(message, status_code)
    return native_error(message, status_code)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


@app.exception_handler(InvalidRequest)
async def _invalid_request(request: Request, exc: InvalidRequest) -> Response:
    return error_for(request, str(exc), 400)


@app.exception_handler(GenerateError)
async def _generate_error(request: Request, exc: GenerateError) -> Response:
    return error_for(request, str(exc), exc.status_code)


@app.exception_handler(ValidationError)
async def _pydantic_error(request: Request, exc: ValidationError) -> Response:
    return error_for(request, _validation_message(exc), 400)


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("internal error on %s", request.url.path)
    return error_for(request, f"internal server error: {type(exc).__name__}: {exc}", 500)


class ApiKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so client disconnects still reach the handlers."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or path.startswith(_OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), self.api_key.encode()):
            return await self.app(scope, receive, send)
        response = json_response({"error": "Unauthorized"}, 401)
        await response(scope, receive, send)


# ---------------------------------------------------------------------- native endpoints


@app.get("/health")
async def health() -> Response:
    return Response(status_code=200 if tm().is_healthy else 503)


@app.get("/ready")
async def ready() -> Response:
    return Response(status_code=200 if tm().is_healthy else 503)


@app.get("/health_generate")
async def health_generate() -> Response:
    if not tm().is_healthy:
        return Response(status_code=503)
    obj = GenerateReqInput(
        input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}, log_metrics=False
    )
    obj.normalize()
    gen = tm().generate_request(obj)
    try:
        out = await asyncio.wait_for(gen.__anext__(), HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, GenerateError):
        return Response(status_code=503)
    finally:
        await gen.aclose()
    return Response(status_code=200 if out["meta_info"]["finish_reason"] is not None else 503)


@app.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    obj = GenerateReqInput.from_json(await read_json(request))
    gen = tm().generate_request(obj, request)
    if not obj.stream:
        out = await gen.__anext__()
        await gen.aclose()
        return json_response(out)
    # Wait for the first event so that scheduler-side rejections still get an HTTP status.
    first = await gen.__anext__()
    return StreamingResponse(_sse_events(gen, first), media_type="text/event-stream")


async def _sse_events(gen: AsyncIterator[dict], first: dict) -> AsyncIterator[bytes]:
    try:
        yield b"data: " + orjson.dumps(first) + b"\n\n"
        async for out in gen:
            yield b"data: " + orjson.dumps(out) + b"\n\n"
    except GenerateError as e:
        yield b"data: " + orjson.dumps({"error": {"message": str(e), "code": e.status_code}}) + b"\n\n"
    finally:
        await gen.aclose()
    yield SSE_DONE


@app.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """SGLang's abort: the request ends with finish_reason {"type": "abort"} and its KV is freed."""
    body = await read_json(request)
    if not isinstance(body, dict) or not (isinstance(body.get("rid"), str) or body.get("abort_all") is True):
        raise InvalidRequest('abort_request needs {"rid": "<request id>"} or {"abort_all": true}')
    if body.get("abort_all") is True:
        for rid in list(tm().rid_to_state):
            tm().abort_running(rid)
    else:
        tm().abort_running(body["rid"])
    return PlainTextResponse("")


# ---------------------------------------------------------------------- the other endpoints

app.include_router(admin_routes.router)
app.include_router(openai_routes.router)


# ---------------------------------------------------------------------- launch


def launch_server(server_args, tokenizer_manager: TokenizerManager | None = None) -> None:
    """Starts the TokenizerManager (and with it the Scheduler process), then serves until stopped."""
    import uvicorn

    manager = tokenizer_manager or TokenizerManager(server_args)
    set_tokenizer_manager(manager)
    if manager.server_args.tool_call_parser is None and manager.tokenizer is not None:
        parser = detect_tool_call_parser(getattr(manager.tokenizer, "chat_template", None))
        if parser:
            manager.server_args.tool_call_parser = parser
            logger.info("tool calls: the chat template writes %s's format (tool_choice 'auto' parses it; "
                        "--tool-call-parser overrides)", parser)
    if server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                           log_level=server_args.log_level.lower(), timeout_keep_alive=5))
    if server_args.tp_size > 1:  # a lost rank takes the model with it: fail the requests, then exit
        def stop(reason: str) -> None:
            logger.error("tensor parallelism lost a rank; the server stops: %s", reason)
            server.should_exit = True  # uvicorn answers what is in flight (each already failed), then returns

        manager.on_scheduler_exit = stop
    logger.info("The server is fired up and ready to roll! http://%s:%d", server_args.host, server_args.port)
    try:
        server.run()
    finally:
        manager.shutdown()
    if not server.started:
        sys.exit(3)  # uvicorn.run's exit code when the server could not start
    if manager.dead_reason is not None and server_args.tp_size > 1:
        print(f"error: {manager.dead_reason}", file=sys.stderr)
        sys.exit(1)
