"""How `wna16-shard` was typed and run: argparse without abbreviations whose errors are one line with a
did-you-mean (`--tp2`, `-tp 2`, `--t 2` -> `--tp 2`; `--layot` -> `--layout`), a near miss of the `verify`
subcommand, and the package hidden by a folder of its name. Standard library only: the entry imports it before
anything heavy."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Sequence

from .errors import CheckpointError


class LazyChoices(Sequence[str]):
    """An option's choices, imported from `module`'s `name` when first asked for (a value given, `--help`): a
    parser whose choices live in a heavy module (the writer's, torch) answers a usage error or `--version` at
    once."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def values(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __getitem__(self, index: Any) -> Any:
        return self.values()[index]

    def __len__(self) -> int:
        return len(self.values())


@dataclass(frozen=True)
class Spelling:
    """Another tool's option for one of a parser's (an engine's `--tensor-parallel-size` for `--tp`): `option`
    the parser's; `valued` whether the other takes the same value; `note` what differs."""

    option: str
    valued: bool = True
    note: str = ""

    def meant(self, token: str, following: str) -> str:
        """The did-you-mean of `token` (followed by `following`)."""
        _, _, value = token.partition("=")
        value = value or (following if self.valued and following and not following.startswith("-") else "")
        return f"unrecognized argument {token}; did you mean {self.option} {value or 'N'}?{self.note}"


class Parser(argparse.ArgumentParser):
    """argparse with no abbreviations (`--t 2` is no `--tp 2`) and one-line errors: an unknown option gets a
    did-you-mean (`--tp2`, `-tp 2`, `--t 2` -> `--tp 2`; `--layot` -> `--layout`). The usage is printed only
    when no argument was given at all."""

    def __init__(self, *, spellings: dict[str, Spelling] | None = None, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)
        self.bare = False
        self.spellings = spellings or {}  # another tool's option -> this parser's

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        args = sys.argv[1:] if args is None else list(args)
        self.bare = not args
        known, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_arguments(extras, self))
        return known

    def error(self, message: str) -> NoReturn:
        if self.bare:
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def unknown_arguments(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """The error for arguments no option takes: the first unknown option and what it was probably meant as."""
    options = {s: a for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    unknown = next((i for i, arg in enumerate(extras) if arg.startswith("-")), None)
    if unknown is None:
        return f"unrecognized arguments: {' '.join(extras)} (see {parser.prog} --help)"
    token = extras[unknown]
    name, _, value = token.partition("=")
    spelled = getattr(parser, "spellings", {}).get(name)
    if spelled is not None:  # an engine's own spelling (`--tensor-parallel-size 4`)
        return spelled.meant(token, extras[unknown + 1] if unknown + 1 < len(extras) else "")
    name = "--" + name.lstrip("-")
    meant = next((o for o in options if name != o and name.startswith(o) and not value), None)
    if meant is not None:  # `--tp2`: the option and its value run together
        name, value = meant, name[len(meant):]
    elif name not in options:
        close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
        if not close:
            return f"unrecognized argument {token} (see {parser.prog} --help)"
        name = close[0]
    following = extras[unknown + 1] if unknown + 1 < len(extras) else ""
    if not value and options[name].nargs != 0 and following and not following.startswith("-"):
        value = following
    takes = value and options[name].nargs != 0
    return f"unrecognized argument {token}; did you mean {name}{' ' + value if takes else ''}?"


def subcommand_typo(argv: list[str]) -> str | None:
    """The error for a first argument that is no folder (nor repo id) but a near miss of `verify` (`verfy`);
    None otherwise (an existing folder of that name is a source)."""
    first = argv[0] if argv else ""
    if not first or first == "verify" or first.startswith("-") or "/" in first or os.path.exists(first):
        return None
    if not difflib.get_close_matches(first, ["verify"], n=1, cutoff=0.6):
        return None
    return (f"{first!r} is no folder and no subcommand; did you mean `wna16-shard verify "
            f"{' '.join(argv[1:]) or 'OUT'}`?")


def check_not_shadowed() -> None:
    """Refuse to run when `wna16_loader` was imported as a namespace package: a folder of that name without
    `__init__.py` in the current folder (Python looks there first) hides the installed package, whose names
    then cannot be imported (`cannot import name ... (unknown location)`)."""
    package = sys.modules.get(__package__ or "wna16_loader")
    if package is not None and getattr(package, "__file__", None) is None:
        folders = [str(Path(p).resolve()) for p in getattr(package, "__path__", [])]
        raise CheckpointError(f"{', '.join(folders)}: a folder named wna16_loader, imported instead of the installed "
                              f"package (Python looks in the current folder first); run from another folder, or "
                              f"rename that folder.")
