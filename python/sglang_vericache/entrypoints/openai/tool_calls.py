"""OpenAI tool calling on top of SGLang's FunctionCallParser (chosen with --tool-call-parser).

`tool_choice` "auto" lets the model decide and parses what it wrote with the model's parser;
"none" ignores the tools. "required" and a named function are enforced by a grammar, as SGLang
does: the output is constrained by SGLang's JSON schema for an array of calls
(`[{"name": ..., "parameters": {...}}, ...]`, one call when parallel_tool_calls is false), so
every call names a given tool and its arguments fit that tool's schema.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from sglang.srt.entrypoints.openai.protocol import FunctionResponse, Tool, ToolCall, ToolChoice

from sglang_vericache.sampling.sampling_params import InvalidRequest


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """How a chat request uses its tools: the tools (for the template and the parsers) and, for
    required/named choices, the JSON schema its output is constrained to."""

    tools: list[Tool]
    json_schema: str | None = None

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None


def tools_in_use(req, parser_name: str | None, supports_grammar: bool) -> ToolPlan | None:
    """The request's tool plan, or None if the model may not call tools; raises for bad input."""
    choice = req.tool_choice
    forced = choice == "required" or isinstance(choice, ToolChoice)
    if forced and not req.tools:
        raise InvalidRequest("tool_choice requires tools, but the request has none")
    if not req.tools or choice == "none":
        return None
    if not forced:
        if not parser_name:
            raise InvalidRequest(
                "tool_choice 'auto' needs a tool-call parser, and the served model's chat template writes no "
                "tool-call format this server recognizes: start it with --tool-call-parser NAME (SGLang's "
                "names: qwen25, llama3, mistral, pythonic, hermes, ...), or send tool_choice 'required' or a "
                "named function, which need no parser"
            )
        return ToolPlan(req.tools)
    if not supports_grammar:
        raise InvalidRequest("tool_choice 'required' or a named function needs constrained decoding, "
                             "which needs the tokenizer (this server runs with --skip-tokenizer-init)")
    from sglang.srt.function_call.utils import get_json_schema_constraint

    schema = get_json_schema_constraint(req.tools, choice, parallel_tool_calls=req.parallel_tool_calls)
    if schema is None:
        names = [t.function.name for t in req.tools]
        raise InvalidRequest(f"tool_choice names function {choice.function.name!r}, which is not among "
                             f"the request's tools {names}")
    return ToolPlan(req.tools, json.dumps(schema))


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


def parse_tool_calls(parser_name: str | None, plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole output -> (remaining content or None, tool calls)."""
    if plan.constrained:
        return _parse_call_array(text)
    parser = _parser(parser_name, plan.tools)
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


def _parse_call_array(text: str) -> tuple[str | None, list[ToolCall]]:
    """A constrained output: a JSON array of {"name", "parameters"}. Cut short (max_tokens), it is
    not JSON yet and comes back as content."""
    try:
        calls = json.loads(text)
    except ValueError:
        return text, []
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return text, []
    return None, [
        ToolCall(id=new_call_id(), index=i, function=FunctionResponse(
            name=c["name"], arguments=json.dumps(c.get("parameters", {}), ensure_ascii=False)))
        for i, c in enumerate(calls)
    ]


class ToolCallStream:
    """Streaming: text deltas in, (content delta, tool call deltas) out. A call's first delta
    carries its id, type and name; later ones append to its arguments."""

    def __init__(self, parser_name: str | None, plan: ToolPlan) -> None:
        self.tools = plan.tools
        self.array = None  # constrained output: SGLang's streaming parser for a JSON array of calls
        if plan.constrained:
            from sglang.srt.function_call.json_array_parser import JsonArrayParser

            self.array = JsonArrayParser()
        else:
            self.parser = _parser(parser_name, plan.tools)
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
        if self.array is not None:
            res = self.array.parse_streaming_increment(delta, self.tools)
            return res.normal_text, self._deltas(res.calls)
        normal, calls = self.parser.parse_stream_chunk(delta)
        return normal, self._deltas(calls)

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.array is not None:
            res = self.array.finish(self.tools)
            return res.normal_text, self._deltas(res.calls)
        normal, calls = self.parser.parse_stream_end()
        return normal, self._deltas(calls)
