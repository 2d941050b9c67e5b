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
from typing import Annotated

import msgspec
import torch

from sglang_vericache.disagg import messages as m

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


class WireError(ValueError):
    """A frame this side refuses (it is dropped, never acted on)."""


class VersionMismatch(WireError):
    def __init__(self, peer_version, own_version: int):
        self.peer_version, self.own_version = peer_version, own_version
        super().__init__(f"disagg wire protocol version {peer_version!r}, expected version {own_version}")


class TensorSpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What a header holds for a tensor field: [dtype name, shape]; its bytes are the next frame."""

    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]


class _Probe(msgspec.Struct):
    """What every version can read of any header: its version."""

    v: object = None


class Header(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    msg: m.AnyMessage


_probe_decoder = msgspec.msgpack.Decoder(_Probe)


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
                 accept: tuple[type, ...] = m.TO_VERIFIER + m.TO_DRAFTER):
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

    def encode(self, msg: m.Message) -> list:
        if type(msg) not in m.TO_VERIFIER + m.TO_DRAFTER:
            raise TypeError(f"{type(msg).__name__} is not a disagg message")
        tensors = []

        def tensor_spec(value):  # tensor fields, in field order: a spec in the header, bytes in a frame
            if not isinstance(value, torch.Tensor):
                raise NotImplementedError(f"the disagg wire carries no {type(value).__name__}")
            spec, data = _tensor_bytes(value)
            tensors.append(data)
            return spec

        header = msgspec.msgpack.Encoder(enc_hook=tensor_spec).encode(Header(self.version, msg))
        frames = [header, *tensors]
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
        specs: list[tuple[TensorSpec, torch.Tensor]] = []
        placeholders: dict[int, int] = {}  # id(placeholder tensor) -> its index in specs

        def tensor_spec(cls, obj):  # a tensor field's [dtype, shape]: a placeholder until its frame is checked
            if cls is not torch.Tensor:
                raise NotImplementedError
            spec = msgspec.convert(obj, TensorSpec)
            if spec.dtype not in TENSOR_DTYPES:
                raise ValueError(f"tensor dtype {spec.dtype!r} is not one of {', '.join(TENSOR_DTYPES)}")
            placeholder = torch.empty(0)
            placeholders[id(placeholder)] = len(specs)
            specs.append((spec, placeholder))
            return placeholder

        try:
            msg = msgspec.msgpack.Decoder(Header, dec_hook=tensor_spec).decode(frames[0]).msg
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError(f"a header that does not decode ({e})") from None
        if len(frames) - 1 != len(specs):
            hint = " (an HMAC? this side has no --disagg-secret)" if self.key is None and len(
                frames) - 1 == len(specs) + 1 and len(frames[-1]) == MAC_BYTES else ""
            raise WireError(f"{len(frames) - 1} tensor frames for the {len(specs)} tensors its header "
                            f"names{hint}")
        for (spec, _), frame in zip(specs, frames[1:]):
            _check_tensor(spec, frame)
        if type(msg) not in self.accept:
            raise WireError(f"a {type(msg).__name__}, which this side never receives")
        for name in msg.__struct_fields__:
            i = placeholders.get(id(getattr(msg, name)))
            if i is not None:
                setattr(msg, name, _tensor_from(specs[i][0], frames[1 + i]))
        if isinstance(msg, m.OpenSession):
            try:
                msg.sampling_params.check_types()
            except ValueError as e:
                raise WireError(f"bad sampling params ({e})") from None
        return msg


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
