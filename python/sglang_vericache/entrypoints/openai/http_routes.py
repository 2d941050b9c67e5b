"""The OpenAI-compatible endpoints (/v1/...): each parses the body as SGLang's pydantic model and
hands it to its serving_* module (mounted by entrypoints/http_server.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
)

from sglang_vericache.entrypoints.http_common import read_json, tm
from sglang_vericache.entrypoints.openai.serving_chat import render_prompt, serve_chat
from sglang_vericache.entrypoints.openai.serving_completions import serve_completion
from sglang_vericache.entrypoints.openai.serving_responses import serve_responses
from sglang_vericache.entrypoints.openai.utils import json_response, openai_error
from sglang_vericache.managers.field_policy import check_openai_body
from sglang_vericache.sampling.sampling_params import InvalidRequest

router = APIRouter()


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


@router.get("/v1/models")
async def list_models() -> Response:
    return json_response(ModelList(data=[_model_card()]).model_dump())


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str) -> Response:
    card = _model_card()
    if model != card.id:
        return openai_error(f"The model `{model}` does not exist.", 404)
    return json_response(card.model_dump())


@router.post("/v1/completions")
async def v1_completions(request: Request) -> Response:
    return await serve_completion(tm(), await _parse(request, CompletionRequest), request)


@router.post("/v1/chat/completions")
async def v1_chat_completions(request: Request) -> Response:
    return await serve_chat(tm(), await _parse(request, ChatCompletionRequest), request)


@router.post("/v1/responses")
async def v1_responses(request: Request) -> Response:
    return await serve_responses(tm(), await _parse(request, ResponsesRequest), request)


@router.post("/v1/tokenize")
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


@router.post("/v1/detokenize")
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
