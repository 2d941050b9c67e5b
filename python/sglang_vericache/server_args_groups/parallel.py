"""Parallelism: tensor parallelism (one scheduler process per rank, distributed/) and data parallelism
(replicas behind sglang-router, dp/). sglang-router's own flags are accepted with --dp-size > 1 and
listed by --help-router."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from sglang_vericache.server_args_groups.base import ArgsGroup, arg


class HelpRouterAction(argparse.Action):
    """--help-router: print sglang-router's flags (as launch_server accepts them) and exit."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from sglang_vericache.dp.router_flags import router_help

        print(router_help(parser.prog), end="")
        parser.exit()


@dataclass
class ParallelArgs(ArgsGroup):
    TITLE = "Parallelism"

    tp_size: int = arg(1, aliases=("--tensor-parallel-size",),  # distributed/parallel_state.py
        help="Tensor parallel size: the model's attention heads (and both KV tiers, by KV head), MLP and "
             "vocabulary are split over this many scheduler processes, one per rank (gloo on a CPU, NCCL "
             "on CUDA: rank r on cuda:r). Must divide the heads, KV heads and intermediate size.")
    dist_init_addr: str | None = arg(None,
        help="HOST:PORT where the ranks meet (torch.distributed's TCP rendezvous, on node 0). Default "
             "with one node: a free port on 127.0.0.1. Needed with --nnodes > 1.")
    nnodes: int = arg(1,
        help="Number of hosts the --tp-size ranks are spread over (tp_size / nnodes ranks on each). "
             "Start launch_server on every host with the same flags and its own --node-rank.")
    node_rank: int = arg(0,
        help="This host's index in [0, --nnodes). Node 0 runs rank 0 and serves HTTP; the others run "
             "their ranks only, and exit when rank 0 does.")
    dist_timeout: float = arg(600.0,
        help="Seconds a tensor-parallel collective may wait for a peer rank; past it (or at once when a "
             "peer's connection closes) the rank exits and the server fails its requests with an error.")
    dp_size: int = arg(1, aliases=("--data-parallel-size",),  # dp/controller.py
        help="Data parallel size: N > 1 starts N replicas of this server (each a full server on its own "
             "loopback port, with the other flags given here; with --tp-size M, N x M ranks) behind "
             "sglang-router (pip install sglang-router), which launch_server starts and which clients "
             "reach through --host:--port; /server_info lists every replica's state. The router's own "
             "flags are accepted with a --router- prefix (--router-policy round_robin, "
             "--router-disable-retries, ...), as by SGLang's sglang_router.launch_server: --help-router "
             "lists them.")

    @classmethod
    def add_cli_args(cls, add) -> None:
        super().add_cli_args(add)
        add("--help-router", action=HelpRouterAction,
            help="Show sglang-router's flags (accepted with --dp-size > 1) and exit.")

    def check(self) -> None:
        self.check_tensor_parallel()
        self.check_at_least("dp_size")
        if self.dp_size > 1 and self.disagg_role == "verifier":
            raise ValueError("--dp-size with --disagg-role verifier: a verifier serves no HTTP for a router; "
                             "start one verifier process per drafter instead")
        if self.dp_size > 1 and self.dist_init_addr is not None:
            raise ValueError("--dist-init-addr with --dp-size > 1: every replica's ranks would meet at that "
                             "one address; leave it unset (each replica's ranks then meet on a free local "
                             "port)")

    def check_tensor_parallel(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size}, --nnodes {self.nnodes}, --node-rank {self.node_rank}: "
                             "need tp_size >= 1, nnodes >= 1 and 0 <= node_rank < nnodes")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide --tp-size {self.tp_size} (ranks per node)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the ranks' "
                             "rendezvous)")
        if self.dist_init_addr is not None and not self.dist_init_addr.rpartition(":")[2].isdigit():
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.tp_size == 1:
            return
        for flag, on, why in (
            ("--vericache-schedule adaptive", self.adaptive, "its controller decides from each rank's own "
                                                             "timings"),
            ("--disagg-role", self.disagg_role != "none", "dual-instance VeriCache runs one rank per "
                                                          "instance"),
            ("--kv-store", self.kv_store != "none", "each rank would store its own heads under the same "
                                                    "keys"),
        ):
            if on:
                raise ValueError(f"{flag} is not supported with --tp-size {self.tp_size} ({why})")
