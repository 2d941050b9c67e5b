"""--kv-mode: one flag for the KV mode, spelled out in the flags SGLang users know."""

from __future__ import annotations

import pytest

from sglang_vericache.server_args import parse_launch_args, with_kv_mode


@pytest.mark.parametrize(("argv", "mode", "algorithm", "offload"), [
    (["--kv-mode", "full"], "full", None, False),
    (["--kv-mode", "offload"], "full", None, True),
    (["--kv-mode", "lossy", "--kv-compressor", "kivi4"], "lossy", None, False),
    (["--kv-mode", "vericache", "--kv-compressor", "snapkv"], "vericache", "VERICACHE", False),
    (["--kv-compressor", "snapkv", "--speculative-algorithm", "VERICACHE"], "vericache", "VERICACHE", False),
    ([], "full", None, False),
])
def test_kv_mode_sets_the_mode(argv, mode, algorithm, offload):
    args, _ = parse_launch_args(argv)
    assert (args.kv_mode, args.speculative_algorithm, args.kv_offload) == (mode, algorithm, offload)


@pytest.mark.parametrize(("kwargs", "kv_mode", "message"), [
    ({}, "vericache", "--kv-mode vericache needs a --kv-compressor (e.g. snapkv, kivi4, int8)"),
    ({}, "lossy", "--kv-mode lossy needs a --kv-compressor (e.g. snapkv, kivi4, int8)"),
    ({"kv_compressor": "snapkv"}, "full",
     "--kv-mode full keeps exact KV only: drop --kv-compressor snapkv (or use --kv-mode lossy / vericache)"),
    ({"kv_compressor": "snapkv", "speculative_algorithm": "VERICACHE"}, "lossy",
     "--speculative-algorithm VERICACHE is --kv-mode vericache, not lossy"),
    ({"kv_offload": True}, "full", "--kv-offload is --kv-mode offload, not full"),
    ({}, "fast", "--kv-mode must be one of full, offload, lossy, vericache, got 'fast'"),
])
def test_contradictions_are_errors(kwargs, kv_mode, message):
    with pytest.raises(ValueError) as e:
        with_kv_mode(kwargs, kv_mode)
    assert str(e.value) == message


def test_no_kv_mode_leaves_the_flags_as_given():
    kwargs = {"kv_compressor": "int8"}
    assert with_kv_mode(kwargs, None) is kwargs
