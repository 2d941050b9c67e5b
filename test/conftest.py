"""Shared test fixtures: tiny random checkpoints and servers started as real subprocesses.

- `random_model_dir(family, **config_overrides)` -> a cached checkpoint folder for this session.
- `server(model_dir, *flags)` -> a running `python -m sglang_vericache.launch_server`, cached per
  (model_dir, flags) for the session and killed (with its scheduler) at the end.
- `default_server`: the one most API tests share (random llama, 2048-token context, qwen25 tool parser).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import requests
import torch

# Without CUDA the Triton kernels run under the interpreter, which triton reads when first imported:
# set it before any test module imports triton, directly or through a dependency (xgrammar), so a
# subset of the suite runs the same in any order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from sglang_vericache.testing.triton_interpreter import install as install_fast_interpreter

    install_fast_interpreter()  # device-function calls skip re-patching (see the module)

SERVER_START_TIMEOUT_S = 180
DEFAULT_FAMILY = "llama"
DEFAULT_OVERRIDES = {"max_position_embeddings": 2048}
DEFAULT_SERVER_FLAGS = ("--tool-call-parser", "qwen25")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    model_dir: str
    log_path: str
    api_key: str | None = None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and its scheduler child
            self.proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(15)


def start_server(model_dir: str, *flags: str, log_dir: str, api_key: str | None = None) -> ServerProcess:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "sglang_vericache.launch_server",
        "--model-path",
        model_dir,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]
    if api_key:
        args += ["--api-key", api_key]
    log_path = os.path.join(log_dir, f"server-{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", model_dir, log_path, api_key)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"server not healthy after {SERVER_START_TIMEOUT_S} s:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    from sglang_vericache.testing.random_checkpoints import make_random_checkpoint

    cache: dict[tuple, str] = {}

    def make(family: str = DEFAULT_FAMILY, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{family}")
            cache[key] = make_random_checkpoint(family, str(out), **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("server-logs"))
    running: dict[tuple, ServerProcess] = {}

    def get(model_dir: str, *flags: str, api_key: str | None = None) -> ServerProcess:
        key = (model_dir, flags, api_key)
        if key not in running or running[key].proc.poll() is not None:
            running[key] = start_server(model_dir, *flags, log_dir=log_dir, api_key=api_key)
        return running[key]

    yield get
    for s in running.values():
        s.kill()


@pytest.fixture(scope="session")
def default_model_dir(random_model_dir) -> str:
    return random_model_dir(DEFAULT_FAMILY, **DEFAULT_OVERRIDES)


@pytest.fixture(scope="session")
def default_server(server, default_model_dir) -> ServerProcess:
    return server(default_model_dir, *DEFAULT_SERVER_FLAGS)


@pytest.fixture(scope="session")
def base_url(default_server) -> str:
    return default_server.base_url
