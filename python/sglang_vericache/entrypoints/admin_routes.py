"""SGLang's admin and introspection endpoints: model and server info, load, cache flush, the
profiler, concate_and_append_request and Prometheus /metrics (mounted by http_server.py)."""

from __future__ import annotations

import dataclasses
import json
import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from sglang_vericache.entrypoints.http_common import native_error, read_json, tm
from sglang_vericache.entrypoints.openai.utils import json_response
from sglang_vericache.managers.io_struct import ProfileReq
from sglang_vericache.managers.metrics import render_prometheus
from sglang_vericache.managers.tokenizer_manager import GenerateError
from sglang_vericache.sampling.sampling_params import InvalidRequest

router = APIRouter()


def _hf_config(model_path: str) -> dict:
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info() -> Response:
    m = tm()
    cfg = _hf_config(m.model_path)
    return json_response(
        {
            "model_path": m.model_path,
            "served_model_name": m.served_model_name,
            "tokenizer_path": m.server_args.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": m.server_args.load_format,
            "reasoning_parser": m.server_args.reasoning_parser,
            "tool_call_parser": m.server_args.tool_call_parser,
            "disaggregation_mode": "null",  # SGLang's PD disaggregation; ours is --disagg-role
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.get("model_type"),
            "architectures": cfg.get("architectures"),
        }
    )


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info() -> Response:
    m = tm()
    stats = await m.get_stats()
    ready = m.ready
    return json_response(
        {
            **m.server_args.public_dict(),  # the --disagg-secret reads "<set>"
            "max_total_num_tokens": ready.max_total_num_tokens,
            "max_req_input_len": ready.max_req_input_len,
            "context_length": ready.context_length,
            "vocab_size": ready.vocab_size,
            **(ready.server_info or {}),
            "internal_states": [dataclasses.asdict(stats)],
            "version": _version(),
        }
    )


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang-vericache")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "0.0.0"


@router.get("/get_load")
async def get_load() -> Response:
    """SGLang's load report, one entry per data-parallel rank (one here); sglang-router's load
    monitor reads num_tokens (KV tokens held by running requests) per dp_rank."""
    stats = await tm().get_stats()
    return json_response(
        [
            {
                "dp_rank": 0,
                "num_reqs": stats.num_running_reqs + stats.num_waiting_reqs,
                "num_waiting_reqs": stats.num_waiting_reqs,
                "num_tokens": stats.num_used_tokens,
            }
        ]
    )


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache() -> Response:
    out = await tm().flush_cache()
    if out.success:
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse(f"Cache not flushed: {out.message}\n", status_code=400)


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request) -> Response:
    """torch.profiler in the scheduler (managers/scheduler_profiler.py); SGLang's optional body."""
    body = await read_json(request) if (await request.body()).strip() else None
    out = await tm().profile(ProfileReq.from_json("start", body))
    return PlainTextResponse(out.message + "\n") if out.success else native_error(out.message, 400)


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile() -> Response:
    """Stops the profile /start_profile began and writes its trace; 400 when none runs."""
    out = await tm().profile(ProfileReq("stop"))
    return PlainTextResponse(out.message + "\n") if out.success else native_error(out.message, 400)


@router.post("/concate_and_append_request")
async def concate_and_append_request(request: Request) -> Response:
    """The SGLang frontend's join(mode="concate_and_append") asks for dst's KV = the forks' KV. No KV
    is kept per rid here: the frontend already appended the forks' text to dst's prompt, which dst's
    next /generate prefills (as the frontend's text mode does). 200, saying nothing was moved."""
    body = await read_json(request)
    src, dst = (body.get("src_rids"), body.get("dst_rid")) if isinstance(body, dict) else (None, None)
    if not (isinstance(src, list) and all(isinstance(r, str) for r in src) and isinstance(dst, str)):
        raise InvalidRequest('concate_and_append_request needs {"src_rids": ["<rid>", ...], "dst_rid": "<rid>"}')
    return PlainTextResponse(
        "KV not concatenated: concate_and_append_request moves no KV in this runtime; dst_rid's next "
        "/generate prefills the appended text (cached prefixes are reused).\n"
    )

@router.get("/metrics")
async def metrics() -> Response:
    m = tm()
    try:
        stats = await m.get_stats()
    except GenerateError:
        stats = None
    text = render_prometheus(m.served_model_name, m.metrics, stats)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
