"""Disaggregation: dual-instance VeriCache (disagg/), a drafter instance verifying over ZMQ on a verifier."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sglang_vericache.server_args_groups.base import ArgsGroup, arg, parse_bytes

DISAGG_ROLES = ("none", "drafter", "verifier")
DISAGG_PREFILLS = ("local", "verifier")


@dataclass
class DisaggArgs(ArgsGroup):
    TITLE = "Disaggregation (dual-instance VeriCache)"

    disagg_role: str = arg("none", choices=DISAGG_ROLES,
        help="Dual-instance VeriCache: 'drafter' serves clients and drafts over compressed KV, verifying "
             "on the verifier at --verifier-addr; 'verifier' holds exact KV and verifies drafters' runs "
             "(no HTTP server; listens on --host:--disagg-port). Start the verifier first.")
    verifier_addr: str | None = arg(None,
        help="Drafter: the verifier's ZMQ address, tcp://HOST:PORT (required with --disagg-role drafter; "
             "default: none).")
    disagg_port: int | None = arg(None,  # bound on --host
        help="Verifier: the TCP port drafters connect to (required with --disagg-role verifier; default: "
             "none).")
    disagg_prefill: str = arg("local", choices=DISAGG_PREFILLS,  # verifier: disagg/remote_prefill.py
        help="Drafter: who prefills a prompt. 'local': this instance (exact KV kept in its host tier). "
             "'verifier' (remote prefix caching): the drafter loads only the compressed pages of the "
             "prompt's prefix (from its cache or --kv-store, over its slow link); the verifier loads the "
             "exact prefix from its own store, prefills the rest, and returns the first token and the "
             "exact KV of the positions past the drafter's compressed pages.")
    disagg_bandwidth: str | None = arg(None,
        help="Drafter: bytes/s of its link to the verifier (e.g. 100MB); the exact KV the verifier sends "
             "(prefill and rounds) is delivered no sooner than that link allows. Equal to "
             "--kv-store-bandwidth, the store and the verifier share one link. Default: unthrottled.")
    # The HMAC-SHA256 key of every frame (disagg/wire.py). repr=False, and /server_info shows only whether
    # it is set.
    disagg_secret: str | None = arg(None, repr=False,
        help="Drafter and verifier: a shared secret; every frame between them then carries an "
             "HMAC-SHA256 under it, and frames without a valid one are dropped. Default: "
             "$SGLANG_VERICACHE_DISAGG_SECRET (preferred: a flag shows in the process list), else "
             "unauthenticated (the verifier then warns; keep its --host on loopback).")
    disagg_timeout: float = arg(10.0,
        help="Seconds without an answer before the drafter fails the requests the verifier held (and "
             "without a message before the verifier drops a drafter's sessions).")

    def check(self) -> None:
        """What each role needs, and what it cannot combine with."""
        role = self.disagg_role
        self.check_choice("disagg_role", DISAGG_ROLES)
        if not self.disagg_timeout > 0:
            raise ValueError(f"--disagg-timeout must be > 0 seconds, got {self.disagg_timeout}")
        if self.verifier_addr is not None and role != "drafter":
            raise ValueError("--verifier-addr is for --disagg-role drafter")
        if self.disagg_port is not None and role != "verifier":
            raise ValueError("--disagg-port is for --disagg-role verifier")
        if self.disagg_secret is None and role != "none":
            self.disagg_secret = os.environ.get("SGLANG_VERICACHE_DISAGG_SECRET") or None
        if self.disagg_secret is not None:
            if role == "none":
                raise ValueError("--disagg-secret is for --disagg-role drafter or verifier")
            if not self.disagg_secret:
                raise ValueError("--disagg-secret must not be empty")
        self.check_choice("disagg_prefill", DISAGG_PREFILLS)
        if self.disagg_bandwidth is not None:
            if role != "drafter":
                raise ValueError("--disagg-bandwidth is for --disagg-role drafter")
            parse_bytes(self.disagg_bandwidth, "--disagg-bandwidth")
        if self.disagg_prefill == "verifier":
            if role != "drafter":
                raise ValueError("--disagg-prefill verifier is for --disagg-role drafter")
            if self.kv_store_tiers in ("exact", "both"):
                raise ValueError("--disagg-prefill verifier: the drafter never holds a prompt's exact KV, so "
                                 "its --kv-store-tiers can only be compressed (or auto)")
        if role == "drafter":
            self.check_drafter()
        if role == "verifier":
            if self.disagg_port is None or not 0 < self.disagg_port < 65536:
                raise ValueError(f"--disagg-role verifier needs --disagg-port 1..65535, got {self.disagg_port}")
            if self.kv_mode != "full" or self.kv_offload:
                raise ValueError("--disagg-role verifier keeps exact KV only: drop --kv-compressor, "
                                 "--speculative-algorithm and --kv-offload")

    def check_drafter(self) -> None:
        from urllib.parse import urlparse

        addr = self.verifier_addr
        if addr is None:
            raise ValueError("--disagg-role drafter needs --verifier-addr tcp://HOST:PORT")
        try:
            u = urlparse(addr)
            ok = u.scheme == "tcp" and bool(u.hostname) and u.port is not None and u.port > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--verifier-addr must look like tcp://HOST:PORT, got {addr!r}")
        if self.kv_mode != "vericache":
            raise ValueError("--disagg-role drafter drafts: it needs --speculative-algorithm VERICACHE "
                             "and a --kv-compressor")
        if self.uses_link or self.vericache_schedule in ("adaptive", "staggered"):
            raise ValueError("--disagg-role drafter verifies remotely, in lock-step rounds: "
                             "--link-bandwidth, --vericache-schedule adaptive / staggered and --kv-offload "
                             "do not apply")
