"""KV store: prompt KV pages in a store shared by instances, found by prefix hash chains
(mem_cache/storage/)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sglang_vericache.server_args_groups.base import ArgsGroup, arg, flag_of, parse_bytes

KV_STORE_KINDS = ("none", "file", "redis")  # = mem_cache.storage.KV_STORE_KINDS
KV_STORE_TIERS = ("auto", "exact", "compressed", "both")


def default_kv_store_path() -> str:
    """Where --kv-store file keeps its pages when --kv-store-path is not given."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "sglang-vericache", "kv-store")


def check_redis_url(url: str) -> None:
    """Raises ValueError naming the flag unless url is a Redis URL redis-py can connect with."""
    from urllib.parse import urlparse

    try:
        u = urlparse(url)
        port = u.port
    except ValueError as e:
        raise ValueError(f"--kv-store-url {url!r} is not a valid URL: {e}") from None
    ok = (u.scheme in ("redis", "rediss") and bool(u.hostname)) or (u.scheme == "unix" and bool(u.path))
    db = u.path.strip("/") if u.scheme != "unix" else ""
    if not ok or (db and not db.isdigit()) or port == 0:
        raise ValueError(f"--kv-store-url must look like redis://HOST:PORT/DB (or rediss://, unix://PATH), got {url!r}")


@dataclass
class KVStoreArgs(ArgsGroup):
    TITLE = "KV store"

    kv_store: str = arg("none", choices=KV_STORE_KINDS,
        help="Keep prompt KV pages in a shared store that any instance can load prefixes from: file (a "
             "directory on this host), redis (a Redis server), none. Store trouble never fails a "
             "request: the prefix is recomputed.")
    kv_store_path: str | None = arg(None,  # None: default_kv_store_path(), filled in by check()
        help="Directory of the file KV store (default: $XDG_CACHE_HOME or ~/.cache, "
             "/sglang-vericache/kv-store).")
    kv_store_url: str = arg("redis://127.0.0.1:6379/0",
        help="Redis server of the redis KV store: redis://[:password@]HOST:PORT/DB, rediss://..., or "
             "unix://PATH.")
    kv_store_capacity: str | None = arg(None,
        help="Most bytes the KV store may hold (e.g. 20GB); least recently used pages are evicted. "
             "Default: unlimited.")
    kv_store_bandwidth: str | None = arg(None,
        help="Throttle KV store reads and writes to this many bytes/s (e.g. 1GB), modelling the link "
             "between this instance and the store. Default: unthrottled.")
    kv_store_timeout: float = arg(1.0,
        help="Seconds a KV store call may take before the store counts as down (it is then skipped, "
             "with a warning, and retried later).")
    kv_store_tiers: str = arg("auto", choices=KV_STORE_TIERS,
        help="Which KV tiers go through the store: exact, compressed, both, or auto (exact in full mode, "
             "both in lossy and VeriCache modes).")

    @property
    def kv_store_tier_set(self) -> tuple[str, ...]:
        """Tiers written to and loaded from the KV store. auto: exact in full mode, both in the
        two-tier modes (a tree node always holds exact KV, and prefilling the rest of a prompt
        attends over the exact prefix, so lossy needs exact pages too)."""
        if self.kv_store == "none":
            return ()
        tiers = self.kv_store_tiers
        if tiers == "auto":
            tiers = "exact" if self.kv_mode == "full" else "both"
            if self.disagg_prefill == "verifier":
                tiers = "compressed"  # the drafter never holds a prompt's exact KV
        return ("exact", "compressed") if tiers == "both" else (tiers,)

    def check(self) -> None:
        self.check_choice("kv_store", KV_STORE_KINDS)
        self.check_choice("kv_store_tiers", KV_STORE_TIERS)
        if self.kv_store_path is not None and self.kv_store != "file":
            raise ValueError(f"--kv-store-path is for --kv-store file (got --kv-store {self.kv_store})")
        if self.kv_store == "none":
            return
        if self.kv_store == "file" and not self.kv_store_path:
            self.kv_store_path = default_kv_store_path()
        if self.kv_store == "redis":
            check_redis_url(self.kv_store_url)
        for name in ("kv_store_capacity", "kv_store_bandwidth"):
            value = getattr(self, name)
            if value is not None and parse_bytes(value, flag_of(name)) <= 0:
                raise ValueError(f"{flag_of(name)} must be > 0, got {value!r}")
        if not self.kv_store_timeout > 0:
            raise ValueError(f"--kv-store-timeout must be > 0 seconds, got {self.kv_store_timeout}")
        if self.kv_mode == "full" and self.kv_store_tiers in ("compressed", "both"):
            raise ValueError(f"--kv-store-tiers {self.kv_store_tiers} needs a compressed tier (--kv-compressor); "
                             "full mode stores only the exact tier")

    def warnings(self) -> list[str]:
        if self.kv_store != "none" and self.disable_radix_cache:
            return [f"--kv-store {self.kv_store} with --disable-radix-cache: pages are written to the store "
                    "but never read (loaded pages live in the radix tree)"]
        return []
