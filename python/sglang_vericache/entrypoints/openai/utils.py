"""Shared pieces of the OpenAI-compatible endpoints: errors, finish reasons, usage, logprobs, SSE,
and the sampling params a chat or completion request carries."""

from __future__ import annotations

from http import HTTPStatus
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import Response
from sglang.srt.entrypoints.openai.protocol import LogProbs, UsageInfo
from sglang.srt.entrypoints.openai.usage_processor import UsageProcessor


def json_response(content: Any, status_code: int = 200) -> Response:
    return Response(
        orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status_code,
        media_type="application/json",
    )


def openai_error(message: str, status_code: int = 400) -> Response:
    """SGLang's OpenAI error body (ErrorResponse)."""
    phrase = HTTPStatus(status_code).phrase if status_code in HTTPStatus._value2member_map_ else "Error"
    return json_response(
        {"object": "error", "message": message, "type": phrase, "param": None, "code": status_code},
        status_code,
    )


def sse(payload: Any) -> bytes:
    if hasattr(payload, "model_dump"):
        payload = payload.model_dump(exclude_none=False)
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(e: Exception) -> bytes:
    """The error event of a stream already under way (its HTTP status was sent with its first bytes)."""
    return sse({"error": {"message": str(e), "code": getattr(e, "status_code", 500)}})


async def next_event(gen: AsyncIterator[dict]) -> dict | None:
    """The generator's next event; None once it has ended."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


def finish_reason_of(meta: dict) -> tuple[str | None, str | int | None]:
    """SGLang finish_reason dict -> (OpenAI finish_reason, matched_stop)."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    if kind == "length":
        return "length", None
    return "abort", None


def usage_of(outs: list[dict], n: int, cache_report: bool = False) -> UsageInfo:
    """SGLang's usage: prompt tokens (and, with --enable-cache-report, cached prompt tokens) count
    once per prompt, not per sample; completion tokens per sample."""
    return UsageProcessor.calculate_response_usage(outs, n_choices=n, enable_cache_report=cache_report)


def stream_usage(finals: dict[int, dict], n: int, cache_report: bool = False) -> UsageInfo:
    """usage_of a finished stream: finals holds each choice's last event by choice index."""
    return usage_of([finals[i] for i in sorted(finals)], n, cache_report)


def completion_logprobs(
    token_entries: list,
    top_entries: list | None,
    text_offset_start: int = 0,
) -> LogProbs:
    """[logprob, id, text] entries -> the legacy completions LogProbs object."""
    out = LogProbs()
    offset = text_offset_start
    for k, (lp, _tid, text) in enumerate(token_entries):
        text = text or ""
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.text_offset.append(offset)
        offset += len(text)
        if top_entries is not None:
            row = top_entries[k] if k < len(top_entries) else None
            out.top_logprobs.append(None if row is None else {(t or ""): p for p, _i, t in row})
    return out


def normalize_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def sampling_params_of(req, max_new_tokens: int | None, json_schema: str | None, **knobs) -> dict:
    """SGLang sampling params of an OpenAI chat or completion request: the fields both read alike
    (SGLang's extensions included), with max_new_tokens, json_schema and the knobs each endpoint
    defaults its own way (temperature, top_p, top_k, min_p, repetition_penalty)."""
    return {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": req.min_tokens,
        "n": req.n,
        **knobs,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "stop": normalize_stop(req.stop),
        "stop_token_ids": req.stop_token_ids,
        "stop_regex": req.stop_regex,
        "regex": req.regex,
        "json_schema": json_schema,
        "ebnf": req.ebnf,
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
        "sampling_seed": req.seed,
        "logit_bias": req.logit_bias,
    }


def unset_knobs(req, defaults: dict) -> dict:
    """The request's temperature, top_p, top_k, min_p and repetition_penalty, each unset one from
    defaults (--sampling-defaults), else left unset."""
    return {k: getattr(req, k) if getattr(req, k) is not None else defaults.get(k)
            for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}


def response_format_schema(response_format) -> str | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return '{"type": "object"}'
    if response_format.type == "json_schema":
        schema = response_format.json_schema.schema_
        return orjson.dumps(schema if schema is not None else {}).decode()
    raise ValueError(f"response_format type {response_format.type!r} is not supported")
