"""One benchmark request per backend, timed as sglang.bench_serving times it.

TTFT: from sending the request to the first event that carries output. ITL: the gaps between
later events, spread evenly over the tokens each event carries (VeriCache streams accepted drafts
several at a time). Token counts are the server's: meta_info's completion_tokens and prompt_tokens
(native), usage (OpenAI: asked for with stream_options.include_usage when streaming).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp

AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class RequestFuncInput:
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    extra_request_body: dict[str, Any]
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    error: str = ""
    start_time: float = 0.0
    spec_accept_length: float | None = None

    @staticmethod
    def init_new(inp: RequestFuncInput) -> RequestFuncOutput:
        return RequestFuncOutput(prompt_len=inp.prompt_len)


class _Timer:
    """Event times of one request: the first output event gives TTFT, later ones ITL entries."""

    def __init__(self, out: RequestFuncOutput) -> None:
        self.out = out
        self.start = out.start_time = time.perf_counter()
        self.last = self.start

    def tokens(self, n: int) -> None:
        """An event carrying n (>= 1) new output tokens."""
        now = time.perf_counter()
        if not self.out.ttft:
            self.out.ttft = now - self.start
        else:
            self.out.itl.extend([(now - self.last) / n] * n)
        self.last = now


def _sse_payloads(line: bytes) -> dict | None:
    """An SSE line's JSON payload; None for blank lines and [DONE]."""
    line = line.strip()
    if not line:
        return None
    if line.startswith(b"data:"):
        line = line[5:].strip()
    if line == b"[DONE]":
        return None
    data = json.loads(line)
    if isinstance(data, dict) and "error" in data and not data.get("choices") and "meta_info" not in data:
        raise RuntimeError(f"server error: {data['error']}")
    return data


async def _post(inp: RequestFuncInput, payload: dict, on_data: Callable[[dict, _Timer], None],
                out: RequestFuncOutput) -> RequestFuncOutput:
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT) as session:
        timer = _Timer(out)
        try:
            async with session.post(inp.api_url, json=payload, headers=inp.headers) as response:
                if response.status != 200:
                    out.error = f"{response.status} {response.reason}: {await response.text()}"
                    return out
                if inp.stream:
                    async for line in response.content:
                        data = _sse_payloads(line)
                        if data is not None:
                            on_data(data, timer)
                else:
                    body = await response.json()
                    for data in body if isinstance(body, list) else [body]:
                        on_data(data, timer)
            out.latency = time.perf_counter() - timer.start
            out.success = True
        except Exception:  # noqa: BLE001 - a failed request is counted, its error kept
            out.error = "".join(traceback.format_exception(*sys.exc_info()))
    return out


async def request_sglang_generate(inp: RequestFuncInput) -> RequestFuncOutput:
    """Native /generate: text or input_ids; events carry cumulative text and counts."""
    payload = {
        "text" if isinstance(inp.prompt, str) else "input_ids": inp.prompt,
        "sampling_params": {"temperature": inp.temperature, "max_new_tokens": inp.output_len,
                            "ignore_eos": inp.ignore_eos},
        "stream": inp.stream,
        **inp.extra_request_body,
    }
    out = RequestFuncOutput.init_new(inp)
    seen = [0]

    def on_data(data: dict, timer: _Timer) -> None:
        meta = data.get("meta_info") or {}
        n = meta.get("completion_tokens", 0)
        if n > seen[0]:
            timer.tokens(n - seen[0])
            seen[0] = n
        out.generated_text = data.get("text", out.generated_text)
        out.output_len = n
        out.prompt_len = meta.get("prompt_tokens", out.prompt_len)
        if meta.get("spec_accept_length"):
            out.spec_accept_length = meta["spec_accept_length"]

    return await _post(inp, payload, on_data, out)


def _openai_payload(inp: RequestFuncInput) -> dict:
    payload = {"model": inp.model, "max_tokens": inp.output_len, "temperature": inp.temperature,
               "ignore_eos": inp.ignore_eos, "stream": inp.stream}
    if inp.stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


def _openai_on_data(out: RequestFuncOutput, text_of: Callable[[dict], str]):
    def on_data(data: dict, timer: _Timer) -> None:
        for choice in data.get("choices") or []:
            text = text_of(choice)
            if text:
                timer.tokens(1)  # a chunk's token count is not sent: each chunk is one event
                out.generated_text += text
        usage = data.get("usage") or {}
        if usage:
            out.output_len = usage.get("completion_tokens", out.output_len)
            out.prompt_len = usage.get("prompt_tokens", out.prompt_len)

    return on_data


async def request_openai_completions(inp: RequestFuncInput) -> RequestFuncOutput:
    """/v1/completions: text or token ids as the prompt."""
    payload = {**_openai_payload(inp), "prompt": inp.prompt, **inp.extra_request_body}
    out = RequestFuncOutput.init_new(inp)
    return await _post(inp, payload, _openai_on_data(out, lambda c: c.get("text") or ""), out)


async def request_openai_chat(inp: RequestFuncInput) -> RequestFuncOutput:
    """/v1/chat/completions: the prompt as one user message (or the messages given)."""
    messages = inp.prompt if isinstance(inp.prompt, list) and inp.prompt and isinstance(inp.prompt[0], dict) \
        else [{"role": "user", "content": inp.prompt}]
    payload = {**_openai_payload(inp), "messages": messages, **inp.extra_request_body}
    out = RequestFuncOutput.init_new(inp)

    def text_of(choice: dict) -> str:
        part = choice.get("delta") or choice.get("message") or {}
        return (part.get("content") or "") + (part.get("reasoning_content") or "")

    return await _post(inp, payload, _openai_on_data(out, text_of), out)


RequestFunc = Callable[[RequestFuncInput], Awaitable[RequestFuncOutput]]

# backend -> (request function, endpoint path); vllm's names are accepted for the same APIs.
ASYNC_REQUEST_FUNCS: dict[str, tuple[RequestFunc, str]] = {
    "sglang": (request_sglang_generate, "/generate"),
    "sglang-native": (request_sglang_generate, "/generate"),
    "sglang-oai": (request_openai_completions, "/v1/completions"),
    "sglang-oai-chat": (request_openai_chat, "/v1/chat/completions"),
    "vllm": (request_openai_completions, "/v1/completions"),
    "vllm-chat": (request_openai_chat, "/v1/chat/completions"),
}
CHAT_BACKENDS = ("sglang-oai-chat", "vllm-chat")
