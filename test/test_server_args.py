"""ServerArgs: flag validation with clear messages, derived modes, and size parsing."""

from __future__ import annotations

import pytest

from sglang_vericache.compress.registry import COMPRESSOR_NAMES
from sglang_vericache.server_args import KV_COMPRESSORS, ServerArgs, parse_bytes, prepare_server_args


def test_compressor_names_match_the_registry():
    assert KV_COMPRESSORS == COMPRESSOR_NAMES


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_compressor="zip"), "--kv-compressor must be one of streamingllm"),
    (dict(speculative_algorithm="EAGLE", kv_compressor="snapkv"), "--speculative-algorithm must be VERICACHE"),
    (dict(speculative_algorithm="VERICACHE"), "needs a --kv-compressor"),
    (dict(speculative_num_draft_tokens="0", kv_compressor="snapkv"), "1..64 or 'auto'"),
    (dict(kv_compression_ratio=0.5), "--kv-compression-ratio must be >= 1"),
    (dict(device_kv_budget="lots"), "--device-kv-budget must be a size like 512MB"),
    (dict(kv_offload=True, kv_compressor="snapkv"), "--kv-offload is the full-KV offload baseline"),
    (dict(page_size=0), "--page-size must be >= 1"),
    (dict(dtype="int4"), "--dtype must be one of"),
])
def test_bad_flags_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_modes():
    assert ServerArgs().kv_mode == "full"
    assert ServerArgs(kv_compressor="snapkv").kv_mode == "lossy"
    vc = ServerArgs(kv_compressor="snapkv", speculative_algorithm="vericache")
    assert (vc.kv_mode, vc.speculative_algorithm, vc.schedule, vc.adaptive, vc.uses_link) == (
        "vericache", "VERICACHE", "adaptive", True, True)  # the default: adaptive (host tier on demand)
    for schedule, staggered, uses_link in (("lockstep", False, False), ("staggered", True, True)):
        fixed = ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE", vericache_schedule=schedule)
        assert (fixed.schedule, fixed.staggered, fixed.adaptive, fixed.uses_link) == (schedule, staggered, False,
                                                                                       uses_link)
    linked = ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE", vericache_schedule="lockstep",
                        link_bandwidth="1GB")
    assert (linked.staggered, linked.uses_link) == (False, True)
    drafter = ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE", disagg_role="drafter",
                         verifier_addr="tcp://127.0.0.1:5555")
    assert (drafter.schedule, drafter.uses_link) == ("lockstep", False)
    tp2 = ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE", tp_size=2)
    assert (tp2.schedule, tp2.adaptive) == ("lockstep", False)
    with pytest.raises(ValueError, match="--vericache-schedule adaptive is not supported with --tp-size 2"):
        ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE", tp_size=2, vericache_schedule="adaptive")
    with pytest.raises(ValueError, match="--vericache-schedule adaptive / staggered"):
        ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE", disagg_role="drafter",
                   verifier_addr="tcp://127.0.0.1:5555", vericache_schedule="adaptive")
    assert ServerArgs().schedule is None
    assert ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE",
                      speculative_num_draft_tokens="auto").max_draft_tokens == 32


def test_parse_bytes():
    assert [parse_bytes(x) for x in ("1000", "64MB", "2GiB", "1.5kb")] == [1000, 64_000_000, 2**31, 1500]


def test_cli_error_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        prepare_server_args(["--kv-compressor", "zip"])
    assert e.value.code == 2
    assert "--kv-compressor must be one of" in capsys.readouterr().err


def test_quantizing_compressors_match_the_registry():
    import torch

    from sglang_vericache.compress.base import CompressorConfig
    from sglang_vericache.compress.registry import get_compressor, fp8_supported
    from sglang_vericache.server_args import QUANTIZING_COMPRESSORS

    shape = dict(ratio=4, chunk_size=16, num_layers=1, num_kv_heads=2, num_q_heads=4, head_dim=8, dtype=torch.float32)
    names = [n for n in COMPRESSOR_NAMES if n != "fp8" or fp8_supported()]
    quantized = {n for n in names if get_compressor(n, CompressorConfig(n, **shape)).layout(0).kind == "quantized"}
    assert quantized == set(QUANTIZING_COMPRESSORS) & set(names)


@pytest.mark.parametrize("kwargs, flags", [
    (dict(cuda_graph_max_bs=16), ["--cuda-graph-max-bs"]),  # on the CPU
    (dict(cuda_graph_bs=[1, 2], cuda_graph_max_bs=8), ["--cuda-graph-max-bs", "--cuda-graph-bs"]),
    (dict(kv_compressor="int8", kv_compression_ratio=8.0), ["--kv-compression-ratio"]),
    (dict(kv_compressor="kivi4", kv_compression_ratio=2.0), ["--kv-compression-ratio"]),
    (dict(kv_store="file", disable_radix_cache=True), ["--kv-store"]),
])
def test_flags_without_effect_are_warned_about_by_name(kwargs, flags, caplog, tmp_path):
    if "kv_store" in kwargs:
        kwargs = kwargs | {"kv_store_path": str(tmp_path)}
    args = ServerArgs(**kwargs)
    with caplog.at_level("WARNING", logger="sglang_vericache.server_args"):
        warnings = args.log_flag_warnings()
    assert [w.split(" ", 1)[0] for w in warnings] == flags
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == warnings
    assert "has no effect" in warnings[0] or "never read" in warnings[0]


def test_flags_with_effect_are_not_warned_about(tmp_path):
    for kwargs in (dict(), dict(kv_compressor="snapkv", kv_compression_ratio=8.0), dict(kv_compressor="int8"),
                   dict(kv_store="file", kv_store_path=str(tmp_path)), dict(disable_cuda_graph=True),
                   dict(enable_metrics=True)):
        assert ServerArgs(**kwargs).flag_warnings() == [], kwargs


def test_cuda_graph_flags_warn_with_a_backend_without_graphs():
    # Parsed, not validated for a device: the message names the backend.
    args = prepare_server_args(["--cuda-graph-bs", "1", "2"])
    args.device, args.attention_backend = "cuda", "torch"
    assert args.flag_warnings() == ["--cuda-graph-bs has no effect: CUDA graphs are captured with "
                                    "--attention-backend triton only (got torch)"]
    args.attention_backend, args.disable_cuda_graph = "triton", True
    assert args.flag_warnings() == ["--cuda-graph-bs has no effect: --disable-cuda-graph is set"]
    args.disable_cuda_graph = False
    assert args.flag_warnings() == []
