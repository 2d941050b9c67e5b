"""Network namespaces for tests: a private loopback (and veth links) that `tc` can shape.

NetNS.create() makes a uniquely named namespace (vc-<pid>-<n>) with its `lo` up; popen/run run
commands inside it (`ip netns exec`); link() joins two namespaces by a veth pair; shape() puts a
tbf qdisc on one of its devices; close() kills every process in the namespace and deletes it (and
its veth). Nothing here touches the host's own devices or addresses.
missing() names what this machine lacks for namespaces (None when they can be used); create()
raises NetnsUnavailable when `ip netns add` is refused for lack of privilege.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

IP, TC, REDIS_BIN = shutil.which("ip"), shutil.which("tc"), shutil.which("redis-server")
REDIS_PORT = 6379  # a namespace this module just created has no listeners, so any port is free
_names = itertools.count()

# argv: port, seconds. Exits 0 once redis-server on 127.0.0.1:port answers PING.
_WAIT_REDIS = """
import sys, time, redis
client = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]), socket_timeout=0.5, socket_connect_timeout=0.5)
deadline = time.monotonic() + float(sys.argv[2])
while True:
    try:
        client.ping()
        break
    except redis.RedisError:
        if time.monotonic() > deadline:
            sys.exit("redis-server did not answer")
        time.sleep(0.05)
"""


class NetnsUnavailable(RuntimeError):
    """`ip netns add` was refused for lack of privilege."""


def missing() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if IP is None:
        return "iproute2's `ip` is not installed"
    if TC is None:
        return "iproute2's `tc` is not installed"
    return None


def _check(argv: list[str]) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


class NetNS:
    def __init__(self, name: str):
        self.name = name
        self.procs: list[subprocess.Popen] = []

    @classmethod
    def create(cls) -> NetNS:
        ns = cls(f"vc-{os.getpid()}-{next(_names)}")
        r = subprocess.run([IP, "netns", "add", ns.name], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            if "Permission denied" in r.stderr or "Operation not permitted" in r.stderr:
                raise NetnsUnavailable(f"ip netns add {ns.name}: {r.stderr.strip()}")
            raise RuntimeError(f"ip netns add {ns.name} failed ({r.returncode}): {r.stderr.strip()}")
        try:
            _check([IP, "-n", ns.name, "link", "set", "lo", "up"])
        except BaseException:
            ns.close()
            raise
        return ns

    def argv(self, argv: list[str]) -> list[str]:
        return [IP, "netns", "exec", self.name, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(self.argv(argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Runs argv inside the namespace to completion; stdout and stderr captured as text."""
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout)

    def link(self, peer: NetNS, addr: str, peer_addr: str, dev: str = "vc0") -> None:
        """A veth pair created inside the two namespaces (never on the host): dev here with addr,
        dev in peer with peer_addr (CIDR, e.g. 10.213.0.1/30), both up."""
        _check([IP, "-n", self.name, "link", "add", dev, "type", "veth",
                "peer", "name", dev, "netns", peer.name])
        for ns, a in ((self, addr), (peer, peer_addr)):
            _check([IP, "-n", ns.name, "addr", "add", a, "dev", dev])
            _check([IP, "-n", ns.name, "link", "set", dev, "up"])

    def set_mtu(self, dev: str, mtu: int) -> None:
        _check([IP, "-n", self.name, "link", "set", dev, "mtu", str(mtu)])

    def shape(self, dev: str, rate_bytes: int, burst_bytes: int, mtu: int = 1500) -> None:
        """A tbf qdisc on dev: at most burst_bytes + rate_bytes * T bytes leave dev in any T seconds.

        tbf drops every packet larger than its burst, and lo's 64 KiB MTU would need a burst that
        dwarfs the transfers, so dev gets an Ethernet MTU. The queue holds 1 s of traffic, so TCP
        sees delay rather than drops.
        """
        self.set_mtu(dev, mtu)
        _check([TC, "-n", self.name, "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{rate_bytes * 8}bit", "burst", str(burst_bytes), "latency", "1s"])

    def qdisc_bytes(self, dev: str) -> int:
        """Bytes the root qdisc of dev has sent."""
        out = _check([TC, "-n", self.name, "-s", "-j", "qdisc", "show", "dev", dev])
        return next(q["bytes"] for q in json.loads(out) if q.get("root"))

    def start_redis(self, workdir: str, timeout_s: float = 10.0) -> str:
        """redis-server on 127.0.0.1 inside the namespace, persistence off -> its URL."""
        log_path = os.path.join(workdir, f"redis-{self.name}.log")
        with open(log_path, "ab") as log:
            self.popen([REDIS_BIN, "--port", str(REDIS_PORT), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", workdir, "--maxmemory-policy", "noeviction"],
                       stdout=log, stderr=subprocess.STDOUT)
        r = self.run([sys.executable, "-c", _WAIT_REDIS, str(REDIS_PORT), str(timeout_s)],
                     timeout=timeout_s + 30)
        if r.returncode != 0:
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"redis-server in {self.name}: {r.stderr.strip()}\n{f.read()[-2000:]}")
        return f"redis://127.0.0.1:{REDIS_PORT}/0"

    def pids(self) -> list[int]:
        r = subprocess.run([IP, "netns", "pids", self.name], capture_output=True, text=True, timeout=30)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    def close(self) -> None:
        """Kills every process in the namespace (all started by this test), then deletes it."""
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while self.pids() and time.monotonic() < deadline:
                for p in self.procs:
                    p.poll()  # reaps our children, which would otherwise stay listed as zombies
                time.sleep(0.05)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        _check([IP, "netns", "del", self.name])
