"""OpenAI tool calling on top of SGLang's FunctionCallParser (chosen with --tool-call-parser).

`tool_choice` "auto" lets the model decide and parses what it wrote; "none" ignores the tools.
"required" and a named function need constrained decoding (SGLang forces the call format with a
grammar), so they are refused until the scheduler has a grammar backend.
"""

from __future__ import annotations

import json
import uuid

from sglang.srt.entrypoints.openai.protocol import FunctionResponse, Tool, ToolCall

from sglang_vericache.sampling.sampling_params import InvalidRequest


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tools_in_use(req, parser_name: str | None, supports_grammar: bool) -> list[Tool] | None:
    """The request's tools if the model may call them; raises for what this server cannot do."""
    if not req.tools or req.tool_choice == "none":
        return None
    if not parser_name:
        raise InvalidRequest(
            "tools need a server started with --tool-call-parser "
            "(SGLang's names: qwen25, llama3, mistral, pythonic, hermes, ...)"
        )
    if req.tool_choice != "auto" and not supports_grammar:
        raise InvalidRequest(
            "tool_choice 'required' or a named function needs constrained decoding, "
            "which this server does not support yet; use tool_choice 'auto'"
        )
    return req.tools


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    return None if not tools else [t.model_dump(exclude_none=True) for t in tools]


def template_message(m: dict) -> dict:
    """A chat message for apply_chat_template: tool call arguments as objects, as templates expect."""
    out = {k: v for k, v in m.items() if k in ("role", "content", "name", "tool_call_id", "tool_calls")}
    for call in out.get("tool_calls") or []:
        fn = call.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
    return out


def _parser(parser_name: str, tools: list[Tool]):
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    try:
        return FunctionCallParser(tools=tools, tool_call_parser=parser_name)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def parse_tool_calls(parser_name: str, tools: list[Tool], text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole output -> (remaining content or None, tool calls)."""
    parser = _parser(parser_name, tools)
    if not parser.has_tool_call(text):
        return text, []
    normal, calls = parser.parse_non_stream(text)
    if not calls:  # a marker but no complete call: leave the text as it is
        return text, []
    tool_calls = [
        ToolCall(id=new_call_id(), index=i, function=FunctionResponse(name=c.name, arguments=c.parameters))
        for i, c in enumerate(calls)
    ]
    return (normal or None), tool_calls


class ToolCallStream:
    """Streaming: text deltas in, (content delta, tool call deltas) out. A call's first delta
    carries its id, type and name; later ones append to its arguments."""

    def __init__(self, parser_name: str, tools: list[Tool]) -> None:
        self.parser = _parser(parser_name, tools)
        self.ids: dict[int, str] = {}

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def _deltas(self, calls) -> list[ToolCall]:
        out = []
        for c in calls:
            first = c.tool_index not in self.ids
            if first:
                self.ids[c.tool_index] = new_call_id()
            out.append(
                ToolCall(
                    id=self.ids[c.tool_index] if first else None,
                    index=c.tool_index,
                    function=FunctionResponse(name=c.name if first else None, arguments=c.parameters or ""),
                )
            )
        return out

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        normal, calls = self.parser.parse_stream_chunk(delta)
        return normal, self._deltas(calls)

    def finish(self) -> tuple[str, list[ToolCall]]:
        normal, calls = self.parser.parse_stream_end()
        return normal, self._deltas(calls)
