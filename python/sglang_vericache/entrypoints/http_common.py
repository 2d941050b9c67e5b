"""What every endpoint module of the HTTP server shares: the TokenizerManager it serves (tm), the
JSON body reader and SGLang's native error shape."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from sglang_vericache.entrypoints.openai.utils import json_response
from sglang_vericache.managers.tokenizer_manager import TokenizerManager
from sglang_vericache.sampling.sampling_params import InvalidRequest

_tm: TokenizerManager | None = None


def tm() -> TokenizerManager:
    assert _tm is not None, "the server has no TokenizerManager"
    return _tm


def set_tokenizer_manager(manager: TokenizerManager) -> None:
    global _tm
    _tm = manager


def native_error(message: str, status_code: int = 400) -> Response:
    return json_response({"error": {"message": message, "code": status_code}}, status_code)


async def read_json(request: Request) -> Any:
    body = await request.body()
    if not body:
        raise InvalidRequest("the request body is empty; expected a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"malformed JSON body: {e}") from None
