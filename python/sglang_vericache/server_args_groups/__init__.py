"""ServerArgs' groups, one per concern, in --help order. Each is a small dataclass with the flags of its
own fields and their check (base.py says how); ServerArgs (server_args.py) inherits them all."""

from __future__ import annotations

from sglang_vericache.server_args_groups.base import ArgsGroup
from sglang_vericache.server_args_groups.disagg import DisaggArgs
from sglang_vericache.server_args_groups.http_api import ApiArgs, HttpArgs
from sglang_vericache.server_args_groups.kv_mode import KVModeArgs
from sglang_vericache.server_args_groups.kv_store import KVStoreArgs
from sglang_vericache.server_args_groups.memory import MemoryArgs
from sglang_vericache.server_args_groups.model import ModelArgs
from sglang_vericache.server_args_groups.parallel import ParallelArgs
from sglang_vericache.server_args_groups.runtime import KernelArgs, LoggingArgs
from sglang_vericache.server_args_groups.speculative import SpeculativeArgs

# --help order; ServerArgs.check() runs the groups' checks in this order too.
GROUPS: tuple[type[ArgsGroup], ...] = (
    ModelArgs,
    HttpArgs,
    ApiArgs,
    MemoryArgs,
    KVModeArgs,
    SpeculativeArgs,
    KVStoreArgs,
    DisaggArgs,
    ParallelArgs,
    KernelArgs,
    LoggingArgs,
)

__all__ = ["GROUPS", "ApiArgs", "ArgsGroup", "DisaggArgs", "HttpArgs", "KVModeArgs", "KVStoreArgs",
           "KernelArgs", "LoggingArgs", "MemoryArgs", "ModelArgs", "ParallelArgs", "SpeculativeArgs"]
