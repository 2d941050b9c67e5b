"""TokenizerManager._stream: which updates become streaming events (no scheduler, no model)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from sglang_vericache.managers.io_struct import ReqOutput
from sglang_vericache.managers.req_state import ReqState
from sglang_vericache.managers.tokenizer_manager import TokenizerManager
from sglang_vericache.sampling.sampling_params import SamplingParams


def _state() -> ReqState:
    return ReqState(
        rid="r",
        index=0,
        stream=True,
        params=SamplingParams(max_new_tokens=4),
        prompt_ids=[5, 6],
        return_logprob=False,
        top_logprobs_num=0,
        return_text_in_logprobs=False,
    )


def _update(state: ReqState, ids: list[int], finished: bool) -> None:
    n = len(state.output_ids) + len(ids)
    reason = {"type": "length", "length": n} if finished else None
    state.update(ReqOutput("r", ids, reason, prompt_tokens=2, completion_tokens=n, cached_tokens=0), None)
    state.event.set()


def _stream(interval: int, state: ReqState):
    manager = SimpleNamespace(stream_interval=interval)
    manager._wait_event = lambda s, request: TokenizerManager._wait_event(manager, s, request)
    return TokenizerManager._stream(manager, [state], None, False)


def test_a_finish_that_lands_while_the_consumer_holds_an_event_still_gets_its_event():
    async def run():
        state = _state()
        events = _stream(1, state)
        _update(state, [11], finished=False)
        first = await events.__anext__()
        # The scheduler's last message arrives before the consumer asks for the next event.
        _update(state, [12, 13], finished=True)
        rest = [e async for e in events]
        return first, rest

    first, rest = asyncio.run(run())
    assert first["output_ids"] == [11] and first["meta_info"]["finish_reason"] is None
    assert len(rest) == 1
    assert rest[0]["output_ids"] == [11, 12, 13]
    assert rest[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert rest[0]["meta_info"]["completion_tokens"] == 3


def test_stream_interval_groups_updates_and_the_finish_is_always_an_event():
    async def run():
        state = _state()
        events = _stream(3, state)
        got = []

        async def consume():
            async for event in events:
                got.append(event["output_ids"])

        consumer = asyncio.ensure_future(consume())
        for ids, finished in (([1], False), ([2], False), ([3], False), ([4], False), ([5], True)):
            _update(state, ids, finished)
            for _ in range(5):  # the consumer takes this update before the next one lands
                await asyncio.sleep(0)
        await consumer
        return got

    # The first token at once; then an event per 3 new tokens; the finish regardless of count.
    assert asyncio.run(run()) == [[1], [1, 2, 3, 4], [1, 2, 3, 4, 5]]
