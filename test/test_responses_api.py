"""POST /v1/responses through the official `openai` client: the same generation as chat
completions (text, usage, instructions, conversation items, JSON format, tools), streaming events
in order, and clear 400s for what a stateless server cannot do."""

from __future__ import annotations

import json

import openai
import pytest

MESSAGES = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "print a list"}]
# Bounded (enums, no extra properties) so the random-weight model reaches the end of the call.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
RESPONSE_TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}
]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused")


def chat(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def test_text_and_usage_equal_chat_completions(client):
    r = client.responses.create(
        model="m", instructions="You write code.", input="print a list", max_output_tokens=10, temperature=0
    )
    c = chat(client, MESSAGES, max_tokens=10)
    assert r.output_text == c.choices[0].message.content
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        c.usage.prompt_tokens,
        c.usage.completion_tokens,
        c.usage.total_tokens,
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.id.startswith("resp_") and r.model == "m"


def test_message_items_with_developer_role_are_the_same_conversation(client):
    items = [
        {"role": "developer", "content": "You write code."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "print a list"}]},
    ]
    r = client.responses.create(model="m", input=items, max_output_tokens=10, temperature=0)
    assert r.output_text == chat(client, MESSAGES, max_tokens=10).choices[0].message.content


def test_stream_events_in_order_and_text_equal_to_the_whole_response(client):
    kw = {"model": "m", "input": "print a list", "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == (
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        + ["response.output_text.delta"] * len(deltas)
        + [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == whole.output_text
    assert events[-4].text == whole.output_text
    assert {e.item_id for e in deltas} == {events[2].item.id} == {events[-2].item.id}
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == 10


def test_json_object_format_is_constrained_as_in_chat(client):
    r = client.responses.create(
        model="m",
        input="print a list",
        max_output_tokens=24,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    c = chat(
        client,
        [{"role": "user", "content": "print a list"}],
        max_tokens=24,
        response_format={"type": "json_object"},
    )
    assert r.output_text == c.choices[0].message.content
    assert r.output_text.startswith("{")


def test_required_tool_gives_a_function_call_item_streaming_and_not(client):
    kw = {
        "model": "m",
        "input": "weather in Paris?",
        "tools": RESPONSE_TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 96,
        "temperature": 0,
    }
    r = client.responses.create(**kw)
    c = chat(
        client,
        [{"role": "user", "content": "weather in Paris?"}],
        tools=CHAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
    )
    assert [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and r.status == "completed"
    assert call.arguments == c.choices[0].message.tool_calls[0].function.arguments
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Rome", "Oslo") and args["unit"] in ("celsius", "fahrenheit")
    events = list(client.responses.create(stream=True, **kw))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[3].arguments == call.arguments == events[-1].response.output[0].arguments


def test_function_call_items_continue_a_tool_conversation(client):
    items = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = client.responses.create(
        model="m", input=items, tools=RESPONSE_TOOLS, tool_choice="none", max_output_tokens=8, temperature=0
    )
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    c = chat(client, messages, tools=CHAT_TOOLS, tool_choice="none", max_tokens=8)
    assert r.output_text == c.choices[0].message.content


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id is not supported"),
        ({"input": "x", "background": True}, "background responses are not supported"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools of type 'web_search' are not supported"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input items of type 'item_reference' are not"),
        ({"input": []}, "input is empty"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input content of type 'input_image' is not supported",
        ),
    ],
)
def test_what_a_stateless_text_server_cannot_do_is_a_400(client, kw, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.responses.create(model="m", max_output_tokens=4, **kw)


# ---------------------------------------------------------------- reasoning items (no model)


def _job(parser="qwen3", **req):
    from types import SimpleNamespace

    from sglang.srt.entrypoints.openai.protocol import ResponsesRequest

    from sglang_vericache.entrypoints.openai.serving_responses import _Job

    args = SimpleNamespace(reasoning_parser=parser, tool_call_parser=None, enable_cache_report=False)
    tm = SimpleNamespace(
        server_args=args, limits=SimpleNamespace(supports_grammar=True), tokenizer=None, served_model_name="m"
    )
    return _Job(tm, ResponsesRequest(input="q", **req))


def test_streamed_thinking_is_a_reasoning_item_before_the_message():
    import asyncio

    from sglang_vericache.entrypoints.openai.serving_responses import stream_events

    texts = ["<think>pl", "<think>plan it</think>\n\nThe ans", "<think>plan it</think>\n\nThe answer."]
    outs = [{"text": t, "output_ids": [], "meta_info": {"finish_reason": None}} for t in texts]
    outs[-1]["meta_info"] = {
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 2,
        "completion_tokens": 9,
    }

    async def rest():
        for o in outs[1:]:
            yield o

    async def run():
        return [json.loads(line[len(b"data: ") :]) async for line in stream_events(_job(), rest(), outs[0])]

    events = asyncio.run(run())
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "plan it"
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "\n\nThe answer."
    )
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan it"}]
    assert final["output"][1]["content"][0]["text"] == "\n\nThe answer."
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]


def test_request_translation_to_chat():
    from sglang.srt.entrypoints.openai.protocol import ResponsesRequest

    from sglang_vericache.entrypoints.openai.serving_responses import to_chat_request

    req = ResponsesRequest(
        input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        instructions="You write code.",
        tools=RESPONSE_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}},
        max_output_tokens=7,
    )
    chat = to_chat_request(req)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "You write code."),
        ("system", "Be brief."),
        ("user", "hi"),
    ]
    assert chat.tool_choice.function.name == "get_weather" and chat.tools[0].function.name == "get_weather"
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {
        "type": "object"
    }
    assert chat.max_completion_tokens == 7
