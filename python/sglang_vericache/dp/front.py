"""The HTTP front of launch_server --dp-size on --host:--port.

sglang-router answers /get_server_info itself (its own counts) and /server_info not at all, so the
front serves both (every replica's state, controller.server_info) and /get_load (one entry per
replica, as SGLang's DP server lists one per rank), and passes every other request to the router on
its loopback port as it came: method, path, query, headers, body; the router's answer comes back
with its status and headers, event streams chunk by chunk. Paths one server of ours has and the
router names otherwise are renamed on the way (ROUTER_PATHS: /metrics is the router's
/engine_metrics, every replica's metrics labelled with its worker_addr).

A request that names its data-parallel rank (SGLang's `routed_dp_rank`, or its older name
`data_parallel_rank`, on /generate and the OpenAI endpoints) goes to that replica directly, the
field reset to rank 0 of the one-rank server it reaches; a rank out of range is a 400, a stopped
replica's a 503.

When a stream breaks off (the replica serving it died: the router can retry a request only before
its first byte), the front ends it as our server ends a failed stream, with an error event naming
the replicas that stopped, then `data: [DONE]`. --api-key is checked here (the router presents the
key to the replicas), on the same paths as one server checks it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/liveness", "/readiness")
# Hop-by-hop headers and the ones aiohttp sets for the body it sends.
_NOT_FORWARDED = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"}
DEATH_SETTLE_S = 0.5  # a stream broke: let the controller see the replica's exit before naming it
RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")
# (method, our path) -> (method, the router's path) where they differ.
ROUTER_PATHS = {
    ("GET", "/metrics"): ("GET", "/engine_metrics"),
    ("GET", "/ready"): ("GET", "/readiness"),
    ("GET", "/model_info"): ("GET", "/get_model_info"),
    ("GET", "/flush_cache"): ("POST", "/flush_cache"),
}
RANKED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _sse_error(message: str, status: int) -> bytes:
    return b"data: " + json.dumps({"error": {"message": message, "code": status}}).encode() + b"\n\n"


def _forwarded(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _NOT_FORWARDED}


def routed_rank(path: str, body: bytes) -> tuple[int | None, bytes]:
    """(the rank the body names, the body with that field set to 0), or (None, body) when it names
    none (or is not a JSON object: the replica's own checks answer that)."""
    if path not in RANKED_PATHS or b"_rank" not in body:
        return None, body
    try:
        obj = json.loads(body)
    except ValueError:
        return None, body
    if not isinstance(obj, dict):
        return None, body
    ranks = [obj[name] for name in RANK_FIELDS if obj.get(name) is not None]
    if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return None, body
    for name in RANK_FIELDS:
        if obj.get(name) is not None:
            obj[name] = 0
    return ranks[0], json.dumps(obj).encode()


def make_front_app(router_url: str, server_info: Callable[[], Awaitable[dict[str, Any]]],
                   stopped_replicas: Callable[[], list[str]], api_key: str | None,
                   replica_url: Callable[[int], str | None] | None = None, dp_size: int = 1,
                   get_load: Callable[[], Awaitable[list[dict]]] | None = None) -> web.Application:
    """server_info(): the /server_info body; stopped_replicas(): one line per replica that exited;
    replica_url(rank): the URL of a serving replica, None for a stopped one; get_load(): the
    /get_load body."""

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if api_key and request.method != "OPTIONS" and not request.path.startswith(OPEN_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def on_startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), auto_decompress=False)

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def get_server_info(request: web.Request) -> web.Response:
        return web.json_response(await server_info())

    async def get_load_handler(request: web.Request) -> web.Response:
        return web.json_response(await get_load() if get_load else [])

    async def broken_stream_message(cause: Exception) -> str:
        await asyncio.sleep(DEATH_SETTLE_S)
        stopped = stopped_replicas()
        who = "; ".join(stopped) if stopped else "no replica has exited"
        return (f"the response stream broke off before it finished ({type(cause).__name__}: {cause}); "
                f"stopped replicas: {who}. New requests go to the replicas still serving.")

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        base, method, path = router_url, request.method, request.rel_url.raw_path
        method, path = ROUTER_PATHS.get((method, path), (method, path))
        rank, body = routed_rank(request.path, body) if request.method == "POST" else (None, body)
        if rank is not None:
            if not 0 <= rank < dp_size:
                return _error(f"routed_dp_rank={rank} out of range [0, {dp_size}): launch_server runs "
                              f"{dp_size} data-parallel replicas", 400)
            base = replica_url(rank) if replica_url else None
            if base is None:
                stopped = "; ".join(stopped_replicas())
                return _error(f"data-parallel rank {rank} is not serving: {stopped}", 503)
        query = request.rel_url.raw_query_string
        url = base + path + (f"?{query}" if query else "")
        session: aiohttp.ClientSession = request.app["session"]
        try:
            upstream = await session.request(method, url, headers=_forwarded(request.headers),
                                             data=body or None, allow_redirects=False)
        except aiohttp.ClientError as e:
            return _error(f"the router at {router_url} did not answer: {type(e).__name__}: {e}", 502)
        async with upstream:
            headers = _forwarded(upstream.headers)
            if "text/event-stream" not in upstream.headers.get("Content-Type", ""):
                try:
                    data = await upstream.read()
                except aiohttp.ClientError as e:
                    return _error(await broken_stream_message(e), 502)
                return web.Response(status=upstream.status, body=data, headers=headers)
            response = web.StreamResponse(status=upstream.status, headers=headers)
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except aiohttp.ClientError as e:
                message = await broken_stream_message(e)
                logger.warning("%s %s: %s", request.method, request.path, message)
                await response.write(_sse_error(message, 502) + b"data: [DONE]\n\n")
            await response.write_eof()
            return response

    app = web.Application(middlewares=[check_api_key], client_max_size=1024**3)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/server_info", get_server_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/get_load", get_load_handler)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app
