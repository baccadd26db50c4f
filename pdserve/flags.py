"""Command-line flags declared once, on the fields of a config dataclass.

A field made with `flag(...)` carries its flag's name, help and choices. From those fields come
the argparse group (`add_flags`), the config's keyword arguments from parsed args (`flag_kwargs`)
and the argv that gives a child process the same config (`flag_argv` from parsed args,
`config_argv` from a config): a new option is one field, with no list elsewhere to keep in step. Standard library only: config modules import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

_METADATA_KEY = "flag"


@dataclass(frozen=True, slots=True)
class _Declared:
    name: str | None  # '--threads'; None: '--' and the field's name with dashes
    help: str | None
    choices: tuple | None
    parse: Callable[[str], Any] | None


@dataclass(frozen=True, slots=True)
class Option:
    """One flag as argparse sees it, read from its field."""

    field: str  # the config field it sets
    name: str  # '--kv-cache-memory'
    dest: str  # the attribute parsed args keep it in
    default: Any  # the field's default; None for a field without one (the caller must supply it)
    type: type  # what a given value is converted to; bool: a switch that takes no value
    help: str | None
    choices: tuple | None
    parse: Callable[[str], Any] | None  # reads (and checks) a given value instead of `type`

    @property
    def parsed_default(self) -> Any:
        """What parsed args hold when the flag is not given (a switch is False until given)."""
        return False if self.type is bool else self.default


def flag(default: Any = dataclasses.MISSING, help: str | None = None, *, name: str | None = None,
         choices: tuple | None = None, parse: Callable[[str], Any] | None = None) -> Any:
    """A dataclass field that is also the command-line flag `name` (default: `--field-name`).

    A bool is a switch: one that defaults to False is turned on by its flag; one that defaults to
    True needs a `--no-...` name, and that flag turns it off. A field without a default is a flag
    that parses to None when not given (e.g. a model the caller then resolves). `parse` reads a
    given value (a ValueError refuses it, with its message, as argparse refuses a bad flag).
    """
    return dataclasses.field(default=default, metadata={_METADATA_KEY: _Declared(name, help, choices, parse)})


def options(cls: type) -> list[Option]:
    """The flags of the dataclass `cls`, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(_METADATA_KEY)
        if declared is None:
            continue
        name = declared.name or "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        if hints[f.name] is bool and default and not name.startswith("--no-"):
            raise TypeError(f"{cls.__name__}.{f.name} defaults to True: its flag must be a --no-... that turns it off")
        found.append(Option(f.name, name, name.removeprefix("--").replace("-", "_"), default,
                            _value_type(hints[f.name]), declared.help, declared.choices, declared.parse))
    return found


def _value_type(hint: Any) -> type:
    """`int | None` reads as int; a field that several types may spell (a size: `int | str`) reads
    as given, and the config parses it."""
    if isinstance(hint, types.UnionType):
        members = [t for t in typing.get_args(hint) if t is not type(None)]
        return members[0] if len(members) == 1 else str
    return hint


def add_flags(p: argparse.ArgumentParser, cls: type, title: str) -> None:
    """The flags of `cls` as the argument group `title` of `p`."""
    group = p.add_argument_group(title)
    for o in options(cls):
        if o.type is bool:
            group.add_argument(o.name, dest=o.dest, action="store_true", help=o.help)
        else:
            kind = _refusing(o.parse) if o.parse is not None else o.type
            group.add_argument(o.name, dest=o.dest, type=kind, default=o.default, choices=o.choices, help=o.help)


def _refusing(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as argparse's `type`: its ValueError's message is what the user reads."""
    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return read


def flag_kwargs(cls: type, args: argparse.Namespace, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Keyword arguments for `cls` from parsed args, by field name (fields in `skip` left out)."""
    kwargs = {}
    for o in options(cls):
        if o.field in skip:
            continue
        value = getattr(args, o.dest)
        kwargs[o.field] = (not o.default if value else o.default) if o.type is bool else value  # a switch flips it
    return kwargs


def flag_argv(cls: type, args: argparse.Namespace, skip: frozenset[str] = frozenset()) -> list[str]:
    """The flags of parsed args that differ from their defaults, as argv for a child process that
    declares the same flags: it parses them into the same config (fields in `skip` left out)."""
    argv = []
    for o in options(cls):
        value = getattr(args, o.dest)
        if o.field in skip or value == o.parsed_default:
            continue
        argv.append(o.name if o.type is bool else f"{o.name}={value}")  # '=': a value may start with '-'
    return argv


def config_argv(config: Any) -> list[str]:
    """The flags of the dataclass instance `config` that differ from their defaults, as argv for a
    process that declares the same flags: it parses them into an equal config."""
    argv = []
    for o in options(type(config)):
        value = getattr(config, o.field)
        if value == o.default:
            continue
        argv.append(o.name if o.type is bool else f"{o.name}={value}")  # a switch differs: it is given
    return argv


def check_flags(config: Any) -> None:
    """Each flag field of `config` read again by its flag's `parse`: a library caller's value is
    refused for the same reason as a command line's (a ValueError that names the field)."""
    for o in options(type(config)):
        value = getattr(config, o.field)
        if o.parse is not None and value is not None:
            try:
                o.parse(value if isinstance(value, str) else str(value))
            except ValueError as e:
                raise ValueError(f"{o.field}: {e}") from None


# -- readers for `flag(parse=...)`: each takes the text given, and refuses with a reason -----------


def host_name(text: str) -> str:
    """A host name or an IPv4/IPv6 address, as it goes into a URL: nothing that could add a path,
    a user or a port."""
    if not text or len(text) > 253 or not all(c.isalnum() or c in ".-:" for c in text):
        raise ValueError(f"expected a host name or an IP address, got {text!r}")
    return text


def _bounded(kind: type, low: float, high: float, unit: str, low_open: bool = True) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        value = kind(text)
        if not ((low < value) if low_open else (low <= value)) or not value <= high:
            bounds = ", ".join(str(int(b)) if float(b).is_integer() else str(b) for b in (low, high))
            raise ValueError(f"must be in {'(' if low_open else '['}{bounds}]{unit}, got {text}")
        return value
    return read


seconds = _bounded(float, 0.0, 86400.0, " seconds")
milliseconds = _bounded(float, 0.0, 86_400_000.0, " milliseconds")
fraction = _bounded(float, 0.0, 1.0, "")
weight = _bounded(float, 0.0, 1.0, "", low_open=False)
per_second = _bounded(float, 0.0, 1e6, " per second", low_open=False)
count = _bounded(int, 1, 1 << 20, "", low_open=False)
port_number = _bounded(int, 0, 65535, "", low_open=False)
