"""Fixtures for the KV store tests: Redis servers started from the `redis-server` binary.

- `redis_server` (session): one loopback server shared by the behaviour suite; each test gets its
  own key prefix (`redis_prefix`), so tests never see each other's keys.
- `own_redis` (function): a private server a test may kill and restart (fault tests).
Tests needing Redis skip ONLY if the binary is absent (`bash scripts/start_redis.sh --install`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid

import pytest

REDIS_BIN = shutil.which("redis-server")
NO_REDIS = "redis-server is not installed (bash scripts/start_redis.sh --install)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on 127.0.0.1:port, persistence off, DEBUG allowed from loopback."""

    def __init__(self, workdir: str, port: int | None = None):
        self.workdir, self.port = workdir, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        import redis

        log = open(os.path.join(self.workdir, f"redis-{self.port}.log"), "ab")
        self.proc = subprocess.Popen(
            [REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir, "--enable-debug-command", "local", "--maxmemory-policy", "noeviction"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash: no clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    if REDIS_BIN is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_prefix() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def own_redis(tmp_path):
    if REDIS_BIN is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(str(tmp_path))
    server.start()
    yield server
    server.stop()
