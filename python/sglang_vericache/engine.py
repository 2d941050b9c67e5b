"""Engine: the runtime in-process, without HTTP, like `sglang.Engine`.

The TokenizerManager lives on a private event loop in a background thread (its ZMQ sockets and
request states belong to that loop); sync and async callers hand it coroutines. Outputs are the
same dicts as /generate.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, Self

from sglang_vericache.launch_server import model_folder_error
from sglang_vericache.managers.req_input import GenerateReqInput
from sglang_vericache.server_args import ServerArgs, with_kv_mode

logger = logging.getLogger(__name__)
_END = object()


class Engine:
    def __init__(self, model_path: str | None = None, **server_args_kwargs: Any) -> None:
        from sglang_vericache.managers.tokenizer_manager import TokenizerManager

        if model_path is not None:
            server_args_kwargs["model_path"] = model_path
        kv_mode = server_args_kwargs.pop("kv_mode", None)  # --kv-mode: spelled out in the flags that make it
        self.server_args = ServerArgs(**with_kv_mode(server_args_kwargs, kv_mode))
        self.server_args.log_flag_warnings()
        error = model_folder_error(self.server_args)
        if error:
            raise FileNotFoundError(error)
        self._closed = False
        self.tokenizer_manager = TokenizerManager(self.server_args)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vericache-engine", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    @property
    def tokenizer(self):
        return self.tokenizer_manager.tokenizer

    # ------------------------------------------------------------------ plumbing

    def _submit(self, coro):
        if self._closed:
            coro.close()
            raise RuntimeError("the engine is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _start(self, obj: GenerateReqInput):
        return self.tokenizer_manager.generate_request(obj)

    @staticmethod
    async def _next(agen):
        try:
            return await agen.__anext__()
        except StopAsyncIteration:
            return _END

    async def _first(self, obj: GenerateReqInput):
        agen = self.tokenizer_manager.generate_request(obj)
        try:
            return await agen.__anext__()
        finally:
            await agen.aclose()

    @staticmethod
    def _make_input(
        prompt,
        sampling_params,
        input_ids,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        stream,
        return_text_in_logprobs,
        rid,
    ) -> GenerateReqInput:
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=rid,
            stream=stream,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
        )
        obj.normalize()
        return obj

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """A dict for one prompt, a list for a list of prompts (or n > 1); an iterator of chunks
        (cumulative text, per-chunk output logprobs) when stream=True."""
        obj = self._make_input(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            stream,
            return_text_in_logprobs,
            rid,
        )
        if not stream:
            return self._submit(self._first(obj)).result()
        agen = self._submit(self._start(obj)).result()  # raises on bad input, before iterating
        return self._sync_iter(agen)

    def _sync_iter(self, agen) -> Iterator[dict]:
        try:
            while (item := self._submit(self._next(agen)).result()) is not _END:
                yield item
        finally:
            if not self._closed:
                self._submit(agen.aclose()).result()

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        obj = self._make_input(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            stream,
            return_text_in_logprobs,
            rid,
        )
        if not stream:
            return await asyncio.wrap_future(self._submit(self._first(obj)))
        agen = await asyncio.wrap_future(self._submit(self._start(obj)))
        return self._async_iter(agen)

    async def _async_iter(self, agen) -> AsyncIterator[dict]:
        try:
            while (item := await asyncio.wrap_future(self._submit(self._next(agen)))) is not _END:
                yield item
        finally:
            if not self._closed:
                await asyncio.wrap_future(self._submit(agen.aclose()))

    def flush_cache(self) -> bool:
        return self._submit(self.tokenizer_manager.flush_cache()).result().success

    def get_server_info(self) -> dict:
        import dataclasses

        stats = self._submit(self.tokenizer_manager.get_stats()).result()
        return {**self.server_args.public_dict(), "internal_states": [dataclasses.asdict(stats)]}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        except Exception:
            logger.exception("engine shutdown: stopping the TokenizerManager failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        atexit.unregister(self.shutdown)

    async def _stop(self) -> None:
        self.tokenizer_manager.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
