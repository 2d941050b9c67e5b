"""Typed messages between a drafter and a verifier instance (over a ZMQ DEALER/ROUTER pair, encoded by
wire.py: msgpack headers and raw tensor frames, never pickle; a field added here goes there too).

Drafter -> verifier messages carry `epoch`: the verifier instance they are meant for (0 = any,
for Hello). A verifier answers a message for another epoch with a VerifyResult error (session
messages) and never acts on it, so messages queued for a dead instance cannot reach its successor.
Every verifier -> drafter message carries the verifier's epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_vericache.sampling.sampling_params import SamplingParams

# ---------------------------------------------------------------- drafter -> verifier


@dataclass
class Hello:
    """Sent by a drafter at start and as a heartbeat (every --disagg-timeout / 5 seconds)."""

    drafter_id: str
    epoch: int = 0


@dataclass
class OpenSession:
    """A request the drafter admitted: the verifier prefills its prompt (or loads it from its store).
    kv_from: None when the drafter prefills too (--disagg-prefill local); else the verifier answers
    its prefill with a PrefillResult carrying the exact KV of prompt positions [kv_from, prompt_len)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    top_logprobs_num: int = 0
    epoch: int = 0
    kv_from: int | None = None
    logprob_start_len: int = -1


@dataclass
class VerifyRun:
    """One round: tokens = [t_n, d_1..d_x] at positions n-1.. of a session whose output so far has
    output_len tokens (t_n is the last of them)."""

    rid: str
    round_id: int
    output_len: int
    tokens: list[int]
    epoch: int = 0


@dataclass
class CloseSession:
    rid: str
    epoch: int = 0


# ---------------------------------------------------------------- verifier -> drafter


@dataclass
class Pong:
    """The answer to Hello: the verifier's epoch (a new value means a new instance)."""

    epoch: int
    num_sessions: int = 0


@dataclass
class Refused:
    """The answer to a frame of another wire protocol version (or to a peer this verifier refuses):
    the drafter fails its requests with error."""

    epoch: int
    error: str


@dataclass
class PrefillResult:
    """The verifier's prefill of a session opened with kv_from (--disagg-prefill verifier): the first
    output token (sampled as full mode samples it), its logprobs and the prompt's input logprobs when
    asked, and k, v: [layers, prompt_len - kv_from, kv_heads, head_dim], the exact KV of prompt
    positions [kv_from, prompt_len) (None when the first token already ended the request)."""

    rid: str
    epoch: int
    token: int
    logprob: float | None = None
    top_logprobs: list | None = None
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)


@dataclass
class VerifyResult:
    """accepted: j, the longest draft prefix equal to the verifier's choices; correction: p_j (the
    verifier's token after d_j, a bonus when j = len(drafts)). logprobs / top_logprobs: rows 0..j
    (the emitted tokens), when the session asked for them. k, v: [layers, j+1, kv_heads, head_dim],
    the exact KV of the committed positions t_n, d_1..d_j. error: the round (or the session, with
    round_id -1) failed; the drafter fails the request with this message."""

    rid: str
    round_id: int
    epoch: int
    accepted: int = 0
    correction: int = -1
    logprobs: list[float] | None = None
    top_logprobs: tuple[list, list] | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    error: str | None = None
    meta: dict = field(default_factory=dict)
