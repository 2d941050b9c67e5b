"""Typed messages between a drafter and a verifier instance, declared once: these msgspec structs are
both what the code handles and what wire.py encodes (msgpack headers and raw tensor frames, never
pickle). Their annotations are the wire's checks: a decoded message has exactly these fields, of these
types and bounds, or it is refused.

Drafter -> verifier messages carry `epoch`: the verifier instance they are meant for (0 = any,
for Hello). A verifier answers a message for another epoch with a VerifyResult error (session
messages) and never acts on it, so messages queued for a dead instance cannot reach its successor.
Every verifier -> drafter message carries the verifier's epoch.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
import torch

from sglang_vericache.sampling.sampling_params import SamplingParams

U63 = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Meta = dict[Text, Union[str, int, float, bool, None]]
TopPairs = list[tuple[float, int]]


class Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    """A message's type name travels as its "type" field; torch.Tensor fields travel as raw frames."""


# ---------------------------------------------------------------- drafter -> verifier


class Hello(Message, tag="Hello"):
    """Sent by a drafter at start and as a heartbeat (every --disagg-timeout / 5 seconds)."""

    drafter_id: Text
    epoch: U63 = 0


class OpenSession(Message, tag="OpenSession"):
    """A request the drafter admitted: the verifier prefills its prompt (or loads it from its store).
    kv_from: None when the drafter prefills too (--disagg-prefill local); else the verifier answers
    its prefill with a PrefillResult carrying the exact KV of prompt positions [kv_from, prompt_len)."""

    rid: Text
    input_ids: list[TokenId]
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)] = 0
    epoch: U63 = 0
    kv_from: U63 | None = None
    logprob_start_len: Annotated[int, msgspec.Meta(ge=-1)] = -1


class VerifyRun(Message, tag="VerifyRun"):
    """One round: tokens = [t_n, d_1..d_x] at positions n-1.. of a session whose output so far has
    output_len tokens (t_n is the last of them)."""

    rid: Text
    round_id: U63
    output_len: U63
    tokens: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    epoch: U63 = 0


class CloseSession(Message, tag="CloseSession"):
    rid: Text
    epoch: U63 = 0


# ---------------------------------------------------------------- verifier -> drafter


class Pong(Message, tag="Pong"):
    """The answer to Hello: the verifier's epoch (a new value means a new instance)."""

    epoch: U63
    num_sessions: U63 = 0


class Refused(Message, tag="Refused"):
    """The answer to a frame of another wire protocol version (or to a peer this verifier refuses):
    the drafter fails its requests with error."""

    epoch: U63
    error: str


class PrefillResult(Message, tag="PrefillResult"):
    """The verifier's prefill of a session opened with kv_from (--disagg-prefill verifier): the first
    output token (sampled as full mode samples it), its logprobs and the prompt's input logprobs when
    asked, and k, v: [layers, prompt_len - kv_from, kv_heads, head_dim], the exact KV of prompt
    positions [kv_from, prompt_len) (None when the first token already ended the request)."""

    rid: Text
    epoch: U63
    token: int
    logprob: float | None = None
    top_logprobs: TopPairs | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[TopPairs | None] | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    meta: Meta = {}


class VerifyResult(Message, tag="VerifyResult"):
    """accepted: j, the longest draft prefix equal to the verifier's choices; correction: p_j (the
    verifier's token after d_j, a bonus when j = len(drafts)). logprobs / top_logprobs: rows 0..j
    (the emitted tokens), when the session asked for them. k, v: [layers, j+1, kv_heads, head_dim],
    the exact KV of the committed positions t_n, d_1..d_j. error: the round (or the session, with
    round_id -1) failed; the drafter fails the request with this message."""

    rid: Text
    round_id: int
    epoch: U63
    accepted: U63 = 0
    correction: int = -1
    logprobs: list[float] | None = None
    top_logprobs: tuple[list[list[float]], list[list[int]]] | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    error: str | None = None
    meta: Meta = {}


TO_VERIFIER = (Hello, OpenSession, VerifyRun, CloseSession)
TO_DRAFTER = (Pong, Refused, PrefillResult, VerifyResult)
AnyMessage = Union[Hello, OpenSession, VerifyRun, CloseSession, Pong, Refused, PrefillResult, VerifyResult]
