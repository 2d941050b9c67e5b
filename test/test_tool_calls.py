"""OpenAI tool calling: SGLang's FunctionCallParser output turned into tool_calls (non-streaming and
streaming), and the server's acceptance rules for tools / tool_choice.

A random-weight model never writes a tool call, so the parsing paths are driven with the text a
qwen25-style model writes; the server tests check what a real request gets."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, Tool

from sglang_vericache.entrypoints.openai.serving_chat import make_choice, stream_chunks
from sglang_vericache.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan, parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS = [Tool.model_validate(WEATHER)]
AUTO = ToolPlan(TOOLS)  # tool_choice "auto": the qwen25 parser reads the output
CALL_TEXT = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# The same text as a model streams it, one token-ish piece per event.
PIECES = [
    "Let me check.",
    "<tool_call>\n",
    '{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Paris"}}\n',
    "</tool_call>",
]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def native_out(text: str, finish: dict | None, index: int | None = None, tokens: int = 1) -> dict:
    meta = {
        "id": "r",
        "finish_reason": finish,
        "prompt_tokens": 5,
        "completion_tokens": tokens,
        "cached_tokens": 0,
    }
    out = {"text": text, "output_ids": [], "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def test_parse_tool_calls_splits_content_and_calls():
    content, calls = parse_tool_calls("qwen25", AUTO, CALL_TEXT)
    assert content == "Let me check."
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].type == "function"
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_text_without_a_call_stays_content():
    assert parse_tool_calls("qwen25", AUTO, "just text") == ("just text", [])


def test_non_stream_choice_reports_tool_calls_finish_reason():
    req = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER])
    choice = make_choice(req, 0, native_out(CALL_TEXT, {"type": "stop", "matched": 1}), "qwen25", AUTO)
    assert choice.finish_reason == "tool_calls" and choice.matched_stop is None
    assert choice.message.content == "Let me check."
    assert choice.message.tool_calls[0].function.name == "get_weather"
    length_cut = make_choice(req, 0, native_out(CALL_TEXT, {"type": "length", "length": 9}), "qwen25", AUTO)
    assert length_cut.finish_reason == "length"


def test_tool_call_stream_gives_id_and_name_once_then_arguments():
    stream = ToolCallStream("qwen25", AUTO)
    content, deltas = "", []
    for piece in PIECES:
        text, calls = stream.feed(piece)
        content += text
        deltas += calls
    text, calls = stream.finish()
    content += text
    deltas += calls
    assert content == "Let me check."
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris"}
    assert {d.index for d in deltas} == {0}


def test_chat_stream_chunks_carry_tool_call_deltas():
    req = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER], stream=True)
    texts = ["".join(PIECES[: i + 1]) for i in range(len(PIECES))]
    events = [native_out(t, None, tokens=i + 1) for i, t in enumerate(texts[:-1])]
    events.append(native_out(texts[-1], {"type": "stop", "matched": 1}, tokens=len(texts)))

    async def run() -> list[dict]:
        async def gen():
            for ev in events[1:]:
                yield ev

        lines = [
            line
            async for line in stream_chunks(
                req, gen(), events[0], "id", 0, "m", lambda: ToolCallStream("qwen25", AUTO)
            )
        ]
        assert lines[-1] == b"data: [DONE]\n\n"
        return [json.loads(line[len(b"data: ") :]) for line in lines[:-1]]

    chunks = asyncio.run(run())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "", "reasoning_content": None}
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused")  # the default server parses qwen25


def test_auto_tool_choice_is_served(client, default_model_dir):
    out = client.chat.completions.create(
        model=default_model_dir,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    chunks = list(
        client.chat.completions.create(
            model=default_model_dir,
            messages=MESSAGES,
            tools=[WEATHER],
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content


def test_tools_without_a_tool_call_parser_are_refused(server, default_model_dir):
    no_parser = server(default_model_dir, api_key="sekrit")  # shared with test_bad_input
    plain = openai.OpenAI(base_url=no_parser.base_url + "/v1", api_key="sekrit")
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        plain.chat.completions.create(
            model=default_model_dir, messages=MESSAGES, tools=[WEATHER], max_tokens=4
        )
    out = plain.chat.completions.create(
        model=default_model_dir, messages=MESSAGES, tools=[WEATHER], tool_choice="none", max_tokens=2
    )
    assert out.choices[0].message.tool_calls is None
