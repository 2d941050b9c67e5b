"""The router's process: `python -m sglang_vericache.dp.router_process` reads RouterArgs as JSON on
stdin (from controller.py) and runs sglang-router's Rust router until it is stopped.

It starts the router as `sglang_router.launch_router.launch_router` does, without importing that
module (whose debugging load balancer imports sglang, ~10 s here)."""

from __future__ import annotations

import sys

from sglang_vericache.dp.router_flags import decode_router_args


def main() -> None:
    router_args = decode_router_args(sys.stdin.read())
    from sglang_router.router import Router

    router_args._validate_router_args()
    Router.from_args(router_args).start()


if __name__ == "__main__":
    main()
