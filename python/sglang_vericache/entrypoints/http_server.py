"""The HTTP server: SGLang's native endpoints, the OpenAI-compatible ones, and /metrics.

The contract is /work/shared/design/SGLANG_API.md (read off SGLang 0.5.23). Native errors are
`{"error": {"message": ...}}`; OpenAI errors use SGLang's ErrorResponse shape. Bad input is a 4xx.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
)

from sglang_vericache.entrypoints.openai.serving_chat import render_prompt, serve_chat
from sglang_vericache.entrypoints.openai.serving_completions import serve_completion
from sglang_vericache.entrypoints.openai.serving_responses import serve_responses
from sglang_vericache.entrypoints.openai.utils import SSE_DONE, json_response, openai_error
from sglang_vericache.managers.field_policy import check_openai_body
from sglang_vericache.managers.io_struct import ProfileReq
from sglang_vericache.managers.metrics import render_prometheus
from sglang_vericache.managers.req_input import GenerateReqInput
from sglang_vericache.managers.tokenizer_manager import GenerateError, TokenizerManager
from sglang_vericache.sampling.sampling_params import InvalidRequest

logger = logging.getLogger(__name__)

app = FastAPI()
_tm: TokenizerManager | None = None
# Paths open without the API key, like SGLang (probes and Prometheus scraping).
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
HEALTH_GENERATE_TIMEOUT_S = 20.0


def tm() -> TokenizerManager:
    assert _tm is not None, "the server has no TokenizerManager"
    return _tm


def set_tokenizer_manager(manager: TokenizerManager) -> None:
    global _tm
    _tm = manager


# ---------------------------------------------------------------------- errors and auth


def native_error(message: str, status_code: int = 400) -> Response:
    return json_response({"error": {"message": message, "code": status_code}}, status_code)


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


async def read_json(request: Request) -> Any:
    body = await request.body()
    if not body:
        raise InvalidRequest("the request body is empty; expected a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"malformed JSON body: {e}") from None


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


def _hf_config(model_path: str) -> dict:
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@app.get("/get_model_info")
@app.get("/model_info")
async def get_model_info() -> Response:
    m = tm()
    cfg = _hf_config(m.model_path)
    return json_response(
        {
            "model_path": m.model_path,
            "served_model_name": m.served_model_name,
            "tokenizer_path": m.server_args.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": m.server_args.load_format,
            "reasoning_parser": m.server_args.reasoning_parser,
            "tool_call_parser": m.server_args.tool_call_parser,
            "disaggregation_mode": "null",  # SGLang's PD disaggregation; ours is --disagg-role
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.get("model_type"),
            "architectures": cfg.get("architectures"),
        }
    )


@app.get("/server_info")
@app.get("/get_server_info")
async def server_info() -> Response:
    m = tm()
    stats = await m.get_stats()
    ready = m.ready
    return json_response(
        {
            **dataclasses.asdict(m.server_args),
            "max_total_num_tokens": ready.max_total_num_tokens,
            "max_req_input_len": ready.max_req_input_len,
            "context_length": ready.context_length,
            "vocab_size": ready.vocab_size,
            **(ready.server_info or {}),
            "internal_states": [dataclasses.asdict(stats)],
            "version": _version(),
        }
    )


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang-vericache")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "0.0.0"


@app.get("/get_load")
async def get_load() -> Response:
    """SGLang's load report, one entry per data-parallel rank (one here); sglang-router's load
    monitor reads num_tokens (KV tokens held by running requests) per dp_rank."""
    stats = await tm().get_stats()
    return json_response(
        [
            {
                "dp_rank": 0,
                "num_reqs": stats.num_running_reqs + stats.num_waiting_reqs,
                "num_waiting_reqs": stats.num_waiting_reqs,
                "num_tokens": stats.num_used_tokens,
            }
        ]
    )


@app.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache() -> Response:
    out = await tm().flush_cache()
    if out.success:
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse(f"Cache not flushed: {out.message}\n", status_code=400)


@app.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request) -> Response:
    """torch.profiler in the scheduler (managers/scheduler_profiler.py); SGLang's optional body."""
    body = await read_json(request) if (await request.body()).strip() else None
    out = await tm().profile(ProfileReq.from_json("start", body))
    return PlainTextResponse(out.message + "\n") if out.success else native_error(out.message, 400)


@app.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile() -> Response:
    """Stops the profile /start_profile began and writes its trace; 400 when none runs."""
    out = await tm().profile(ProfileReq("stop"))
    return PlainTextResponse(out.message + "\n") if out.success else native_error(out.message, 400)


