"""Page-aligned prefix hash chains: the keys under which stored KV pages are found.

    key_0 = H(ns,      tokens[0:P])        ns    = StoreNamespace.digest()
    key_i = H(key_i-1, tokens[i*P:(i+1)*P]) H     = blake2b, 16-byte digest, of prev || int32-LE tokens

Invariants:
  - key_i names page i of a prefix AND everything before it: two token lists share key_i iff they
    share pages 0..i (up to 2^-128 collisions), so one differing token changes every key from its
    page on and none before it.
  - Only whole pages get keys; a trailing partial page never does (it is never stored).
  - Keys depend only on the tokens and the namespace (no process, machine or Python hash seed), so
    any instance computes the same keys. The namespace names everything the bytes depend on (model,
    tier, compressor and ratio, page size, dtype), so two tiers or models never share a key.
Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from typing import Iterable, Literal, Sequence

DIGEST_SIZE = 16  # bytes; keys are the hex digests (32 chars)
FORMAT = "vericache-kv-store-v1"  # bump when the page bytes' format changes: old keys then miss

Tier = Literal["exact", "compressed"]


@dataclass(frozen=True)
class StoreNamespace:
    """Everything a stored page's bytes depend on besides its tokens.

    model: an identity that changes whenever the weights do (e.g. served name + revision, or a
    digest of the checkpoint); the store cannot check it, so two checkpoints given one name share KV.
    """

    model: str
    tier: Tier
    page_size: int
    dtype: str  # exact tier's dtype, e.g. "bfloat16"
    compressor: str | None = None  # compressed tier only: --kv-compressor name
    ratio: float | None = None  # compressed tier only: --kv-compression-ratio

    def __post_init__(self) -> None:
        if self.tier not in ("exact", "compressed"):
            raise ValueError(f"tier must be 'exact' or 'compressed', got {self.tier!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if (self.tier == "compressed") != (self.compressor is not None):
            raise ValueError("a compressor is named iff the tier is 'compressed'")
        if self.tier == "exact" and self.ratio is not None:
            raise ValueError("the exact tier has no compression ratio")

    def digest(self) -> bytes:
        """Stable 16-byte digest of (FORMAT, every field) in canonical JSON."""
        blob = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(blob.encode(), digest_size=DIGEST_SIZE).digest()


def page_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes; ids must be in [0, 2^31)."""
    try:
        data = struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be int32: {e}") from None
    if any(t < 0 for t in tokens):
        raise ValueError("token ids must be >= 0")
    return data


def next_hash(prev: bytes, page_tokens: Sequence[int]) -> bytes:
    """One link of the chain: H(prev || int32-LE page tokens)."""
    return hashlib.blake2b(prev + page_bytes(page_tokens), digest_size=DIGEST_SIZE).digest()


def page_hashes(tokens: Iterable[int], namespace: StoreNamespace, start: bytes | None = None) -> list[bytes]:
    """Digests of every whole page of tokens (the partial last page gets none).

    start: the digest of the page before tokens[0] when tokens continue an already hashed prefix
    (tokens must then begin on a page boundary); None -> tokens start at position 0.
    """
    toks = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    p = namespace.page_size
    prev = namespace.digest() if start is None else start
    out = []
    for i in range(len(toks) // p):
        prev = next_hash(prev, toks[i * p : (i + 1) * p])
        out.append(prev)
    return out


def page_keys(tokens: Iterable[int], namespace: StoreNamespace) -> list[str]:
    """Store keys (hex digests) of every whole page of tokens, from position 0."""
    return [h.hex() for h in page_hashes(tokens, namespace)]
