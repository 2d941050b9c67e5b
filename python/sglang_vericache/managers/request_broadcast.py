"""Rank 0's scheduler messages, broadcast each iteration to the other tensor-parallel ranks.

Rank 0 alone reads the TokenizerManager's socket. At the start of every scheduler iteration it
broadcasts the messages that change scheduling state (new requests, aborts, cache flushes) to the
other ranks, which handle them in the same order, so every rank's scheduler holds the same queues
and takes the same decisions. Queries (stats, profiling) stay on rank 0. The bytes are msgpack of the
typed messages (msgspec), never pickle: ranks may sit on other hosts.
"""

from __future__ import annotations

import msgspec

from sglang_vericache.distributed.parallel_state import TPGroup
from sglang_vericache.managers.io_struct import AbortReq, FlushCacheReq, TokenizedGenerateReqInput

BROADCAST_TYPES = {cls.__name__: cls for cls in (TokenizedGenerateReqInput, AbortReq, FlushCacheReq)}


def encode(msgs: list) -> bytes:
    return msgspec.msgpack.encode([[type(m).__name__, msgspec.to_builtins(m)] for m in msgs])


def decode(data: bytes) -> list:
    out = []
    for name, fields in msgspec.msgpack.decode(data, type=list[tuple[str, dict]]):
        if name not in BROADCAST_TYPES:
            raise ValueError(f"rank 0 broadcast an unknown message type {name!r}")
        out.append(msgspec.convert(fields, BROADCAST_TYPES[name]))
    return out


def exchange(tp: TPGroup, msgs: list) -> list:
    """Rank 0: msgs (all it received) -> the same; other ranks: [] -> rank 0's broadcast subset, in order."""
    if tp.size == 1:
        return msgs
    if tp.is_first:
        tp.broadcast_bytes(encode([m for m in msgs if type(m).__name__ in BROADCAST_TYPES]))
        return msgs
    return decode(tp.broadcast_bytes(None))
