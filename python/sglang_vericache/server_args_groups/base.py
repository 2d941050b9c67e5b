"""What every ServerArgs group shares: its `--help` section, the flags of its own fields, and the
check of those fields.

A group is a small dataclass (model.py, memory.py, ...): its fields are ServerArgs fields, its
`add_cli_args(add)` adds one flag per field (with SGLang's name where the concept is the same), its
`check()` raises ValueError naming the flag of a bad value, and its `warnings()` names flags given a
value that has no effect. ServerArgs (server_args.py) inherits every group; a group's check runs on
the whole ServerArgs, so a rule between flags of two groups is checked by the group whose flag it
refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from typing import Any, ClassVar


def flag_of(name: str) -> str:
    """A field's flag: kv_store_path -> --kv-store-path."""
    return "--" + name.replace("_", "-")


class ArgsGroup:
    TITLE: ClassVar[str]  # the --help section's title
    DESCRIPTION: ClassVar[str | None] = None
    CLI_ONLY: ClassVar[tuple[str, ...]] = ()  # dests of flags that are no field (--kv-mode's kv_mode)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def default(cls, name: str) -> Any:
        return cls.__dataclass_fields__[name].default

    @classmethod
    def add_cli_args(cls, add: Callable[..., argparse.Action]) -> None:
        raise NotImplementedError

    @classmethod
    def flag(cls, add: Callable[..., argparse.Action], name: str, type: Callable[[str], Any],
             **kwargs: Any) -> argparse.Action:
        """Adds the flag of the field `name` (--NAME, dashes for underscores) of `type`, whose default
        is the field's; kwargs (help, choices, nargs) go to add as they are."""
        return add(flag_of(name), type=type, default=cls.default(name), **kwargs)

    def check(self) -> None:
        """Raises ValueError naming the flag of a bad value of this group's fields (it may fill in a
        derived default, e.g. --kv-store-path)."""

    def check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        """Raises ValueError naming --NAME unless the field `name` is one of choices."""
        value = getattr(self, name)
        if value not in choices:
            raise ValueError(f"{flag_of(name)} must be one of {', '.join(choices)}, got {value!r}")

    def check_at_least(self, name: str, least: int = 1) -> None:
        """Raises ValueError naming --NAME unless the field `name` is >= least (or None, where None is
        the field's default: unset)."""
        value = getattr(self, name)
        if value is None and self.default(name) is None:
            return
        if value < least:
            raise ValueError(f"{flag_of(name)} must be >= {least}, got {value}")

    def warnings(self) -> list[str]:
        """This group's flags given a value that has no effect with the rest of the command line."""
        return []


def add_group(parser: argparse.ArgumentParser, group_cls: type[ArgsGroup]) -> argparse._ArgumentGroup:
    """Adds group_cls's --help section and flags to parser. A flag whose dest is not a field of the
    group (nor one of its CLI_ONLY dests), or a field without a flag, is a TypeError: every flag
    belongs to exactly one group, the one whose check() reads it."""
    section = parser.add_argument_group(group_cls.TITLE, group_cls.DESCRIPTION)
    dests: list[str] = []

    def add(*flags: str, **kwargs: Any) -> argparse.Action:
        action = section.add_argument(*flags, **kwargs)
        if action.default is not argparse.SUPPRESS:  # --help-router sets nothing
            dests.append(action.dest)
        return action

    group_cls.add_cli_args(add)
    fields = group_cls.field_names()
    for dest in dests:
        if dest not in fields and dest not in group_cls.CLI_ONLY:
            raise TypeError(f"{group_cls.__name__} ({group_cls.TITLE!r}): its flag for {dest!r} sets no field "
                            f"of the group (fields: {', '.join(fields)})")
    missing = [name for name in fields if name not in dests]
    if missing:
        raise TypeError(f"{group_cls.__name__} ({group_cls.TITLE!r}): no flag for the field(s) {', '.join(missing)}")
    return section


def help_with_default(action: argparse.Action) -> str:
    """An action's help as --help shows it: with "(default: X)" appended unless the help already says
    its default in words (flags whose parsed default is None say what None means)."""
    text = action.help or ""
    if action.default is argparse.SUPPRESS or re.search(r"\bdefault\b", text, re.IGNORECASE):
        return text
    if action.default is None or action.default == []:
        return text
    if isinstance(action.default, bool):
        shown = "on" if action.default else "off"
    else:
        shown = "%(default)s"
    return f"{text} (default: {shown})"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse.ArgumentDefaultsHelpFormatter's "(default: X)", except where the help says it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return help_with_default(action)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str | int, flag: str = "size") -> int:
    """'64MB' -> 64_000_000, '2GiB' -> 2**31, '1000' -> 1000."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{flag} must be a size like 512MB or 2GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
