"""`python -m sglang_vericache.launch_server [flags]`: check the model folder and the port, then serve.

A missing model folder (or GGUF file), one without config.json, a port already taken, or --dp-size > 1 without
sglang-router installed is a one-line error on stderr and exit code 2, before any process is
spawned or any heavy module is imported. --dp-size N > 1 runs N replicas behind sglang-router
(dp/controller.py); a replica or the router that fails to start ends it with exit code 1 and the
child's last output.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from sglang_vericache.dp.router_flags import (
    ROUTER_INSTALL_HINT,
    refused_router_flag,
    router_flags_given,
    router_installed,
)
from sglang_vericache.server_args import ServerArgs, parse_launch_args
from sglang_vericache.utils.default_model import missing_default_model_error
from sglang_vericache.utils.gguf_files import gguf_file_of


def model_folder_error(server_args: ServerArgs) -> str | None:
    path = server_args.model_path
    missing_default = missing_default_model_error(path)
    if missing_default:
        return missing_default
    try:
        gguf_file = gguf_file_of(path)
    except ValueError as e:  # a folder of several .gguf files
        return str(e)
    if gguf_file is None and not os.path.isdir(path):
        return (f"model folder not found: {path} (--model-path must be a local Hugging Face model folder "
                f"or a .gguf file)")
    if gguf_file is None and not os.path.isfile(os.path.join(path, "config.json")):
        return f"model folder {path} has no config.json (not a Hugging Face model folder) and no .gguf file"
    tok = server_args.tokenizer_path
    if not server_args.skip_tokenizer_init and tok != path and not os.path.exists(tok):
        return f"tokenizer folder not found: {tok}"
    return None


def port_error(host: str, port: int) -> str | None:
    """Whether host:port can be bound now (SO_REUSEADDR, as uvicorn binds it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"--host {host}: {e.strerror}"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return f"cannot serve on {host}:{port}: {e.strerror} (pick another --port)"
    return None


def data_parallel_error(server_args: ServerArgs, cli, router_flags: list[str]) -> str | None:
    if server_args.dp_size == 1:
        if router_flags:
            return (f"{router_flags[0]}: the router runs only with --dp-size > 1 (in front of one server, "
                    "run python -m sglang_router.launch_router --worker-urls yourself)")
        return None
    if not router_installed():
        return (f"--dp-size {server_args.dp_size} runs its replicas behind sglang-router, which is not "
                f"installed: {ROUTER_INSTALL_HINT}")
    return refused_router_flag(cli)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    router_flags = router_flags_given(argv)
    if router_flags and not router_installed():
        print(f"error: {router_flags[0]} is a flag of sglang-router, which is not installed: "
              f"{ROUTER_INSTALL_HINT}", file=sys.stderr)
        sys.exit(2)
    server_args, cli = parse_launch_args(argv)
    error = model_folder_error(server_args)
    if error is None and server_args.disagg_role != "verifier" and server_args.node_rank == 0:
        error = port_error(server_args.host, server_args.port)
    if error is None:
        error = data_parallel_error(server_args, cli, router_flags)
    if error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(
        level=server_args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    )
    if server_args.dp_size > 1:  # the replicas log their own flag warnings
        from sglang_vericache.dp.controller import run_data_parallel

        sys.exit(run_data_parallel(server_args, argv, cli))
    server_args.log_flag_warnings()
    if server_args.node_rank > 0:  # --nnodes > 1: this node runs its tensor-parallel ranks only
        from sglang_vericache.managers.scheduler_launcher import run_other_node

        try:
            sys.exit(run_other_node(server_args))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
    if server_args.disagg_role == "verifier":  # dual-instance mode: no HTTP, the verifier loop (disagg/)
        from sglang_vericache.disagg.verifier import run_verifier

        run_verifier(server_args)
        return
    from sglang_vericache.managers.tokenizer_manager import TokenizerManager

    try:
        manager = TokenizerManager(server_args)  # spawns the scheduler first: it loads while we import
    except (RuntimeError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    from sglang_vericache.entrypoints.http_server import launch_server

    launch_server(server_args, manager)


if __name__ == "__main__":
    main()
