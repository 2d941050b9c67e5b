"""ServerArgs: every knob of the runtime, with SGLang's flag names where the concept is the same.

The knobs come in groups, one per concern (server_args_groups/: model and tokenizer, HTTP server, API,
memory and scheduling, KV mode and compression, speculative decoding, KV store, disaggregation,
parallelism, kernels and determinism, logging and metrics). Each group is a small dataclass with its own
`--help` section and the check of its own fields; ServerArgs inherits them all, so every field is read
as `server_args.page_size` whatever its group. `launch_server --help` lists the groups;
`--help-router` lists sglang-router's flags, accepted with `--dp-size > 1`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from sglang_vericache.compressor_names import KV_COMPRESSORS, split_kv_compressor  # noqa: F401 (re-exported)
from sglang_vericache.server_args_groups import (
    GROUPS,
    ApiArgs,
    DisaggArgs,
    HttpArgs,
    KernelArgs,
    KVModeArgs,
    KVStoreArgs,
    LoggingArgs,
    MemoryArgs,
    ModelArgs,
    ParallelArgs,
    SpeculativeArgs,
)
from sglang_vericache.server_args_groups.base import DefaultsHelpFormatter, add_group
from sglang_vericache.server_args_groups.base import parse_bytes  # noqa: F401 (re-exported)
# Re-exported: the allowed values and their parsers.
from sglang_vericache.server_args_groups.disagg import DISAGG_PREFILLS, DISAGG_ROLES  # noqa: F401
from sglang_vericache.server_args_groups.http_api import DEFAULT_CUDA_WATCHDOG_S  # noqa: F401
from sglang_vericache.server_args_groups.kv_mode import (  # noqa: F401
    DEFAULT_KV_COMPRESSION_RATIO,
    KV_MODES,
    QUANTIZING_COMPRESSORS,
    with_kv_mode,
)
from sglang_vericache.server_args_groups.kv_store import (  # noqa: F401
    KV_STORE_KINDS,
    KV_STORE_TIERS,
    check_redis_url,
    default_kv_store_path,
)
from sglang_vericache.server_args_groups.memory import SCHEDULE_POLICIES  # noqa: F401
from sglang_vericache.server_args_groups.model import DTYPES  # noqa: F401
from sglang_vericache.utils.default_model import default_model_path  # noqa: F401


def bundled_model_path() -> str:
    """The bundled code model that ships inside the package (the tests' fast model)."""
    return os.path.join(os.path.dirname(__file__), "assets", "vericache-code-tiny")


# The bases are listed last group first: a dataclass puts the fields of its last base first, so the
# fields (and /server_info) read in --help order.
@dataclass
class ServerArgs(LoggingArgs, KernelArgs, ParallelArgs, DisaggArgs, KVStoreArgs, SpeculativeArgs, KVModeArgs,
                 MemoryArgs, ApiArgs, HttpArgs, ModelArgs):
    def __post_init__(self) -> None:
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        self.check()
        if self.enable_deterministic_inference is None:
            self.enable_deterministic_inference = self.deterministic_default()

    def check(self) -> None:
        """Every group's check of its own fields, in --help order; ValueError names the flag."""
        for group in GROUPS:
            group.check(self)

    def flag_warnings(self) -> list[str]:
        """Flags given a value that has no effect with the rest of the command line, each named."""
        return [message for group in GROUPS for message in group.warnings(self)]

    def log_flag_warnings(self) -> list[str]:
        """Logs flag_warnings() (once, at startup) and a note on --enable-metrics."""
        from sglang_vericache.server_args_groups.runtime import logger

        warnings = self.flag_warnings()
        for message in warnings:
            logger.warning(message)
        self.log_notes()
        return warnings

    def public_dict(self) -> dict:
        """The fields as /server_info and Engine.get_server_info report them: a set --disagg-secret
        reads "<set>", never the secret itself."""
        info = dataclasses.asdict(self)
        if info["disagg_secret"] is not None:
            info["disagg_secret"] = "<set>"
        return info

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Adds every group's --help section and flags to parser."""
        for group in GROUPS:
            add_group(parser, group)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        kwargs = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None)
            if value is not None:
                kwargs[f.name] = value
        return cls(**with_kv_mode(kwargs, getattr(args, "kv_mode", None)))


def build_parser() -> argparse.ArgumentParser:
    """launch_server's parser: ServerArgs' flags, grouped by concern, each help with its default."""
    parser = argparse.ArgumentParser(
        prog="python -m sglang_vericache.launch_server",
        usage="%(prog)s [flags] (--help lists every flag)",
        description="Serve a model with SGLang's HTTP API and OpenAI-compatible endpoints. The flags come in "
                    "groups by concern; sglang-router's own flags (--router-*, with --dp-size > 1) are "
                    "listed by --help-router.",
        formatter_class=DefaultsHelpFormatter,
    )
    ServerArgs.add_cli_args(parser)
    return parser


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    return parse_launch_args(argv)[0]


def parse_launch_args(argv: list[str] | None = None) -> tuple[ServerArgs, argparse.Namespace]:
    """ServerArgs and the whole parsed command line (which also holds sglang-router's
    `--router-*` flags, when the router is installed: dp/router_flags.py)."""
    from sglang_vericache.dp.router_flags import parse_router_args

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    rest = parse_router_args(rest, args, parser.prog)  # the router's flags into args; what it does not know
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return ServerArgs.from_cli_args(args), args
    except ValueError as e:
        parser.error(str(e))
        raise


@dataclass
class PortArgs:
    """ZMQ endpoints between the TokenizerManager and the Scheduler process."""

    scheduler_input_ipc_name: str
    tokenizer_ipc_name: str

    @staticmethod
    def init_new() -> PortArgs:
        import tempfile

        d = tempfile.mkdtemp(prefix="sglang-vericache-")
        return PortArgs(
            scheduler_input_ipc_name=f"ipc://{d}/scheduler_input",
            tokenizer_ipc_name=f"ipc://{d}/tokenizer",
        )
