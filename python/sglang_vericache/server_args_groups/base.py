"""What every ServerArgs group shares: its `--help` section, the flags of its own fields, and the
check of those fields.

A group is a small dataclass (model.py, memory.py, ...): its fields are ServerArgs fields, each declared
with `arg(default, help=..., ...)`, which carries the field's flag (with SGLang's name where the concept
is the same); `add_cli_args(add)` makes one flag per field from them (as vLLM's EngineArgs does), its
`check()` raises ValueError naming the flag of a bad value, and its `warnings()` names flags given a
value that has no effect. ServerArgs (server_args.py) inherits every group; a group's check runs on
the whole ServerArgs, so a rule between flags of two groups is checked by the group whose flag it
refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar


def flag_of(name: str) -> str:
    """A field's flag: kv_store_path -> --kv-store-path."""
    return "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """A field's flag: its help, more names for it (SGLang's long spellings), argparse keywords beyond
    what the field implies (choices, action, const), and further flags that set the same field."""

    help: str
    aliases: tuple[str, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    also: tuple[tuple[str, Mapping[str, Any]], ...] = ()


def arg(default: Any = dataclasses.MISSING, *, help: str, aliases: tuple[str, ...] = (),
        also: tuple[tuple[str, Mapping[str, Any]], ...] = (), default_factory: Any = dataclasses.MISSING,
        repr: bool = True, **kwargs: Any) -> Any:
    """A group's field and its flag --NAME (dashes for underscores; `aliases` are more names for it):
    argparse's type and default come from the field's (a bool field is a store_true switch, a list[T]
    field takes one or more T, a default_factory's flag defaults to None: unset), kwargs (choices,
    action, const) go to argparse as they are, and `also` holds further flags of the same field, as
    (flag, argparse keywords) pairs."""
    spec = FlagSpec(help, tuple(aliases), dict(kwargs), tuple(also))
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr, metadata={"flag": spec})


def flag_kwargs(field: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """argparse's keywords for the flag of `field` (declared with arg), whose type hint is `hint`."""
    spec: FlagSpec = field.metadata["flag"]
    kwargs: dict[str, Any] = {"dest": field.name, "help": spec.help, **spec.kwargs}
    kwargs.setdefault("default", None if field.default is dataclasses.MISSING else field.default)
    if "action" in kwargs:
        return kwargs
    if isinstance(hint, types.UnionType):  # T | None
        (hint,) = (t for t in typing.get_args(hint) if t is not type(None))
    if hint is bool:
        kwargs["action"] = "store_true"
    elif typing.get_origin(hint) is list:
        kwargs.update(type=typing.get_args(hint)[0], nargs="+")
    else:
        kwargs.setdefault("type", hint)
    return kwargs


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
        """Adds the flags of the group's fields declared with arg, in field order (a group with flags
        that are no field adds them around this: --kv-mode, --help-router)."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                spec: FlagSpec = f.metadata["flag"]
                add(flag_of(f.name), *spec.aliases, **flag_kwargs(f, hints[f.name]))
                for flag, kwargs in spec.also:
                    add(flag, dest=f.name, **kwargs)

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
