"""sglang-router's own flags on launch_server's command line, and the RouterArgs it starts the router with.

As SGLang's `python -m sglang_router.launch_server`, every flag of `sglang_router.launch_router` is
accepted with a `--router-` prefix (`--router-policy round_robin`, `--router-disable-retries`, ...);
the router's own parser defines them (RouterArgs.add_cli_args), so they follow the installed
router's version. The flags that would give the router other workers than the replicas
(`--worker-urls`, PD disaggregation, service discovery, IGW) are refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from sglang_vericache.server_args_groups.base import DefaultsHelpFormatter

ROUTER_PACKAGE = "sglang-router"
ROUTER_INSTALL_HINT = f"pip install {ROUTER_PACKAGE}==0.3.2 (requirements/test.txt)"

# Flags that would replace the replicas as the router's workers, with why each is refused.
_REFUSED = {
    "worker_urls": "the router's workers are launch_server's replicas; run the router by hand for others",
    "router_pd_disaggregation": "prefill/decode disaggregation is not built here",
    "router_prefill": "prefill/decode disaggregation is not built here",
    "router_decode": "prefill/decode disaggregation is not built here",
    "router_service_discovery": "the router's workers are launch_server's replicas",
    "router_enable_igw": "one model per launch_server",
    "router_mini_lb": "the Rust router is the one launch_server runs",
    "router_dp_aware": "each replica is one server with one data-parallel rank",
}


def router_installed() -> bool:
    try:
        import sglang_router.router_args  # noqa: F401
    except ImportError:
        return False
    return True


def add_router_cli_args(parser: argparse.ArgumentParser) -> bool:
    """Adds the installed router's flags, `--router-` prefixed; False (and nothing added) when the
    router is not installed."""
    try:
        from sglang_router.router_args import RouterArgs
    except ImportError:
        return False
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    return True


def router_parser(prog: str) -> argparse.ArgumentParser | None:
    """A parser of the installed router's flags only, `--router-` prefixed (None without the router).
    launch_server parses its own flags first and hands this one the rest, so its --help shows the
    router's ~100 flags only under --help-router."""
    parser = argparse.ArgumentParser(
        prog=prog, add_help=False, formatter_class=DefaultsHelpFormatter,
        usage="%(prog)s --dp-size N [router flags]",
        description="sglang-router's flags, as launch_server accepts them with --dp-size > 1 (SGLang's "
                    "sglang_router.launch_server spells them the same): the router in front of the replicas "
                    "takes them. Flags that would give it other workers than the replicas are refused.")
    return parser if add_router_cli_args(parser) else None


def parse_router_args(tokens: list[str], namespace: argparse.Namespace, prog: str) -> list[str]:
    """Parses the router's flags among tokens (what launch_server's own parser did not know) into
    namespace, with the router's defaults for the others; returns the tokens the router does not know."""
    parser = router_parser(prog)
    if parser is None:
        return tokens
    _, rest = parser.parse_known_args(tokens, namespace=namespace)
    return rest


def router_help(prog: str) -> str:
    """--help-router's text: the router's flags by its own groups, or how to install it."""
    parser = router_parser(prog)
    if parser is None:
        return f"sglang-router is not installed, so --dp-size > 1 is not available: {ROUTER_INSTALL_HINT}\n"
    return parser.format_help()


def router_flags_given(argv: list[str]) -> list[str]:
    """The `--router-*` / `--worker-urls` flags in argv (to name them when the router is missing)."""
    return [a.split("=", 1)[0] for a in argv if a.startswith(("--router-", "--worker-urls"))]


def refused_router_flag(args: argparse.Namespace) -> str | None:
    """An error naming the first given flag launch_server cannot honour, or None."""
    for dest, why in _REFUSED.items():
        value = getattr(args, dest, None)
        if value:
            flag = "--" + dest.replace("_", "-")
            return f"{flag}: not with launch_server --dp-size ({why})"
    return None


_ROUTER_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "warn": "warn", "error": "error",
                      "critical": "error"}


def router_args_for(args: argparse.Namespace, argv: list[str], worker_urls: list[str], host: str,
                    port: int, api_key: str | None, log_level: str) -> Any:
    """The RouterArgs of the router in front of worker_urls, bound to host:port. A server --api-key
    is the key the router presents to the replicas, unless --router-api-key names another; the
    server's --log-level is the router's, unless --router-log-level is given."""
    from sglang_router.router_args import RouterArgs

    router_args = RouterArgs.from_cli_args(args, use_router_prefix=True)
    router_args.worker_urls = list(worker_urls)
    router_args.host, router_args.port = host, port
    if router_args.api_key is None:
        router_args.api_key = api_key
    if "--router-log-level" not in router_flags_given(argv):
        router_args.log_level = _ROUTER_LOG_LEVELS.get(log_level.lower(), "info")
    return router_args


def encode_router_args(router_args: Any) -> str:
    """RouterArgs as JSON for router_process (plain data: no pickle between the processes)."""
    return json.dumps(dataclasses.asdict(router_args))


def decode_router_args(text: str) -> Any:
    from sglang_router.router_args import RouterArgs

    fields = json.loads(text)
    fields["prefill_urls"] = [tuple(u) for u in fields.get("prefill_urls") or []]
    fields["control_plane_api_keys"] = [tuple(k) for k in fields.get("control_plane_api_keys") or []]
    known = {f.name for f in dataclasses.fields(RouterArgs)}
    return RouterArgs(**{k: v for k, v in fields.items() if k in known})


def non_default_router_args(router_args: Any) -> dict[str, Any]:
    """The fields that differ from RouterArgs' defaults (for the startup log); secrets masked."""
    from sglang_router.router_args import RouterArgs

    default = RouterArgs()
    out = {}
    for f in dataclasses.fields(router_args):
        value = getattr(router_args, f.name)
        if value != getattr(default, f.name):
            secret = any(s in f.name for s in ("key", "password"))
            out[f.name] = "***" if secret and value else value
    return out


def strip_router_flags(argv: list[str]) -> list[str]:
    """argv without the router's flags and their values (a replica is launched with the rest).
    Every launch_server flag is long (`--x`), so a router flag's values are the tokens up to the
    next `--` token (`--router-max-concurrent-requests -1` included)."""
    out: list[str] = []
    skipping = False
    for token in argv:
        if token.startswith("--"):
            skipping = token.startswith(("--router-", "--worker-urls"))
            if skipping:
                continue
        elif skipping:
            continue
        out.append(token)
    return out
