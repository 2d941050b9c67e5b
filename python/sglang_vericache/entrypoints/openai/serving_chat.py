"""POST /v1/chat/completions: the tokenizer's chat template, then native generate."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.responses import Response, StreamingResponse
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
    TopLogprob,
)

from sglang_vericache.entrypoints.openai.reasoning import (
    count_reasoning_tokens,
    new_reasoning_parser,
    split_stream_delta,
    split_whole_output,
)
from sglang_vericache.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolPlan,
    parse_tool_calls,
    template_message,
    template_tools,
    tools_in_use,
)
from sglang_vericache.entrypoints.openai.utils import (
    SSE_DONE, finish_reason_of, json_response, next_event, response_format_schema, sampling_params_of, sse,
    sse_error, stream_usage, unset_knobs, usage_of,
)
from sglang_vericache.managers.req_input import GenerateReqInput
from sglang_vericache.sampling.sampling_params import InvalidRequest

if TYPE_CHECKING:
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    from sglang_vericache.managers.tokenizer_manager import TokenizerManager

# Used when neither the tokenizer nor --chat-template provides one (ChatML).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = getattr(part, "type", None) if not isinstance(part, dict) else part.get("type")
        if kind != "text":
            raise InvalidRequest(f"message content of type {kind!r} is not supported (text only)")
        parts.append(part["text"] if isinstance(part, dict) else part.text)
    return "".join(parts)


@functools.cache
def _read_template(path: str) -> str:
    with open(path) as f:
        return f.read()


def chat_template_of(tm: TokenizerManager) -> str:
    """--chat-template (read once; ServerArgs checked it at launch), else the tokenizer's, else ChatML."""
    path = tm.server_args.chat_template
    if path:
        return _read_template(path)
    return getattr(tm.tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE


def render_prompt(tm: TokenizerManager, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
    if tm.tokenizer is None:
        raise InvalidRequest("chat completions need a tokenizer; this server runs with --skip-tokenizer-init")
    if not req.messages:
        raise InvalidRequest("messages is empty")
    messages = []
    for m in req.messages:
        m = dict(m) if isinstance(m, dict) else m.model_dump(exclude_none=True)
        m["content"] = _content_text(m.get("content"))
        messages.append(template_message(m))
    kwargs = dict(req.chat_template_kwargs or {})
    if plan is not None:
        kwargs["tools"] = template_tools(plan.tools)
    text = tm.tokenizer.apply_chat_template(
        messages, chat_template=chat_template_of(tm), tokenize=False, add_generation_prompt=True, **kwargs
    )
    return tm.tokenize(text, add_special_tokens=False)


def build_generate_input(tm: TokenizerManager, req: ChatCompletionRequest, plan: ToolPlan | None) -> GenerateReqInput:
    input_ids = render_prompt(tm, req, plan)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_new is None:  # OpenAI: as long as the request may be (context, and what the KV pool allows)
        longest = min(tm.context_len, tm.max_req_input_len + 1)
        max_new = max(longest - len(input_ids), 0)
    top_logprobs = req.top_logprobs or 0
    if top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true")
    constrained = plan is not None and plan.constrained
    schema = plan.json_schema if constrained else response_format_schema(req.response_format)
    params = sampling_params_of(
        req, max_new, schema,
        **unset_knobs(req, {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                            **tm.sampling_defaults}),
    )
    obj = GenerateReqInput(
        input_ids=input_ids,
        sampling_params=params,
        stream=req.stream,
        return_logprob=bool(req.logprobs),
        top_logprobs_num=top_logprobs,
        return_text_in_logprobs=True,
    )
    obj.normalize()
    return obj


def _logprobs(req: ChatCompletionRequest, meta: dict) -> ChoiceLogprobs | None:
    if not req.logprobs:
        return None
    tops = meta.get("output_top_logprobs") or []
    content = []
    for k, (lp, _tid, text) in enumerate(meta.get("output_token_logprobs", [])):
        text = text or ""
        row = tops[k] if k < len(tops) and tops[k] else []
        content.append(
            ChatCompletionTokenLogprob(
                token=text,
                bytes=list(text.encode("utf-8")),
                logprob=lp,
                top_logprobs=[
                    TopLogprob(token=t or "", bytes=list((t or "").encode("utf-8")), logprob=p)
                    for p, _i, t in row
                ],
            )
        )
    return ChoiceLogprobs(content=content)


def make_choice(
    req: ChatCompletionRequest, idx: int, out: dict, parser_name: str | None, plan: ToolPlan | None,
    reasoning: ReasoningParser | None = None, tokenizer=None,
) -> ChatCompletionResponseChoice:
    """One native output -> a chat choice: the thinking split off first (--reasoning-parser; its
    token count goes to meta_info["reasoning_tokens"] for usage), then with tools, parsed calls and
    finish_reason "tool_calls"."""
    meta = out["meta_info"]
    reason, matched = finish_reason_of(meta)
    reasoning_text, text = None, out["text"]
    if reasoning is not None:
        reasoning_text, text = split_whole_output(reasoning, tokenizer, out)
    content, tool_calls = parse_tool_calls(parser_name, plan, text) if plan else (text, [])
    if tool_calls and reason == "stop":
        reason, matched = "tool_calls", None
    message = ChatMessage(
        role="assistant", content=content, reasoning_content=reasoning_text, tool_calls=tool_calls or None
    )
    return ChatCompletionResponseChoice(
        index=idx,
        message=message,
        logprobs=_logprobs(req, meta),
        finish_reason=reason,
        matched_stop=matched,
    )


async def serve_chat(tm: TokenizerManager, req: ChatCompletionRequest, raw_request) -> Response:
    parser_name = tm.server_args.tool_call_parser
    plan = tools_in_use(req, parser_name, tm.limits.supports_grammar)
    if plan is not None and plan.constrained and req.response_format is not None \
            and req.response_format.type != "text":
        raise InvalidRequest("response_format cannot be combined with tool_choice 'required' or a named function")
    obj = build_generate_input(tm, req, plan)
    gen = tm.generate_request(obj, raw_request)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = req.model or tm.served_model_name
    if req.stream:
        first = await gen.__anext__()
        new_tool_stream = (lambda: ToolCallStream(parser_name, plan)) if plan else None

        def new_reasoning() -> ReasoningParser | None:
            return new_reasoning_parser(tm, req, plan, stream=True)

        cache_report = tm.server_args.enable_cache_report
        events = stream_chunks(
            req, gen, first, rid, created, model, new_tool_stream, new_reasoning, cache_report, tm.tokenizer
        )
        return StreamingResponse(events, media_type="text/event-stream")
    out = await gen.__anext__()
    await gen.aclose()
    outs = [out] if isinstance(out, dict) else out
    choices = []
    for idx, o in enumerate(outs):
        reasoning = new_reasoning_parser(tm, req, plan, stream=False)
        choices.append(make_choice(req, idx, o, parser_name, plan, reasoning, tm.tokenizer))
    usage = usage_of(outs, req.n, tm.server_args.enable_cache_report)
    resp = ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage)
    return json_response(resp.model_dump())


async def stream_chunks(
    req, gen, first, rid, created, model, new_tool_stream,
    new_reasoning=None, cache_report=False, tokenizer=None,
) -> AsyncIterator[bytes]:
    """Native events -> chat.completion.chunk SSE lines (role first, reasoning, content or tool call
    deltas, a finish chunk per choice, the usage chunk if asked, [DONE])."""
    sent_text: dict[int, int] = {}
    finals: dict[int, dict] = {}
    tool_streams: dict[int, ToolCallStream] = {}
    reasonings: dict[int, ReasoningParser | None] = {}
    thought: set[int] = set()  # choices that streamed some thinking

    def chunk(choice) -> bytes:
        return sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))

    try:
        event = first
        while event is not None:
            idx = event.get("index", 0)
            meta = event["meta_info"]
            if idx not in sent_text:
                sent_text[idx] = 0
                if new_tool_stream is not None:
                    tool_streams[idx] = new_tool_stream()
                reasonings[idx] = new_reasoning() if new_reasoning is not None else None
                yield chunk(
                    ChatCompletionResponseStreamChoice(
                        index=idx, delta=DeltaMessage(role="assistant", content="")
                    )
                )
            delta = event["text"][sent_text[idx] :]
            sent_text[idx] = len(event["text"])
            logprobs = _logprobs(req, meta)
            reason, matched = finish_reason_of(meta)
            thinking = ""
            if reasonings[idx] is not None:
                thinking, delta = split_stream_delta(reasonings[idx], delta, final=reason is not None)
            if thinking:
                thought.add(idx)
                delta_msg = DeltaMessage(reasoning_content=thinking)
                yield chunk(ChatCompletionResponseStreamChoice(index=idx, delta=delta_msg))
            calls = []
            tools = tool_streams.get(idx)
            if tools is not None:
                delta, calls = tools.feed(delta) if delta else ("", [])
                if reason is not None:
                    rest, more = tools.finish()
                    delta, calls = delta + rest, calls + more
                if tools.has_calls and reason == "stop":
                    reason, matched = "tool_calls", None
            if delta or calls or (logprobs is not None and logprobs.content):
                content = (delta or None) if calls else delta
                delta_msg = DeltaMessage(content=content, tool_calls=calls or None)
                yield chunk(ChatCompletionResponseStreamChoice(index=idx, delta=delta_msg, logprobs=logprobs))
            if reason is not None:
                finals[idx] = event
                if reasonings[idx] is not None:
                    meta["reasoning_tokens"] = count_reasoning_tokens(
                        reasonings[idx], tokenizer, event.get("output_ids", []), idx in thought)
                yield chunk(
                    ChatCompletionResponseStreamChoice(
                        index=idx, delta=DeltaMessage(), finish_reason=reason, matched_stop=matched
                    )
                )
            event = await next_event(gen)
        if req.stream_options and req.stream_options.include_usage:
            usage = stream_usage(finals, req.n, cache_report)
            last = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[], usage=usage)
            yield sse(last)
    except Exception as e:  # noqa: BLE001 - reported to the client as an SSE error event
        yield sse_error(e)
    finally:
        await gen.aclose()
    yield SSE_DONE
