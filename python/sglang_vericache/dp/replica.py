"""One child process of launch_server --dp-size: a replica (a full `launch_server` of ours on a
loopback port) or the router. Each runs in its own process group (a replica's scheduler is in its
group), dies with launch_server (PR_SET_PDEATHSIG), and its output goes to launch_server's stderr
line by line, prefixed with its name; the last lines are kept to say why it stopped.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

LOG_TAIL_LINES = 40
STOP_GRACE_S = 10.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class ChildProcess:
    """A started child: its Popen, its output tail, and whether launch_server stopped it."""

    name: str
    proc: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LOG_TAIL_LINES))
    stopping: bool = False
    pump: threading.Thread | None = None

    @classmethod
    def start(cls, name: str, args: list[str], env: dict[str, str] | None = None,
              stdin_text: str | None = None) -> ChildProcess:
        proc = subprocess.Popen(
            args, env=env, stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        child = cls(name, proc)
        if stdin_text is not None:
            proc.stdin.write(stdin_text.encode())
            proc.stdin.close()
        child.pump = threading.Thread(target=child._pump, name=f"{name}-log", daemon=True)
        child.pump.start()
        return child

    def _pump(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            sys.stderr.write(f"[{self.name}] {line}\n")
        self.proc.stdout.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        if not self.alive and self.pump is not None:
            self.pump.join(2.0)  # the last lines a dead child wrote
        return "\n".join(list(self.tail)[-n:])

    def exit_reason(self) -> str:
        """How it ended and why: the last `error: ...` line it printed (launch_server's way of
        saying why it stops), else its last lines of output."""
        lines = self.log_tail().splitlines()
        errors = [line for line in lines if line.startswith("error: ")]
        why = errors[-1] if errors else "its last output:\n" + "\n".join(lines[-15:])
        return f"{self.name} {describe_exit(self.proc.poll())}: {why}"

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def begin_stop(self) -> None:
        self.stopping = True
        self.signal_group(signal.SIGTERM)

    def finish_stop(self, deadline: float) -> None:
        """Waits until deadline for the SIGTERMed group's leader, then SIGKILLs the group."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        self.signal_group(signal.SIGKILL)  # also any child the leader left behind
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def stop_all(children: list[ChildProcess], grace_s: float = STOP_GRACE_S) -> None:
    for child in children:
        child.begin_stop()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.finish_stop(deadline)


def replica_args(argv: list[str], port: int) -> list[str]:
    """The replica's command line: launch_server's own flags (router flags removed), then its
    loopback port and --dp-size 1 (argparse keeps the last of a repeated flag)."""
    return [sys.executable, "-m", "sglang_vericache.launch_server", *argv,
            "--host", "127.0.0.1", "--port", str(port), "--dp-size", "1"]


def replica_env(dp_rank: int, device: str, gpus_per_replica: int) -> dict[str, str]:
    """SGLANG_DP_RANK as SGLang sets it; on CUDA, replica i sees the devices
    [i * tp, (i + 1) * tp) of the visible ones (SGLang's base_gpu_id = dp_rank * tp_size)."""
    env = {**os.environ, "SGLANG_DP_RANK": str(dp_rank)}
    if device.startswith("cuda"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range((dp_rank + 1) * gpus_per_replica)]
        first = dp_rank * gpus_per_replica
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[first:first + gpus_per_replica])
    return env
