"""launch_server --dp-size without servers: its command-line errors, the router's flags, the replicas'
command lines and devices, a replica that fails to start and one whose scheduler stopped (stand-in
processes). The servers behind the router are test_sglang_router.py's."""

from __future__ import annotations

import argparse
import socket
import sys

import pytest

from sglang_vericache import launch_server
from sglang_vericache.dp import controller as controller_mod
from sglang_vericache.dp.replica import replica_args, replica_env
from sglang_vericache.dp.router_flags import strip_router_flags
from sglang_vericache.server_args import bundled_model_path, parse_launch_args

MODEL = bundled_model_path()


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        launch_server.main(argv)
    return exit_info.value.code, capsys.readouterr().err.strip()


def test_router_flags_and_their_values_are_not_passed_to_the_replicas():
    argv = ["--model-path", "m", "--router-policy", "round_robin", "--dp-size", "2",
            "--router-max-concurrent-requests", "-1", "--router-disable-retries", "--cuda-graph-bs", "1", "2",
            "--router-request-id-headers", "x-a", "x-b", "--router-log-level=warn", "--log-requests"]
    assert strip_router_flags(argv) == ["--model-path", "m", "--dp-size", "2", "--cuda-graph-bs", "1", "2",
                                        "--log-requests"]


def test_a_replica_runs_launch_server_on_its_loopback_port_with_dp_size_1():
    assert replica_args(["--model-path", "m", "--port", "30000"], 41000) == [
        sys.executable, "-m", "sglang_vericache.launch_server", "--model-path", "m", "--port", "30000",
        "--host", "127.0.0.1", "--port", "41000", "--dp-size", "1"]


