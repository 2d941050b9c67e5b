"""Structured output and tool calling through the HTTP server, in full and VeriCache mode:
regex / json_schema / ebnf in sampling_params, OpenAI response_format, tool_choice "required" and
a named function with the official openai client (streaming and not), and the 400s for bad input.

The schemas are bounded (enums, integer ranges) so the random-weight model reaches their end; the
VeriCache server must return byte-identical text and arguments to the full-mode server."""

from __future__ import annotations

import json
import re

import openai
import pytest
import requests

# The same two servers as test_vericache_server.py (one process each for the session).
VC_FLAGS = ("--kv-compressor", "int8", "--speculative-algorithm", "VERICACHE",
            "--speculative-num-draft-tokens", "6", "--page-size", "8")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]},
                           "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["zone", "hours"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what time is it?"}]


@pytest.fixture(scope="module")
def servers(server, default_model_dir):
    return {"full": server(default_model_dir, "--page-size", "8"), "vericache": server(default_model_dir, *VC_FLAGS)}


@pytest.fixture(scope="module")
def clients(servers):
    return {mode: openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused") for mode, s in servers.items()}


def valid_call(name: str, args: dict) -> bool:
    if name == "get_weather":
        return set(args) == {"city", "unit"} and args["city"] in ("Paris", "Rome", "Oslo") \
            and args["unit"] in ("celsius", "fahrenheit")
    if name == "get_time":
        return set(args) == {"zone", "hours"} and args["zone"] in ("UTC", "CET") \
            and type(args["hours"]) is int and 0 <= args["hours"] <= 23
    return False


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("params,message", [
    ({"regex": "(ab"}, "invalid regex: Regex parsing error at position 4: The parenthesis is not closed."),
    ({"json_schema": '{"type": "objectx"}'}, 'invalid JSON schema: Unsupported type "objectx"'),
    ({"ebnf": "root ::= "}, "invalid EBNF grammar: EBNF parser error at line 1, column 10: Expect element, but got"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "only one of regex, json_schema and ebnf may be set"),
])
def test_bad_constraints_get_a_400_naming_the_problem(servers, params, message):
    url = servers["full"].base_url
    r = requests.post(url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4, **params}})
    assert r.status_code == 400 and r.json()["error"]["message"] == message
    ok = requests.post(url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2  # the server stays up


def test_bad_tool_choices_get_a_400(clients, default_model_dir):
    client = clients["full"]
    with pytest.raises(openai.BadRequestError, match="tool_choice names function 'nope', which is not among"):
        client.chat.completions.create(model=default_model_dir, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        client.chat.completions.create(
            model=default_model_dir, messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})


# ---------------------------------------------------------------- constrained generation


@pytest.mark.parametrize("kind,spec,pattern", [
    ("regex", r"(yes|no), [0-9]{2,3} [a-z]{2,4}\.", r"(yes|no), [0-9]{2,3} [a-z]{2,4}\."),
    ("ebnf", 'root ::= "[" [a-c] [0-9] ("," [a-c] [0-9]){0,2} "]"', r"\[[a-c][0-9](,[a-c][0-9]){0,2}\]"),
])
def test_native_constraints_give_the_same_text_in_both_modes(servers, kind, spec, pattern):
    body = {"text": ["def f(x):\n", "Answer: "], "sampling_params": {"max_new_tokens": 48, "temperature": 0, kind: spec}}
    outs = {m: requests.post(s.base_url + "/generate", json=body).json() for m, s in servers.items()}
    assert [o["text"] for o in outs["vericache"]] == [o["text"] for o in outs["full"]]
    for o in outs["full"]:
        assert re.fullmatch(pattern, o["text"]), o["text"]
        assert o["meta_info"]["finish_reason"]["type"] == "stop"


def test_response_format_json_schema_in_both_modes(clients, default_model_dir):
    schema = CLOCK["function"]["parameters"]
    contents = {}
    for mode, client in clients.items():
        out = client.chat.completions.create(
            model=default_model_dir, messages=MESSAGES, temperature=0, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "clock", "schema": schema}})
        assert out.choices[0].finish_reason == "stop"
        contents[mode] = out.choices[0].message.content
    assert contents["vericache"] == contents["full"]
    assert valid_call("get_time", json.loads(contents["full"]))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_and_match_across_modes_and_streaming(clients, default_model_dir, tool_choice):
    calls = {}
    for mode, client in clients.items():
        kwargs = dict(model=default_model_dir, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                      parallel_tool_calls=False, temperature=0, max_tokens=96)
        out = client.chat.completions.create(**kwargs)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert valid_call(call.function.name, json.loads(call.function.arguments)), call.function
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"
        calls[mode] = (call.function.name, call.function.arguments)

        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert deltas[0].function.name == call.function.name and deltas[0].id.startswith("call_")
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert calls["vericache"] == calls["full"]  # byte-identical arguments
