"""launch_server --dp-size N: N replicas behind sglang-router, one front on --host:--port.

Layout (SGLang's `sglang_router.launch_server`): each replica is a full server of ours (tokenizer
manager, scheduler, and with --tp-size its ranks) on a loopback port, started with launch_server's
own flags and --dp-size 1; the router runs in its own process in front of them; the front (front.py)
holds --host:--port. Separate servers rather than one server with N schedulers: a replica that dies
takes only its own requests with it, the router's health checks, retries and circuit breaker see
each replica as the worker it is, and a replica is the server every other test already covers.

Lifecycle:
- start: every replica at once; a replica that exits before it is healthy ends launch_server
  (exit 1) with its last output; then the router, until it reports all N workers healthy;
  then the front;
- serve: a replica that exits is logged with its last output and removed from the router (its
  streams in flight end with an error event, see front.py), and the others keep serving; one whose
  /health answers 503 (its scheduler stopped: it has already failed its requests with that error)
  is removed and stopped the same way; the last replica or the router exiting ends launch_server
  (exit 1);
- stop: SIGTERM / SIGINT closes the front (requests still open get FRONT_SHUTDOWN_S), then SIGTERM
  to every child's process group, SIGKILL to what is left after STOP_GRACE_S. Children also die
  with launch_server (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from sglang_vericache.dp.front import make_front_app
from sglang_vericache.dp.replica import ChildProcess, describe_exit, replica_args, replica_env, stop_all
from sglang_vericache.dp.router_flags import (
    encode_router_args,
    non_default_router_args,
    router_args_for,
    strip_router_flags,
)
from sglang_vericache.server_args import ServerArgs

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
ROUTER_READY_TIMEOUT_S = 120.0
SUPERVISE_INTERVAL_S = 0.5
HEALTH_CHECK_INTERVAL_S = 5.0  # how often a running replica's /health is read
INFO_TIMEOUT_S = 5.0
FRONT_SHUTDOWN_S = 3.0  # on SIGTERM, requests still open at the front get this long before it closes


class StartError(RuntimeError):
    """A child did not start; the message says which and why."""


def free_loopback_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class DataParallelController:
    def __init__(self, server_args: ServerArgs, argv: list[str], cli: argparse.Namespace) -> None:
        self.server_args = server_args
        self.argv = strip_router_flags(argv)
        self.cli = cli
        ports = free_loopback_ports(server_args.dp_size + 1)
        self.replica_urls = [f"http://{LOOPBACK}:{p}" for p in ports[:-1]]
        self.router_url = f"http://{LOOPBACK}:{ports[-1]}"
        self.router_args = router_args_for(cli, argv, self.replica_urls, LOOPBACK, ports[-1],
                                           server_args.api_key, server_args.log_level)
        self.replicas: list[ChildProcess] = []
        self.router: ChildProcess | None = None
        self.removed: set[int] = set()  # dp ranks whose exit was handled
        self.failures: dict[int, str] = {}  # dp rank -> why launch_server stopped it

    # ------------------------------------------------------------------ start

    def start_replicas(self) -> None:
        tp = self.server_args.tp_size
        for rank, url in enumerate(self.replica_urls):
            port = int(url.rsplit(":", 1)[1])
            env = replica_env(rank, self.server_args.device, tp)
            self.replicas.append(ChildProcess.start(f"dp{rank}", replica_args(self.argv, port), env=env))
        logger.info("data parallel: %d replicas starting on %s", len(self.replicas),
                    ", ".join(self.replica_urls))
        deadline = time.monotonic() + self.router_args.worker_startup_timeout_secs
        pending = set(range(len(self.replicas)))
        while pending:
            for rank in sorted(pending):
                replica = self.replicas[rank]
                if not replica.alive:
                    raise StartError(f"replica dp{rank} failed to start: {replica.exit_reason()}")
                if self._healthy(self.replica_urls[rank]):
                    pending.discard(rank)
            if time.monotonic() > deadline:
                raise StartError(f"replicas {sorted(pending)} not healthy after "
                                 f"{self.router_args.worker_startup_timeout_secs} s "
                                 "(--router-worker-startup-timeout-secs)")
            time.sleep(SUPERVISE_INTERVAL_S)

    def start_router(self) -> None:
        logger.info("sglang-router on %s in front of the replicas; router flags given: %s",
                    self.router_url, non_default_router_args(self.router_args))
        self.router = ChildProcess.start(
            "router", [sys.executable, "-m", "sglang_vericache.dp.router_process"],
            stdin_text=encode_router_args(self.router_args))
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
        import requests

        while True:
            if not self.router.alive:
                raise StartError(f"sglang-router failed to start: {self.router.exit_reason()}")
            try:
                ready = requests.get(self.router_url + "/readiness", timeout=2)
                if ready.status_code == 200 and ready.json().get("healthy_workers") == len(self.replicas):
                    return
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                raise StartError(f"sglang-router did not report {len(self.replicas)} healthy workers after "
                                 f"{ROUTER_READY_TIMEOUT_S:.0f} s; its last output:\n"
                                 f"{self.router.log_tail()}")
            time.sleep(SUPERVISE_INTERVAL_S)

    def _healthy(self, url: str) -> bool:
        import requests

        try:
            return requests.get(url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    # ------------------------------------------------------------------ state

    def exit_of(self, rank: int) -> str | None:
        """How replica `rank` ended (None while it serves)."""
        if rank in self.failures:
            return self.failures[rank]
        replica = self.replicas[rank]
        return None if replica.alive else describe_exit(replica.proc.poll())

    def serving_replica_url(self, rank: int) -> str | None:
        return self.replica_urls[rank] if self.exit_of(rank) is None else None

    def stopped_replicas(self) -> list[str]:
        return [f"dp{rank} ({self.replica_urls[rank]}) {self.exit_of(rank)}"
                for rank in range(len(self.replicas)) if self.exit_of(rank) is not None]

    async def server_info(self) -> dict[str, Any]:
        """The first serving replica's /server_info (its args are every replica's), with this
        launch_server's address and dp_size, every replica's state and internal_states (one per
        serving replica, as SGLang lists one per data-parallel rank), and the router's."""
        headers = {"Authorization": f"Bearer {self.server_args.api_key}"} if self.server_args.api_key else {}
        timeout = aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)

        async def fetch(session: aiohttp.ClientSession, url: str) -> dict | None:
            try:
                async with session.get(url + "/server_info", headers=headers) as r:
                    return await r.json() if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None

        async with aiohttp.ClientSession(timeout=timeout) as session:
            infos = await asyncio.gather(*(
                fetch(session, url) if r.alive else asyncio.sleep(0, None)
                for url, r in zip(self.replica_urls, self.replicas)))
        replicas = []
        for rank, (replica, info) in enumerate(zip(self.replicas, infos)):
            state = "exited" if not replica.alive else ("serving" if info is not None else "not answering")
            if rank in self.failures:
                state = "exited" if not replica.alive else "stopping"
            replicas.append({
                "dp_rank": rank, "url": self.replica_urls[rank], "pid": replica.pid, "state": state,
                "exit": self.exit_of(rank),
                "internal_states": info.get("internal_states", []) if info else [],
            })
        first = next((i for i in infos if i is not None), {})
        router = self.router
        return {
            **first,
            "host": self.server_args.host, "port": self.server_args.port, "dp_size": len(self.replicas),
            "internal_states": [s for r in replicas for s in r["internal_states"]],
            "replicas": replicas,
            "router": {"url": self.router_url, "pid": router.pid if router else None,
                       "state": "running" if router and router.alive else "exited",
                       "policy": self.router_args.policy},
        }

    async def get_load(self) -> list[dict]:
        """SGLang's /get_load under data parallelism: one entry per serving replica, dp_rank its
        rank (each replica reports itself as rank 0 of 1)."""
        ranks = [rank for rank in range(len(self.replicas)) if self.exit_of(rank) is None]
        headers = {"Authorization": f"Bearer {self.server_args.api_key}"} if self.server_args.api_key else {}

        async def fetch(session: aiohttp.ClientSession, rank: int) -> list[dict]:
            try:
                async with session.get(self.replica_urls[rank] + "/get_load", headers=headers) as r:
                    entries = await r.json() if r.status == 200 else []
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return []
            return [{**e, "dp_rank": rank} for e in entries]

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)) as session:
            loads = await asyncio.gather(*(fetch(session, rank) for rank in ranks))
        return [e for entries in loads for e in entries]

    # ------------------------------------------------------------------ serve

    async def _remove_from_router(self, session: aiohttp.ClientSession, rank: int) -> None:
        """DELETE /workers/{id}: the router stops choosing the dead replica at once (its own health
        check would take --router-health-check-interval-secs x --router-health-failure-threshold)."""
        url = self.replica_urls[rank]
        try:
            async with session.get(self.router_url + "/workers") as r:
                workers = (await r.json()).get("workers", [])
            for w in workers:
                if w.get("url") == url:
                    async with session.delete(f"{self.router_url}/workers/{w['id']}") as r:
                        logger.info("dp%d removed from the router (%d)", rank, r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            logger.warning("could not remove dp%d from the router: %s", rank, e)

    async def _scheduler_stopped(self, session: aiohttp.ClientSession, rank: int) -> bool:
        """/health answers 503: the replica's server runs, its scheduler does not (a replica too
        busy to answer, or one exiting, is not counted: poll() sees an exit)."""
        try:
            async with session.get(self.replica_urls[rank] + "/health") as r:
                return r.status == 503
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _check_health(self, session: aiohttp.ClientSession) -> None:
        ranks = [rank for rank, r in enumerate(self.replicas) if rank not in self.removed and r.alive]
        stopped = await asyncio.gather(*(self._scheduler_stopped(session, rank) for rank in ranks))
        for rank in (rank for rank, s in zip(ranks, stopped) if s):
            self.removed.add(rank)
            self.failures[rank] = ("stopped by launch_server: its scheduler is not running "
                                   "(/health answers 503)")
            logger.error("replica dp%d: its scheduler is not running (/health answers 503); stopping it, the "
                         "other replicas keep serving", rank)
            await self._remove_from_router(session, rank)
            replica = self.replicas[rank]
            replica.begin_stop()
            await asyncio.to_thread(replica.finish_stop, time.monotonic() + 10.0)

    async def supervise(self, stop: asyncio.Event) -> str | None:
        """Watches the children until stop is set (None) or serving is over (the reason)."""
        next_health_check = time.monotonic() + HEALTH_CHECK_INTERVAL_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)) as session:
            while not stop.is_set():
                if not self.router.alive:
                    return f"sglang-router stopped: {await asyncio.to_thread(self.router.exit_reason)}"
                for rank, replica in enumerate(self.replicas):
                    if rank not in self.removed and not replica.alive:
                        self.removed.add(rank)
                        reason = await asyncio.to_thread(replica.exit_reason)
                        logger.error("replica %s; the other replicas keep serving", reason)
                        await self._remove_from_router(session, rank)
                if time.monotonic() >= next_health_check:
                    await self._check_health(session)
                    next_health_check = time.monotonic() + HEALTH_CHECK_INTERVAL_S
                if len(self.removed) == len(self.replicas):
                    return "every replica has stopped"
                try:
                    await asyncio.wait_for(stop.wait(), SUPERVISE_INTERVAL_S)
                except asyncio.TimeoutError:
                    pass
        return None

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        app = make_front_app(self.router_url, self.server_info, self.stopped_replicas,
                             self.server_args.api_key, self.serving_replica_url, len(self.replicas),
                             self.get_load)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=FRONT_SHUTDOWN_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.server_args.host, self.server_args.port).start()
            logger.info("The server is fired up and ready to roll! http://%s:%d "
                        "(%d replicas behind sglang-router)",
                        self.server_args.host, self.server_args.port, len(self.replicas))
            reason = await self.supervise(stop)
        finally:
            try:  # aiohttp's graceful close can wait on a request in flight well past shutdown_timeout
                await asyncio.wait_for(runner.cleanup(), FRONT_SHUTDOWN_S + 1)
            except asyncio.TimeoutError:
                logger.warning("the front closed with requests still open")
        if reason:
            logger.error("launch_server stops: %s", reason)
            return 1
        return 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)  # until serve() takes the signals over
        try:
            self.start_replicas()
            self.start_router()
            return asyncio.run(self.serve())
        except StartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            stop_all([*self.replicas, *([self.router] if self.router else [])])


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)  # run()'s finally stops the children


def run_data_parallel(server_args: ServerArgs, argv: list[str], cli: argparse.Namespace) -> int:
    return DataParallelController(server_args, argv, cli).run()
