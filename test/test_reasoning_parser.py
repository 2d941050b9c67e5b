"""--reasoning-parser: chat responses split a reasoning model's thinking into reasoning_content
(SGLang's ReasoningParser), non-streaming and streaming; constrained output is left whole."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

from sglang_vericache.entrypoints.openai.reasoning import new_reasoning_parser
from sglang_vericache.entrypoints.openai.serving_chat import make_choice, stream_chunks

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
