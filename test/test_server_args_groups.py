"""ServerArgs by concern: every flag in one --help group of its own field, every help with its default,
each group's check refusing bad values of its own fields, sglang-router's flags under --help-router,
--quantization gguf, and --speculative-num-draft-tokens parsed in one place."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

import pytest

from sglang_vericache.server_args import ServerArgs, bundled_model_path, build_parser, parse_launch_args
from sglang_vericache.server_args_groups import (
    GROUPS,
    ApiArgs,
    ArgsGroup,
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
from sglang_vericache.server_args_groups.base import add_group, arg, help_with_default

TITLES = ["Model and tokenizer", "HTTP server", "API: chat, parsers and sampling", "Memory and scheduling",
          "KV mode and compression (VeriCache)", "Speculative decoding (VeriCache rounds)", "KV store",
          "Disaggregation (dual-instance VeriCache)", "Parallelism", "Kernels and determinism",
          "Logging and metrics"]


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every flag but -h / --help-router (the help actions: they set nothing)."""
    return [a for a in parser._actions if a.default is not argparse.SUPPRESS]


def test_help_lists_the_groups_in_order_and_every_flag_in_exactly_one():
    parser = build_parser()
    groups = [g for g in parser._action_groups if g.title in TITLES]
    assert [g.title for g in groups] == TITLES == [g.TITLE for g in GROUPS]
    for action in flag_actions(parser):
        owners = [g.title for g in parser._action_groups if action in g._group_actions]
        assert len(owners) == 1 and owners[0] in TITLES, (action.option_strings, owners)
    text = parser.format_help()
    assert all(f"\n{title}:\n" in text for title in TITLES)
    assert "Routing Policy:" not in text and "--router-cb-failure-threshold" not in text and "--help-router" in text


def test_every_field_belongs_to_exactly_one_group_and_has_a_flag():
    names = [n for g in GROUPS for n in g.field_names()]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(ServerArgs))
    dests = {a.dest for a in flag_actions(build_parser())}
    assert set(names) <= dests and dests - set(names) == {"kv_mode"}  # --kv-mode: spelled out in fields
    assert list(ServerArgs().public_dict())[:3] == ["model_path", "tokenizer_path", "load_format"]  # help order


def test_every_flag_shows_its_default_and_none_shows_none():
    for action in flag_actions(build_parser()):
        text = help_with_default(action) % {"default": action.default}
        assert re.search(r"\bdefault\b", text, re.IGNORECASE), action.option_strings
        assert not re.search(r"default: (None|\[\])", text), (action.option_strings, text)
    shown = {a.option_strings[0]: help_with_default(a) % {"default": a.default} for a in build_parser()._actions}
    assert shown["--page-size"].endswith("(default: 16)")
    assert shown["--disable-radix-cache"].endswith("(default: off)")
    assert shown["--api-key"].endswith("Default: no key.")


def test_a_flag_outside_its_groups_fields_is_refused_by_name():
    @dataclass
    class Stray(ArgsGroup):
        TITLE = "Stray"
        size: int = 1

        @classmethod
        def add_cli_args(cls, add) -> None:
            add("--size", type=int, default=1, help="A size.")
            add("--colour", type=str, default="red", help="Not a field of this group.")

    with pytest.raises(TypeError, match=r"Stray \('Stray'\): its flag for 'colour' sets no field of the group "
                                        r"\(fields: size\)"):
        add_group(argparse.ArgumentParser(), Stray)

    @dataclass
    class Unflagged(ArgsGroup):
        TITLE = "Unflagged"
        size: int = 1
        depth: int = 2

        @classmethod
        def add_cli_args(cls, add) -> None:
            add("--size", type=int, default=1, help="A size.")

    with pytest.raises(TypeError, match=r"Unflagged \('Unflagged'\): no flag for the field\(s\) depth"):
        add_group(argparse.ArgumentParser(), Unflagged)


def test_a_groups_flags_come_from_its_fields_declared_with_arg():
    @dataclass
    class Sizes(ArgsGroup):
        TITLE = "Sizes"
        size: int = arg(1, help="A size.")
        name: str | None = arg(None, aliases=("--label",), choices=("a", "b"), help="A name.")
        quiet: bool = arg(False, help="Say less.", also=(("--loud", dict(action="store_false", default=None,
                                                                         help="Say more.")),))
        widths: list[int] | None = arg(None, help="Widths.")

    parser = argparse.ArgumentParser()
    add_group(parser, Sizes)
    args = parser.parse_args(["--size", "3", "--label", "b", "--quiet", "--widths", "1", "2"])
    assert (args.size, args.name, args.quiet, args.widths) == (3, "b", True, [1, 2])
    assert vars(parser.parse_args([])) == {"size": 1, "name": None, "quiet": False, "widths": None}
    assert parser.parse_args(["--loud"]).quiet is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "c"])

    @dataclass
    class Unflagged(ArgsGroup):
        TITLE = "Unflagged"
        size: int = arg(1, help="A size.")
        depth: int = 2

    with pytest.raises(TypeError, match=r"Unflagged \('Unflagged'\): no flag for the field\(s\) depth"):
        add_group(argparse.ArgumentParser(), Unflagged)


