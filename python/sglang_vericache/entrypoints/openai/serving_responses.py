"""POST /v1/responses: OpenAI's Responses API on the chat path (chat template, tools, reasoning
parser, structured output), statelessly: nothing is stored, so `previous_response_id` and
`background` are refused; a conversation comes back as input items (messages, function_call,
function_call_output).

Output items: a `reasoning` item (with --reasoning-parser), a `message` with one `output_text`,
and a `function_call` per tool call. Streaming sends the Responses events (created, item and
content-part added, text / reasoning deltas, done events, completed or incomplete); with tools,
the message and the calls are sent once the model finishes, since the text may be a call.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
)
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest, ResponsesResponse

from sglang_vericache.entrypoints.openai.reasoning import (
    count_reasoning_tokens,
    new_reasoning_parser,
    split_stream_delta,
    split_whole_output,
)
from sglang_vericache.entrypoints.openai.serving_chat import build_generate_input
from sglang_vericache.entrypoints.openai.tool_calls import parse_tool_calls, tools_in_use
from sglang_vericache.entrypoints.openai.utils import finish_reason_of, json_response, sse, usage_of
from sglang_vericache.sampling.sampling_params import InvalidRequest

if TYPE_CHECKING:
    from sglang_vericache.managers.tokenizer_manager import TokenizerManager


# Request fields a chat completion takes under the same name (sampling knobs), and those the response
# echoes back as they are.
_CHAT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                "repetition_penalty", "stop", "parallel_tool_calls", "chat_template_kwargs")
_ECHOED_FIELDS = ("tool_choice", "tools", "instructions", "max_output_tokens", "temperature", "top_p", "metadata")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _fields(req: ResponsesRequest, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(req, name) for name in names}


# ---------------------------------------------------------------- request -> chat request


def _text_of(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type")
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequest(f"input content of type {kind!r} is not supported (text only)")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _messages(req: ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for item in req.input:
        item = item if isinstance(item, dict) else item.model_dump(exclude_none=True)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            messages.append({"role": role, "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "")},
            }
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item.get("output"))}
            )
        elif kind != "reasoning":  # earlier reasoning is not fed back to the model
            raise InvalidRequest(f"input items of type {kind!r} are not supported")
    if not messages:
        raise InvalidRequest("input is empty")
    return messages


def _tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    tools = []
    for t in req.tools:
        if t.type != "function":
            raise InvalidRequest(f"tools of type {t.type!r} are not supported here (function tools only)")
        fn = {"name": t.name, "parameters": t.parameters or {"type": "object", "properties": {}}}
        if t.description:
            fn["description"] = t.description
        tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise InvalidRequest(f"tool_choice must be auto, none, required or a function; got {choice}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools or None, choice


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
    }


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id is not None:
        raise InvalidRequest(
            "previous_response_id is not supported: this server stores no responses; send "
            "the conversation as input items"
        )
    if req.background:
        raise InvalidRequest("background responses are not supported")
    tools, choice = _tools(req)
    return ChatCompletionRequest(
        model=req.model or "",
        messages=_messages(req),
        max_completion_tokens=req.max_output_tokens,
        tools=tools,
        tool_choice=choice if tools else "none",
        response_format=_response_format(req),
        stream=bool(req.stream),
        **_fields(req, _CHAT_FIELDS),
    )


# ---------------------------------------------------------------- output items


def _message(text: str, done: bool = True) -> ResponseOutputMessage:
    content = [ResponseOutputText(type="output_text", text=text, annotations=[])] if done else []
    status = "completed" if done else "in_progress"
    return ResponseOutputMessage(
        id=_new_id("msg"), type="message", role="assistant", status=status, content=content
    )


def _reasoning(text: str) -> ResponseReasoningItem:
    return ResponseReasoningItem(
        id=_new_id("rs"), type="reasoning", summary=[], content=[{"type": "reasoning_text", "text": text}]
    )


def _calls(calls) -> list[ResponseFunctionToolCall]:
    return [
        ResponseFunctionToolCall(
            type="function_call",
            id=_new_id("fc"),
            call_id=c.id,
            name=c.function.name,
            arguments=c.function.arguments,
            status="completed",
        )
        for c in calls
    ]


class _Job:
    """One /v1/responses request: its chat translation, tool plan and the response envelope."""

    def __init__(self, tm: TokenizerManager, req: ResponsesRequest) -> None:
        self.tm, self.req = tm, req
        self.chat = to_chat_request(req)
        self.parser_name = tm.server_args.tool_call_parser
        self.plan = tools_in_use(self.chat, self.parser_name, tm.limits.supports_grammar)
        self.id = _new_id("resp")
        self.created = int(time.time())

    def response(self, output: list, status: str, out: dict | None = None) -> ResponsesResponse:
        req = self.req
        incomplete = None
        if out is not None and finish_reason_of(out["meta_info"])[0] == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        usage = None if out is None else usage_of([out], 1, self.tm.server_args.enable_cache_report)
        return ResponsesResponse(
            id=self.id,
            created_at=self.created,
            model=req.model or self.tm.served_model_name,
            output=output,
            status=status,
            incomplete_details=incomplete,
            usage=usage,
            parallel_tool_calls=bool(req.parallel_tool_calls),
            store=False,
            text={"format": {"type": "text"}} if req.text is None else req.text.model_dump(),
            **_fields(req, _ECHOED_FIELDS),
        )

    def final_items(self, text: str, thought: str | None) -> list:
        items = [_reasoning(thought)] if thought else []
        content, calls = parse_tool_calls(self.parser_name, self.plan, text) if self.plan else (text, [])
        if content or not calls:
            items.append(_message(content or ""))
        return items + _calls(calls)


async def serve_responses(tm: TokenizerManager, req: ResponsesRequest, raw_request) -> Response:
    job = _Job(tm, req)
    obj = build_generate_input(tm, job.chat, job.plan)
    gen = tm.generate_request(obj, raw_request)
    if req.stream:
        first = await gen.__anext__()
        return StreamingResponse(stream_events(job, gen, first), media_type="text/event-stream")
    out = await gen.__anext__()
    await gen.aclose()
    thought, text = None, out["text"]
    reasoning = new_reasoning_parser(tm, job.chat, job.plan, stream=False)
    if reasoning is not None:
        thought, text = split_whole_output(reasoning, tm.tokenizer, out)
    return json_response(job.response(job.final_items(text, thought), "completed", out).model_dump())


async def stream_events(job: _Job, gen, first: dict) -> AsyncIterator[bytes]:
    """Native events -> Responses stream events. Items open when their first text arrives (the
    reasoning item, then the message) and close in order; tool requests send their items at the end."""
    seq = itertools.count()
    output: list = []  # finished items, in output order

    def event(kind: str, **fields) -> bytes:
        return sse({"type": kind, "sequence_number": next(seq), **fields})

    reasoning = new_reasoning_parser(job.tm, job.chat, job.plan, stream=True)
    sent, thought, text = 0, "", ""
    open_kind, item = None, None  # the item being streamed: "reasoning" or "message"

    def close_item() -> list[bytes]:
        nonlocal open_kind, item
        idx, lines = len(output), []
        if open_kind == "reasoning":
            done = _reasoning(thought).model_copy(update={"id": item.id})
            lines.append(
                event(
                    "response.reasoning_text.done",
                    item_id=item.id,
                    output_index=idx,
                    content_index=0,
                    text=thought,
                )
            )
        else:
            done = _message(text).model_copy(update={"id": item.id})
            part = done.content[0].model_dump()
            lines += [
                event(
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=idx,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                event(
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=idx,
                    content_index=0,
                    part=part,
                ),
            ]
        lines.append(event("response.output_item.done", output_index=idx, item=done.model_dump()))
        output.append(done)
        open_kind, item = None, None
        return lines

    def open_item(kind: str) -> list[bytes]:
        nonlocal open_kind, item
        lines = close_item() if open_kind is not None else []
        idx = len(output)
        if kind == "reasoning":
            item = _reasoning("").model_copy(update={"content": []})
            lines.append(event("response.output_item.added", output_index=idx, item=item.model_dump()))
        else:
            item = _message("", done=False)
            lines += [
                event("response.output_item.added", output_index=idx, item=item.model_dump()),
                event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=idx,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                ),
            ]
        open_kind = kind
        return lines

    def delta_events(kind: str, name: str, text: str, **extra: Any) -> list[bytes]:
        """The event `name` adding text to the open `kind` item, the item opened first if need be."""
        lines = open_item(kind) if open_kind != kind else []
        return lines + [event(name, item_id=item.id, output_index=len(output), content_index=0, delta=text, **extra)]

    try:
        yield event("response.created", response=job.response([], "in_progress").model_dump())
        yield event("response.in_progress", response=job.response([], "in_progress").model_dump())
        out = first
        while out is not None:
            final = out["meta_info"]["finish_reason"] is not None
            delta, sent = out["text"][sent:], len(out["text"])
            think = ""
            if reasoning is not None:
                think, delta = split_stream_delta(reasoning, delta, final)
            if think:
                thought += think
                for line in delta_events("reasoning", "response.reasoning_text.delta", think):
                    yield line
            text += delta
            if delta and job.plan is None:
                for line in delta_events("message", "response.output_text.delta", delta, logprobs=[]):
                    yield line
            if final:
                break
            try:
                out = await gen.__anext__()
            except StopAsyncIteration:
                out = None
        if open_kind == "reasoning":
            for line in close_item():
                yield line
        if job.plan is None:
            lines = open_item("message") if open_kind is None else []  # an empty answer: an empty message
            for line in lines + close_item():
                yield line
        else:  # tools: the message and the calls, now that the text is whole
            for it in job.final_items(text, None):
                idx = len(output)
                yield event("response.output_item.added", output_index=idx, item=it.model_dump())
                if it.type == "function_call":
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=it.id,
                        output_index=idx,
                        arguments=it.arguments,
                    )
                yield event("response.output_item.done", output_index=idx, item=it.model_dump())
                output.append(it)
        if out is not None and reasoning is not None:
            out["meta_info"]["reasoning_tokens"] = count_reasoning_tokens(
                reasoning, job.tm.tokenizer, out["output_ids"], bool(thought)
            )
        resp = job.response(output, "completed", out)
        yield event(
            "response.completed" if resp.status == "completed" else "response.incomplete",
            response=resp.model_dump(),
        )
    except Exception as e:  # noqa: BLE001 - reported to the client as an error event
        yield event("error", code=str(getattr(e, "status_code", 500)), message=str(e), param=None)
    finally:
        await gen.aclose()
