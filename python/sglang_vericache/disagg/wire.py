"""The drafter <-> verifier wire format: typed msgpack headers, raw tensor frames, optional HMAC.

Nothing that crosses the TCP socket is unpickled. One message is one ZMQ multipart message:

    frame 0       header: a msgpack map {"v": PROTOCOL_VERSION, "msg": {"type": NAME, ...fields}}, decoded
                  with msgspec into a fixed union of message structs (an unknown type, an unknown or
                  missing field, or a value of the wrong type is refused); a tensor field holds
                  [dtype name, shape], the dtype one of TENSOR_DTYPES.
    frames 1..n   one frame per tensor field that is set, in the message's field order: its raw bytes
                  (C order), exactly numel * itemsize of them; rebuilt with torch.frombuffer over an
                  owned copy.
    frame n+1     with a shared secret (--disagg-secret) only: HMAC-SHA256 over frames 0..n (each one
                  length-prefixed), checked with hmac.compare_digest before anything is decoded.

"v" stays the first thing any version can read: a peer of another version gets VersionMismatch
(naming both versions), never a misparsed message. Codec.decode raises WireError for anything else
it refuses; callers drop that frame (DropLog logs once per peer).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
from typing import Annotated, Union

import msgspec
import torch

from sglang_vericache.disagg import messages as m
from sglang_vericache.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
SECRET_ENV = "SGLANG_VERICACHE_DISAGG_SECRET"
MAC_BYTES = 32
_MAC_CONTEXT = b"sglang-vericache disagg wire\0"

# The only dtypes a tensor frame may have (by name; never a class or code path from the wire).
TENSOR_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
                 "bool", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in TENSOR_DTYPES.items()}

U63 = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Meta = dict[Text, Union[str, int, float, bool, None]]
TopPairs = list[tuple[float, int]]


class WireError(ValueError):
    """A frame this side refuses (it is dropped, never acted on)."""


class VersionMismatch(WireError):
    def __init__(self, peer_version, own_version: int):
        self.peer_version, self.own_version = peer_version, own_version
        super().__init__(f"disagg wire protocol version {peer_version!r}, expected version {own_version}")


class TensorSpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    pass


# One struct per message of messages.py, field for field (a test keeps the two equal); tensors as specs.


class Hello(_Msg, tag="Hello"):
    drafter_id: Text
    epoch: U63 = 0


class OpenSession(_Msg, tag="OpenSession"):
    rid: Text
    input_ids: list[TokenId]
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)] = 0
    epoch: U63 = 0
    kv_from: U63 | None = None
    logprob_start_len: Annotated[int, msgspec.Meta(ge=-1)] = -1


class VerifyRun(_Msg, tag="VerifyRun"):
    rid: Text
    round_id: U63
    output_len: U63
    tokens: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    epoch: U63 = 0


class CloseSession(_Msg, tag="CloseSession"):
    rid: Text
    epoch: U63 = 0


class Pong(_Msg, tag="Pong"):
    epoch: U63
    num_sessions: U63 = 0


class Refused(_Msg, tag="Refused"):
    epoch: U63
    error: str


class PrefillResult(_Msg, tag="PrefillResult"):
    rid: Text
    epoch: U63
    token: int
    logprob: float | None = None
    top_logprobs: TopPairs | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[TopPairs | None] | None = None
    k: TensorSpec | None = None
    v: TensorSpec | None = None
    meta: Meta = {}


class VerifyResult(_Msg, tag="VerifyResult"):
    rid: Text
    round_id: int
    epoch: U63
    accepted: U63 = 0
    correction: int = -1
    logprobs: list[float] | None = None
    top_logprobs: tuple[list[list[float]], list[list[int]]] | None = None
    k: TensorSpec | None = None
    v: TensorSpec | None = None
    error: str | None = None
    meta: Meta = {}


WIRE_TYPES: dict[type, type[_Msg]] = {
    m.Hello: Hello, m.OpenSession: OpenSession, m.VerifyRun: VerifyRun, m.CloseSession: CloseSession,
    m.Pong: Pong, m.Refused: Refused, m.PrefillResult: PrefillResult, m.VerifyResult: VerifyResult,
}
MESSAGE_TYPES: dict[type[_Msg], type] = {w: d for d, w in WIRE_TYPES.items()}
TO_VERIFIER = (m.Hello, m.OpenSession, m.VerifyRun, m.CloseSession)
TO_DRAFTER = (m.Pong, m.Refused, m.PrefillResult, m.VerifyResult)
TENSOR_FIELDS: dict[type[_Msg], tuple[str, ...]] = {w: () for w in MESSAGE_TYPES}
TENSOR_FIELDS.update({PrefillResult: ("k", "v"), VerifyResult: ("k", "v")})


class _Probe(msgspec.Struct):
    """What every version can read of any header: its version."""

    v: object = None


class Header(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    msg: Union[Hello, OpenSession, VerifyRun, CloseSession, Pong, Refused, PrefillResult, VerifyResult]


_encoder = msgspec.msgpack.Encoder()
_probe_decoder = msgspec.msgpack.Decoder(_Probe)
_header_decoder = msgspec.msgpack.Decoder(Header)


def _tensor_bytes(t: torch.Tensor) -> tuple[TensorSpec, memoryview]:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise TypeError(f"the disagg wire carries no {t.dtype} tensors")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return TensorSpec(name, list(t.shape)), memoryview(flat.view(torch.uint8).numpy())


def _check_tensor(spec: TensorSpec, frame) -> None:
    dtype = TENSOR_DTYPES.get(spec.dtype)
    if dtype is None:
        raise WireError(f"tensor dtype {spec.dtype!r} is not one of {', '.join(TENSOR_DTYPES)}")
    want = math.prod(spec.shape) * torch.empty((), dtype=dtype).element_size()
    got = len(memoryview(frame).cast("B"))
    if got != want:
        raise WireError(f"a {spec.dtype} tensor of shape {spec.shape} is {want} bytes; its frame has {got}")


def _tensor_from(spec: TensorSpec, frame) -> torch.Tensor:
    """An owned tensor (over a copy of the frame); _check_tensor passed."""
    dtype = TENSOR_DTYPES[spec.dtype]
    if math.prod(spec.shape) == 0:
        return torch.empty(spec.shape, dtype=dtype)
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(dtype).reshape(spec.shape)


class Codec:
    """Encodes messages.py messages to frames and back, for one protocol version and secret; decode
    refuses the message types not in accept (a verifier takes TO_VERIFIER, a drafter TO_DRAFTER)."""

    def __init__(self, secret: str | bytes | None = None, version: int = PROTOCOL_VERSION,
                 accept: tuple[type, ...] = TO_VERIFIER + TO_DRAFTER):
        self.key = secret.encode() if isinstance(secret, str) else secret
        self.version = version
        self.accept = accept

    def mac(self, frames) -> bytes:
        h = hmac.new(self.key, _MAC_CONTEXT, hashlib.sha256)
        for f in frames:
            f = memoryview(f).cast("B")
            h.update(len(f).to_bytes(8, "big"))
            h.update(f)
        return h.digest()

    def encode(self, msg) -> list:
        wire_type = WIRE_TYPES.get(type(msg))
        if wire_type is None:
            raise TypeError(f"{type(msg).__name__} is not a disagg message")
        fields = {}
        tensors = []
        for name in wire_type.__struct_fields__:
            value = getattr(msg, name)
            if name in TENSOR_FIELDS[wire_type] and value is not None:
                value, data = _tensor_bytes(value)
                tensors.append(data)
            fields[name] = value
        frames = [_encoder.encode(Header(self.version, wire_type(**fields))), *tensors]
        if self.key is not None:
            frames.append(self.mac(frames))
        return frames

    def decode(self, frames: list):
        """frames -> a messages.py message; WireError (VersionMismatch for another version) if refused."""
        if not frames:
            raise WireError("an empty message")
        if self.key is not None:
            if len(frames) < 2 or len(frames[-1]) != MAC_BYTES:
                raise WireError("no HMAC (this side has a --disagg-secret)")
            if not hmac.compare_digest(self.mac(frames[:-1]), bytes(frames[-1])):
                raise WireError("a wrong HMAC (is --disagg-secret the same on both sides?)")
            frames = frames[:-1]
        try:
            version = _probe_decoder.decode(frames[0]).v
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError(f"a header that does not decode ({e})") from None
        if version is None:
            raise WireError("a header without a protocol version")
        if type(version) is not int or version != self.version:
            raise VersionMismatch(version, self.version)
        try:
            wire = _header_decoder.decode(frames[0]).msg
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError(f"a header that does not decode ({e})") from None
        names = TENSOR_FIELDS[type(wire)]
        specs = [(n, getattr(wire, n)) for n in names if getattr(wire, n) is not None]
        if len(frames) - 1 != len(specs):
            hint = " (an HMAC? this side has no --disagg-secret)" if self.key is None and len(
                frames) - 1 == len(specs) + 1 and len(frames[-1]) == MAC_BYTES else ""
            raise WireError(f"{len(frames) - 1} tensor frames for the {len(specs)} tensors its header "
                            f"names{hint}")
        for (_, spec), frame in zip(specs, frames[1:]):
            _check_tensor(spec, frame)
        cls = MESSAGE_TYPES[type(wire)]
        if cls not in self.accept:
            raise WireError(f"a {cls.__name__}, which this side never receives")
        fields = {f: getattr(wire, f) for f in wire.__struct_fields__}
        for (name, spec), frame in zip(specs, frames[1:]):
            fields[name] = _tensor_from(spec, frame)
        if isinstance(wire, OpenSession):
            try:
                fields["sampling_params"].check_types()
            except ValueError as e:
                raise WireError(f"bad sampling params ({e})") from None
        return cls(**fields)


class DropLog:
    """Counts refused frames and logs the first one from each peer (a flood logs one line per peer;
    past MAX_PEERS distinct peers, one more line, then only the counter)."""

    MAX_PEERS = 4096

    def __init__(self, side: str):
        self.side = side
        self.count = 0
        self.peers: set[bytes] = set()
        self.full = False

    def drop(self, peer: bytes, error: Exception) -> None:
        self.count += 1
        if peer in self.peers or self.full:
            return
        if len(self.peers) >= self.MAX_PEERS:
            self.full = True
            logger.warning("%s: frames refused from more than %d peers; no longer logging new ones",
                           self.side, self.MAX_PEERS)
            return
        self.peers.add(peer)
        logger.warning("%s: dropping a frame from peer %s: %s (logged once per peer; later ones dropped "
                       "silently)", self.side, peer.hex() or "-", error)
