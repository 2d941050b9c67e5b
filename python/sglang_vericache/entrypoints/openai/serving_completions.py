"""POST /v1/completions on top of the TokenizerManager's native generate."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.responses import Response, StreamingResponse
from sglang.srt.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)

from sglang_vericache.entrypoints.openai.utils import (
    SSE_DONE, completion_logprobs, finish_reason_of, json_response, next_event, response_format_schema,
    sampling_params_of, sse, sse_error, stream_usage, unset_knobs, usage_of,
)
from sglang_vericache.managers.req_input import GenerateReqInput
from sglang_vericache.sampling.sampling_params import InvalidRequest

if TYPE_CHECKING:
    from sglang_vericache.managers.tokenizer_manager import TokenizerManager


def _is_int_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def build_generate_input(req: CompletionRequest, sampling_defaults: dict | None = None,
                         ) -> tuple[GenerateReqInput, list[str | list[int]]]:
    if req.suffix:
        raise InvalidRequest("suffix is not supported")
    if req.best_of not in (None, 1) and req.best_of != req.n:
        raise InvalidRequest("best_of is not supported (use n)")
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif _is_int_list(prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise InvalidRequest("prompt is empty")
    params = sampling_params_of(
        req, req.max_tokens, req.json_schema or response_format_schema(req.response_format),
        **unset_knobs(req, sampling_defaults or {}),
    )
    return_logprob = req.logprobs is not None
    obj = GenerateReqInput(
        sampling_params=params,
        stream=req.stream,
        return_logprob=return_logprob,
        logprob_start_len=0 if (return_logprob and req.echo) else None,
        top_logprobs_num=req.logprobs or 0,
        return_text_in_logprobs=True,
    )
    if all(isinstance(p, str) for p in prompts):
        obj.text = prompts[0] if len(prompts) == 1 else prompts
    elif all(_is_int_list(p) for p in prompts):
        obj.input_ids = prompts[0] if len(prompts) == 1 else prompts
    else:
        raise InvalidRequest("prompt must be a string, a list of strings, or token ids")
    obj.normalize()
    return obj, prompts


def _prompt_text(tm: TokenizerManager, prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return tm.tokenizer.decode(prompt) if tm.tokenizer is not None else ""


def _choice_logprobs(req: CompletionRequest, meta: dict, echo_prefix: bool):
    if req.logprobs is None:
        return None
    entries = list(meta.get("output_token_logprobs", []))
    tops = list(meta.get("output_top_logprobs", [])) if req.logprobs > 0 else None
    if echo_prefix:
        entries = list(meta.get("input_token_logprobs", [])) + entries
        if tops is not None:
            tops = list(meta.get("input_top_logprobs", [])) + tops
    return completion_logprobs(entries, tops)


async def serve_completion(tm: TokenizerManager, req: CompletionRequest, raw_request) -> Response:
    obj, prompts = build_generate_input(req, tm.sampling_defaults)
    gen = tm.generate_request(obj, raw_request)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = req.model or tm.served_model_name
    n = req.n
    if req.stream:
        first = await gen.__anext__()  # surfaces scheduler-side rejections as HTTP errors
        return StreamingResponse(
            _stream(tm, req, gen, first, prompts, rid, created, model, n),
            media_type="text/event-stream",
        )
    out = await gen.__anext__()
    await gen.aclose()
    outs = [out] if isinstance(out, dict) else out
    choices = []
    for idx, o in enumerate(outs):
        meta = o["meta_info"]
        reason, matched = finish_reason_of(meta)
        text = o.get("text", "")
        if req.echo:
            text = _prompt_text(tm, prompts[idx // n]) + text
        choices.append(
            CompletionResponseChoice(
                index=idx,
                text=text,
                logprobs=_choice_logprobs(req, meta, req.echo),
                finish_reason=reason,
                matched_stop=matched,
            )
        )
    usage = usage_of(outs, n, tm.server_args.enable_cache_report)
    resp = CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage)
    return json_response(resp.model_dump())


async def _stream(tm, req, gen, first, prompts, rid, created, model, n) -> AsyncIterator[bytes]:
    sent_text: dict[int, int] = {}
    finals: dict[int, dict] = {}
    try:
        event = first
        while event is not None:
            idx = event.get("index", 0)
            meta = event["meta_info"]
            text = event.get("text", "")
            start = sent_text.get(idx)
            delta = text[start or 0 :]
            if start is None and req.echo:
                delta = _prompt_text(tm, prompts[idx // n]) + delta
            sent_text[idx] = len(text)
            reason, matched = finish_reason_of(meta)
            logprobs = _choice_logprobs(req, meta, echo_prefix=(start is None and req.echo))
            if delta or reason is not None or (logprobs is not None and logprobs.tokens):
                choice = CompletionResponseStreamChoice(
                    index=idx, text=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched
                )
                yield sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))
            if reason is not None:
                finals[idx] = event
            event = await next_event(gen)
        if req.stream_options and req.stream_options.include_usage:
            usage = stream_usage(finals, n, tm.server_args.enable_cache_report)
            yield sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[], usage=usage))
    except Exception as e:  # noqa: BLE001 - reported to the client as an SSE error event
        yield sse_error(e)
    finally:
        await gen.aclose()
    yield SSE_DONE