@pytest.mark.parametrize(("group", "field", "value", "message"), [
    (ModelArgs, "load_format", "pt", "--load-format must be auto, safetensors, gguf or dummy, got 'pt'"),
    (HttpArgs, "stream_interval", 0, "--stream-interval must be >= 1, got 0"),
    (HttpArgs, "watchdog_timeout", -1.0, "--watchdog-timeout must be > 0 seconds, got -1.0"),
    (ApiArgs, "sampling_defaults", "vllm", "--sampling-defaults must be openai or model, got 'vllm'"),
    (MemoryArgs, "max_running_requests", 0, "--max-running-requests must be >= 1, got 0"),
    (MemoryArgs, "schedule_policy", "lifo", "--schedule-policy must be one of fcfs, lpm, got 'lifo'"),
    (KVModeArgs, "kv_recent_window", -1, "--kv-recent-window must be >= 0, got -1"),
    (KVModeArgs, "kv_keep_recent", -1, "--kv-keep-recent must be >= 0, got -1"),
    (SpeculativeArgs, "speculative_num_draft_tokens", "65", "--speculative-num-draft-tokens must be 1..64 or 'auto', "
                                                            "got '65'"),
    (KVStoreArgs, "kv_store", "s3", "--kv-store must be one of none, file, redis, got 's3'"),
    (ParallelArgs, "dp_size", 0, "--dp-size must be >= 1, got 0"),
    (KernelArgs, "num_threads", 0, "--num-threads must be >= 1, got 0"),
    (LoggingArgs, "log_level", "loud", "--log-level must be one of debug, info, warning, error, critical, "
                                       "got 'loud'"),
    (LoggingArgs, "decode_log_interval", 0, "--decode-log-interval must be >= 1, got 0"),
])
def test_each_group_checks_its_own_fields(group, field, value, message):
    assert field in group.field_names()
    args = ServerArgs()
    setattr(args, field, value)
    refusing = []
    for g in GROUPS:
        try:
            g.check(args)
        except ValueError as e:
            refusing.append((g, str(e)))
    assert refusing == [(group, message)]
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerArgs(**{field: value})


def test_router_flags_are_listed_by_help_router_only(capsys):
    pytest.importorskip("sglang_router")
    with pytest.raises(SystemExit) as e:
        parse_launch_args(["--help-router"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m sglang_vericache.launch_server --dp-size N [router flags]")
    assert "--router-policy" in out and "Oracle Database:" in out and "--page-size" not in out
    assert "(default: cache_aware)" in out and not re.search(r"\(default: [^)]*\) \(default:", out)
    # ... and accepted on the command line as before, between launch_server's own flags.
    args, cli = parse_launch_args(["--dp-size", "2", "--router-policy", "round_robin", "--page-size", "8",
                                   "--router-max-concurrent-requests", "-1"])
    assert (args.dp_size, args.page_size, cli.router_policy, cli.router_max_concurrent_requests) == (
        2, 8, "round_robin", -1)


def test_an_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_launch_args(["--page-sise", "8"])
    assert e.value.code == 2
    assert "error: unrecognized arguments: --page-sise 8" in capsys.readouterr().err


def test_quantization_gguf_is_a_gguf_files_weights(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    args = ServerArgs(model_path=str(gguf), quantization="gguf")
    assert (args.quantization, args.load_format) == ("gguf", "gguf")
    with pytest.raises(ValueError, match=r"--quantization gguf: --model-path .* is a Hugging Face folder, not a GGUF"):
        ServerArgs(model_path=bundled_model_path(), quantization="gguf")
    with pytest.raises(ValueError, match="--quantization gguf reads a GGUF file: not with --load-format safetensors"):
        ServerArgs(model_path=str(gguf), quantization="gguf", load_format="safetensors")
    with pytest.raises(ValueError, match=r"--quantization awq: quantized weights are not supported, except a GGUF "
                                         r"file's \(--quantization gguf"):
        ServerArgs(model_path=str(gguf), quantization="awq")


@pytest.mark.parametrize(("value", "draft_tokens", "max_draft"), [("16", 16, 16), (5, 5, 5), ("auto", None, 32)])
def test_draft_tokens_are_parsed_in_one_place(value, draft_tokens, max_draft):
    args = ServerArgs(kv_compressor="snapkv", speculative_algorithm="VERICACHE", speculative_num_draft_tokens=value)
    assert (args.draft_tokens, args.max_draft_tokens) == (draft_tokens, max_draft)


def test_usage_md_lists_each_groups_flags_as_help_does():
    from pathlib import Path

    usage = (Path(__file__).resolve().parents[1] / "docs" / "USAGE.md").read_text()
    for group in build_parser()._action_groups:
        if group.title in TITLES:
            flags = ", ".join(f"`{a.option_strings[0]}`" for a in group._group_actions)
            assert f"\n| {group.title} | {flags} |\n" in usage, group.title
