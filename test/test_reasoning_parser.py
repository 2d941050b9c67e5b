"""--reasoning-parser: chat responses split a reasoning model's thinking into reasoning_content
(SGLang's ReasoningParser), non-streaming and streaming; constrained output is left whole."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

from sglang_vericache.entrypoints.openai.reasoning import count_reasoning_tokens, new_reasoning_parser
from sglang_vericache.entrypoints.openai.serving_chat import make_choice, stream_chunks
from sglang_vericache.entrypoints.openai.utils import usage_of

TEXT = "<think>plan it</think>\n\nThe answer."
STOP = {"type": "stop", "matched": 2}


def _tm(parser: str | None = "qwen3"):
    return SimpleNamespace(server_args=SimpleNamespace(reasoning_parser=parser), tokenizer=None)


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], **kw)


def _choice(tm, req, text=TEXT):
    out = {"text": text, "meta_info": {"finish_reason": STOP}}
    return make_choice(req, 0, out, None, None, new_reasoning_parser(tm, req, None, stream=False))


def test_thinking_goes_to_reasoning_content():
    msg = _choice(_tm(), _req()).message
    assert (msg.reasoning_content, msg.content) == ("plan it", "\n\nThe answer.")


def test_without_a_parser_or_with_separate_reasoning_false_the_text_stays_whole():
    for tm, req in ((_tm(None), _req()), (_tm(), _req(separate_reasoning=False))):
        msg = _choice(tm, req).message
        assert (msg.reasoning_content, msg.content) == (None, TEXT)


def test_grammar_constrained_output_has_no_thinking_to_split():
    for req in (
        _req(response_format={"type": "json_object"}),
        _req(regex="[a-z]+"),
        _req(ebnf='root ::= "a"'),
    ):
        assert new_reasoning_parser(_tm(), req, None, stream=False) is None
    msg = _choice(_tm("qwen3-thinking"), _req(response_format={"type": "json_object"}), '{"a": 1}').message
    assert (msg.reasoning_content, msg.content) == (None, '{"a": 1}')


def test_streaming_sends_reasoning_deltas_then_content_deltas():
    texts = ["<think>pl", "<think>plan it</th", "<think>plan it</think>\n\nThe ans", TEXT]
    events = [
        {"text": t, "output_ids": [], "meta_info": {"finish_reason": STOP if i == 3 else None}}
        for i, t in enumerate(texts)
    ]
    tm, req = _tm(), _req(stream=True)

    async def rest():
        for e in events[1:]:
            yield e

    async def run():
        chunks = stream_chunks(
            req,
            rest(),
            events[0],
            "id",
            0,
            "m",
            None,
            lambda: new_reasoning_parser(tm, req, None, stream=True),
            False,
        )
        return [c async for c in chunks]

    lines = asyncio.run(run())
    assert lines[-1] == b"data: [DONE]\n\n"
    deltas = [json.loads(line[len(b"data: ") :])["choices"][0] for line in lines[:-1]]
    assert deltas[0]["delta"]["role"] == "assistant"
    thinking = [d["delta"]["reasoning_content"] for d in deltas if d["delta"]["reasoning_content"]]
    content = [d["delta"]["content"] for d in deltas[1:] if d["delta"]["content"]]
    assert thinking == ["pl", "an it"]
    assert content == ["\n\nThe ans", "wer."]
    assert deltas[-1]["finish_reason"] == "stop"


class _Tok:
    """Just enough tokenizer: '</think>' is the two tokens [90, 91]."""

    def encode(self, text, add_special_tokens=False):
        assert text == "</think>" and not add_special_tokens
        return [90, 91]


def test_reasoning_tokens_count_through_the_end_of_thinking():
    parser = new_reasoning_parser(_tm(), _req(), None, stream=False)
    assert count_reasoning_tokens(parser, _Tok(), [5, 6, 90, 91, 7, 8], thought=True) == 4
    assert count_reasoning_tokens(parser, _Tok(), [5, 6, 90, 7, 91], thought=True) == 5  # never closed
    assert count_reasoning_tokens(parser, _Tok(), [5, 6, 90, 91], thought=False) == 0
    assert count_reasoning_tokens(parser, None, [5, 6, 90, 91], thought=True) == 0


def test_usage_reports_reasoning_tokens_non_streaming_and_streaming():
    tm, req = _tm(), _req()
    out = {"text": TEXT, "output_ids": [1, 2, 3, 90, 91, 4, 5], "meta_info": {"finish_reason": STOP}}
    make_choice(req, 0, out, None, None, new_reasoning_parser(tm, req, None, stream=False), _Tok())
    out["meta_info"].update(prompt_tokens=3, completion_tokens=7)
    usage = usage_of([out], 1)
    assert (usage.reasoning_tokens, usage.completion_tokens_details.reasoning_tokens) == (5, 5)

    sreq = _req(stream=True, stream_options={"include_usage": True})
    first = {"text": "<think>plan", "output_ids": [1, 2], "meta_info": {"finish_reason": None}}
    last = {
        "text": TEXT,
        "output_ids": [1, 2, 3, 90, 91, 4, 5],
        "meta_info": {"finish_reason": STOP, "prompt_tokens": 3, "completion_tokens": 7},
    }

    async def rest():
        yield last

    async def run():
        chunks = stream_chunks(
            sreq,
            rest(),
            first,
            "id",
            0,
            "m",
            None,
            lambda: new_reasoning_parser(tm, sreq, None, stream=True),
            False,
            _Tok(),
        )
        return [c async for c in chunks]

    lines = asyncio.run(run())
    usage_chunk = json.loads(lines[-2][len(b"data: ") :])
    assert usage_chunk["usage"]["reasoning_tokens"] == 5
    assert usage_chunk["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
