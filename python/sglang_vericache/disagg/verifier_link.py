"""VerifierLink: the drafter's socket to one verifier (disagg/remote_verify.py drives it)."""

from __future__ import annotations

import logging
import os
import time

import zmq

from sglang_vericache.disagg.messages import TO_DRAFTER, Hello, Refused
from sglang_vericache.disagg.wire import Codec, DropLog, VersionMismatch, WireError

logger = logging.getLogger(__name__)


class VerifierLink:
    """The drafter's DEALER socket to one verifier, and what the drafter knows of it.

    up: a verifier answered (epoch known) and has not been silent for `timeout` seconds since the
    drafter last expected an answer. Hello goes out every timeout/5 seconds as a heartbeat (every
    0.2 s at most while no verifier is up).
    ZMQ_IMMEDIATE: nothing is queued while there is no connection, so a message meant for a dead
    verifier can never reach its successor (and every message carries the epoch anyway).
    """

    def __init__(self, addr: str, timeout_s: float, secret: str | None = None):
        self.addr = addr
        self.timeout = timeout_s
        self.drafter_id = f"drafter-{os.getpid()}-{time.time_ns()}"
        # The process-wide context: a private one would block in term() if it were garbage-collected
        # before its socket.
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, self.drafter_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sock.connect(addr)
        self.codec = Codec(secret, accept=TO_DRAFTER)  # wire.py: no pickle; refused frames are dropped
        self.drops = DropLog(f"drafter (verifier at {addr})")
        # Why the verifier refuses this drafter (another protocol version), until one answers in ours.
        self.refused: str | None = None
        self.epoch: int | None = None
        self.waiting_since: float | None = None  # the first send not yet followed by any answer
        self.last_hello = 0.0

    @property
    def up(self) -> bool:
        return self.epoch is not None

    def send(self, msg) -> bool:
        """False if no connection took it (the verifier is down or not reachable yet)."""
        try:
            self.sock.send_multipart(self.codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            if self.waiting_since is None:  # expected to talk and could not: counts as silence
                self.waiting_since = time.monotonic()
            return False
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        return True

    def recv(self) -> list:
        out = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = self.codec.decode(frames)
            except VersionMismatch as e:
                self.refuse(f"verifier at {self.addr} speaks disagg wire protocol version "
                            f"{e.peer_version!r}; this drafter speaks version {e.own_version} (run the "
                            "same sglang-vericache version on both instances)")
                continue
            except WireError as e:
                self.drops.drop(b"", e)
                continue
            if isinstance(msg, Refused):
                self.refuse(msg.error)
                continue
            self.waiting_since, self.refused = None, None
            out.append(msg)

    def refuse(self, error: str) -> None:
        """The verifier will not talk to this drafter: it counts as down, and requests fail with error."""
        if self.refused != error:
            logger.error("%s", error)
        self.refused, self.epoch, self.waiting_since = error, None, None

    def heartbeat(self) -> bool:
        """Sends Hello when due; True if the verifier was up and has now been silent too long."""
        now = time.monotonic()
        interval = self.timeout / 5 if self.up else min(0.2, self.timeout / 5)  # looking for it: more often
        if now - self.last_hello >= interval:
            self.last_hello = now
            self.send(Hello(self.drafter_id, self.epoch or 0))
        if self.up and self.waiting_since is not None and now - self.waiting_since > self.timeout:
            self.epoch, self.waiting_since = None, None
            return True
        return False

    def close(self) -> None:
        self.sock.close(0)