@app.post("/concate_and_append_request")
async def concate_and_append_request(request: Request) -> Response:
    """The SGLang frontend's join(mode="concate_and_append") asks for dst's KV = the forks' KV. No KV
    is kept per rid here: the frontend already appended the forks' text to dst's prompt, which dst's
    next /generate prefills (as the frontend's text mode does). 200, saying nothing was moved."""
    body = await read_json(request)
    src, dst = (body.get("src_rids"), body.get("dst_rid")) if isinstance(body, dict) else (None, None)
    if not (isinstance(src, list) and all(isinstance(r, str) for r in src) and isinstance(dst, str)):
        raise InvalidRequest('concate_and_append_request needs {"src_rids": ["<rid>", ...], "dst_rid": "<rid>"}')
    return PlainTextResponse(
        "KV not concatenated: concate_and_append_request moves no KV in this runtime; dst_rid's next "
        "/generate prefills the appended text (cached prefixes are reused).\n"
    )


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


@app.get("/metrics")
async def metrics() -> Response:
    m = tm()
    try:
        stats = await m.get_stats()
    except GenerateError:
        stats = None
    text = render_prometheus(m.served_model_name, m.metrics, stats)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


# ---------------------------------------------------------------------- OpenAI-compatible endpoints


async def _parse(request: Request, model_cls):
    """The body as SGLang's pydantic model (which drops keys it does not know, as SGLang does; we
    warn once per such name) with the /generate rules for the SGLang extension fields it carries."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    req = model_cls.model_validate(body)
    check_openai_body(body, model_cls, request.url.path)
    return req


def _model_card() -> ModelCard:
    m = tm()
    return ModelCard(id=m.served_model_name, root=m.model_path, max_model_len=m.context_len)


@app.get("/v1/models")
async def list_models() -> Response:
    return json_response(ModelList(data=[_model_card()]).model_dump())


@app.get("/v1/models/{model:path}")
async def retrieve_model(model: str) -> Response:
    card = _model_card()
    if model != card.id:
        return openai_error(f"The model `{model}` does not exist.", 404)
    return json_response(card.model_dump())


@app.post("/v1/completions")
async def v1_completions(request: Request) -> Response:
    return await serve_completion(tm(), await _parse(request, CompletionRequest), request)


@app.post("/v1/chat/completions")
async def v1_chat_completions(request: Request) -> Response:
    return await serve_chat(tm(), await _parse(request, ChatCompletionRequest), request)


@app.post("/v1/responses")
async def v1_responses(request: Request) -> Response:
    return await serve_responses(tm(), await _parse(request, ResponsesRequest), request)


@app.post("/v1/tokenize")
async def v1_tokenize(request: Request) -> Response:
    req = await _parse(request, TokenizeRequest)
    m = tm()
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages, model=req.model)
        tokens: Any = render_prompt(m, chat)
        count: Any = len(tokens)
    elif isinstance(req.prompt, str):
        tokens = m.tokenize(req.prompt, add_special_tokens=req.add_special_tokens)
        count = len(tokens)
    else:
        tokens = [m.tokenize(p, add_special_tokens=req.add_special_tokens) for p in req.prompt]
        count = [len(t) for t in tokens]
    return json_response({"tokens": tokens, "count": count, "max_model_len": m.context_len})


@app.post("/v1/detokenize")
async def v1_detokenize(request: Request) -> Response:
    req = await _parse(request, DetokenizeRequest)
    m = tm()
    if m.tokenizer is None:
        raise InvalidRequest("detokenize needs a tokenizer; this server runs with --skip-tokenizer-init")
    batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    seqs = req.tokens if batch else [req.tokens]
    for seq in seqs:
        bad = [t for t in seq if not 0 <= t < m.vocab_size]
        if bad:
            raise InvalidRequest(f"tokens outside the vocabulary [0, {m.vocab_size}): {bad[:8]}")
    texts = [m.tokenizer.decode(seq, skip_special_tokens=req.skip_special_tokens) for seq in seqs]
    return json_response({"text": texts if batch else texts[0]})


# ---------------------------------------------------------------------- launch


def launch_server(server_args, tokenizer_manager: TokenizerManager | None = None) -> None:
    """Starts the TokenizerManager (and with it the Scheduler process), then serves until stopped."""
    import uvicorn

    manager = tokenizer_manager or TokenizerManager(server_args)
    set_tokenizer_manager(manager)
    if server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)
    logger.info("The server is fired up and ready to roll! http://%s:%d", server_args.host, server_args.port)
    try:
        uvicorn.run(
            app,
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.log_level.lower(),
            timeout_keep_alive=5,
        )
    finally:
        manager.shutdown()