def test_replicas_on_cuda_get_consecutive_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    env = replica_env(1, "cuda", 2)
    assert (env["CUDA_VISIBLE_DEVICES"], env["SGLANG_DP_RANK"]) == ("6,7", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert replica_env(1, "cuda", 2)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in replica_env(1, "cpu", 1)


def test_dp_size_without_the_router_installed_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(launch_server, "router_installed", lambda: False)
    code, err = run_main(["--model-path", MODEL, "--dp-size", "2", "--port", "0"], capsys)
    assert (code, err) == (2, "error: --dp-size 2 runs its replicas behind sglang-router, which is not "
                              "installed: pip install sglang-router==0.3.2 (requirements/test.txt)")
    code, err = run_main(["--model-path", MODEL, "--dp-size", "2", "--router-policy", "random"], capsys)
    assert (code, err) == (2, "error: --router-policy is a flag of sglang-router, which is not installed: "
                              "pip install sglang-router==0.3.2 (requirements/test.txt)")


def test_dp_size_below_1_is_refused(capsys):
    code, err = run_main(["--model-path", MODEL, "--dp-size", "0"], capsys)
    assert code == 2 and err.endswith("error: --dp-size must be >= 1, got 0")


def test_one_rendezvous_address_for_every_replica_is_refused(capsys):
    code, err = run_main(["--model-path", MODEL, "--dp-size", "2", "--tp-size", "2", "--dist-init-addr",
                          "127.0.0.1:29500"], capsys)
    assert code == 2 and err.endswith("error: --dist-init-addr with --dp-size > 1: every replica's ranks would "
                                      "meet at that one address; leave it unset (each replica's ranks then "
                                      "meet on a free local port)")


def test_dp_size_with_a_taken_port_is_refused(capsys):
    pytest.importorskip("sglang_router")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = ["--model-path", MODEL, "--dp-size", "2", "--host", "127.0.0.1", "--port", str(port)]
        code, err = run_main(argv, capsys)
    assert (code, err) == (2, f"error: cannot serve on 127.0.0.1:{port}: Address already in use "
                              "(pick another --port)")


@pytest.mark.parametrize("flags, error", [
    (["--router-policy", "random"],
     "error: --router-policy: the router runs only with --dp-size > 1 (in front of one server, run "
     "python -m sglang_router.launch_router --worker-urls yourself)"),
    (["--dp-size", "2", "--worker-urls", "http://h:1"],
     "error: --worker-urls: not with launch_server --dp-size (the router's workers are launch_server's "
     "replicas; run the router by hand for others)"),
    (["--dp-size", "2", "--router-pd-disaggregation"],
     "error: --router-pd-disaggregation: not with launch_server --dp-size (prefill/decode disaggregation "
     "is not built here)"),
])
def test_router_flags_launch_server_cannot_honour_are_refused_by_name(flags, error, capsys):
    pytest.importorskip("sglang_router")
    assert run_main(["--model-path", MODEL, "--port", "0", *flags], capsys) == (2, error)


def test_the_router_gets_its_flags_the_replicas_and_the_servers_key_and_log_level():
    pytest.importorskip("sglang_router")
    from sglang_vericache.dp.router_flags import decode_router_args, encode_router_args, router_args_for

    argv = ["--dp-size", "2", "--router-policy", "round_robin", "--router-max-concurrent-requests", "-1",
            "--log-level", "warning", "--api-key", "k"]
    server_args, cli = parse_launch_args(argv)
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    args = router_args_for(cli, argv, urls, "127.0.0.1", 3, server_args.api_key, server_args.log_level)
    assert (args.worker_urls, args.host, args.port, args.policy, args.max_concurrent_requests) == (
        urls, "127.0.0.1", 3, "round_robin", -1)
    assert (args.api_key, args.log_level) == ("k", "warn")
    assert decode_router_args(encode_router_args(args)) == args
    argv += ["--router-log-level", "debug", "--router-api-key", "other"]
    _, cli = parse_launch_args(argv)
    args = router_args_for(cli, argv, urls, "127.0.0.1", 3, "k", "warning")
    assert (args.api_key, args.log_level) == ("other", "debug")


def test_a_replica_that_fails_to_start_ends_launch_server_with_its_error(monkeypatch, capsys):
    pytest.importorskip("sglang_router")
    # Stand-ins for the replicas: dp0 fails as launch_server does (an `error:` line, exit 1), dp1 waits.
    script = ("import os, sys, time\n"
              "if os.environ['SGLANG_DP_RANK'] == '0':\n"
              "    print('loading weights')\n"
              "    print('error: no *.safetensors weights in model folder')\n"
              "    sys.exit(1)\n"
              "time.sleep(120)\n")
    monkeypatch.setattr(controller_mod, "replica_args", lambda argv, port: [sys.executable, "-c", script])
    server_args, cli = parse_launch_args(["--model-path", MODEL, "--dp-size", "2"])
    dp = controller_mod.DataParallelController(server_args, [], cli)
    assert dp.run() == 1
    err = capsys.readouterr().err.splitlines()
    assert "error: replica dp0 failed to start: dp0 exited with code 1: error: no *.safetensors weights in " \
           "model folder" in err
    assert "[dp0] loading weights" in err
    assert [r.proc.poll() for r in dp.replicas] == [1, -15]  # dp1 stopped by SIGTERM


def test_router_flags_are_in_the_help():
    pytest.importorskip("sglang_router")
    parser = argparse.ArgumentParser()
    from sglang_vericache.dp.router_flags import add_router_cli_args

    assert add_router_cli_args(parser)
    assert "--router-policy" in parser.format_help() and "--router-disable-retries" in parser.format_help()


# A stand-in replica: an HTTP server on the port it is given whose /health answers 200, except that
# dp0's answers 503 after its first answer (its scheduler stopped once launch_server saw it healthy).
STAND_IN = """
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
rank, calls = os.environ["SGLANG_DP_RANK"], [0]
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        calls[0] += 1
        self.send_response(503 if rank == "0" and calls[0] > 1 else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_replica_whose_scheduler_stopped_is_stopped_and_the_others_keep_serving(monkeypatch):
    pytest.importorskip("sglang_router")
    import asyncio

    from sglang_vericache.dp.replica import ChildProcess, stop_all

    monkeypatch.setattr(controller_mod, "replica_args",
                        lambda argv, port: [sys.executable, "-c", STAND_IN, str(port)])
    monkeypatch.setattr(controller_mod, "HEALTH_CHECK_INTERVAL_S", 0.2)
    server_args, cli = parse_launch_args(["--model-path", MODEL, "--dp-size", "2"])
    dp = controller_mod.DataParallelController(server_args, [], cli)
    try:
        dp.start_replicas()
        dp.router = ChildProcess.start("router", [sys.executable, "-c", "import time; time.sleep(120)"])

        async def supervise_until_dp0_is_handled() -> str | None:
            stop = asyncio.Event()
            task = asyncio.create_task(dp.supervise(stop))
            for _ in range(200):
                if 0 in dp.failures and not dp.replicas[0].alive:
                    break
                await asyncio.sleep(0.05)
            stop.set()
            return await task

        assert asyncio.run(supervise_until_dp0_is_handled()) is None  # still serving
        assert dp.stopped_replicas() == [f"dp0 ({dp.replica_urls[0]}) stopped by launch_server: its "
                                         "scheduler is not running (/health answers 503)"]
        assert (dp.replicas[0].proc.poll(), dp.replicas[1].alive) == (-15, True)
    finally:
        stop_all([*dp.replicas, *([dp.router] if dp.router else [])])


def test_a_request_naming_its_dp_rank_is_sent_to_that_replica_as_rank_0():
    from sglang_vericache.dp.front import routed_rank

    body = b'{"text": "x", "routed_dp_rank": 1}'
    assert routed_rank("/generate", body) == (1, b'{"text": "x", "routed_dp_rank": 0}')
    assert routed_rank("/v1/chat/completions", b'{"data_parallel_rank": 3}') == (
        3, b'{"data_parallel_rank": 0}')
    for path, unrouted in (("/generate", b'{"text": "x", "routed_dp_rank": null}'),
                           ("/generate", b'{"routed_dp_rank": [0, 1]}'),  # per prompt: the replica checks it
                           ("/generate", b'not json _rank'), ("/flush_cache", b'{"routed_dp_rank": 1}')):
        assert routed_rank(path, unrouted) == (None, unrouted)
