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
    assert (vc.kv_mode, vc.speculative_algorithm, vc.staggered, vc.uses_link) == ("vericache", "VERICACHE", False, False)
    linked = ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE", link_bandwidth="1GB")
    assert (linked.staggered, linked.uses_link) == (True, True)
    assert ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE",
                      speculative_num_draft_tokens="auto").max_draft_tokens == 32


def test_parse_bytes():
    assert [parse_bytes(x) for x in ("1000", "64MB", "2GiB", "1.5kb")] == [1000, 64_000_000, 2**31, 1500]


def test_cli_error_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        prepare_server_args(["--kv-compressor", "zip"])
    assert e.value.code == 2
    assert "--kv-compressor must be one of" in capsys.readouterr().err
