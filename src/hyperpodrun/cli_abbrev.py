"""Unique prefixes of long options, as argparse (and so torchrun) accepts them.

``--redirect 3`` means ``--redirects 3`` and ``--nproc-per=2`` means ``--nproc-per-node=2``
when no other option starts the same way; ``-`` and ``_`` are the same letter, as in every
option here. An ambiguous prefix is a usage error that lists the candidates. Only the
launcher's own options are expanded: parsing stops at the training script (the first
positional argument) or at ``--``, so the script's arguments are never touched.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperCommand, TyperOption

from hyperpodrun.errors import ConfigError

__all__ = ["AbbreviatingCommand", "expand_abbreviations"]


def _norm(name: str) -> str:
    return name.replace("_", "-")


def expand_abbreviations(command: TyperCommand, args: list[str]) -> list[str]:
    """``args`` with every abbreviated long option of ``command`` spelt out (up to the first positional)."""
    long_opts: dict[str, Any] = {}
    takes_value: dict[str, bool] = {}
    for param in command.params:
        if not isinstance(param, TyperOption):
            continue
        for opt in (*param.opts, *param.secondary_opts):
            takes_value[opt] = not param.is_flag and not param.count
            if opt.startswith("--"):
                long_opts[opt] = param
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            out.extend(args[i:])  # the training script and everything after it
            break
        name, eq, value = arg.partition("=")
        if arg.startswith("--") and name not in long_opts:
            name = _resolve(name, long_opts)
        elif not arg.startswith("--") and len(arg) > 2 and arg[:2] in takes_value:
            out.append(arg)  # a short option with its value attached (-r3)
            i += 1
            continue
        out.append(name + eq + value)
        i += 1
        if takes_value.get(name) and not eq and i < len(args):
            out.append(args[i])  # the option's value, whatever it looks like
            i += 1
    return out


def _resolve(prefix: str, long_opts: dict[str, Any]) -> str:
    """The option a unique prefix names; the prefix unchanged when it names none (the parser reports it)."""
    wanted = _norm(prefix)
    matches: dict[str, str] = {}  # parameter name -> the spelling used in the prefix's style
    for opt, param in long_opts.items():
        if _norm(opt).startswith(wanted):
            keep = matches.get(param.name or opt)
            # Prefer the spelling of the prefix (``--nproc_per`` -> ``--nproc_per_node``).
            if keep is None or (("_" in prefix) == ("_" in opt) and ("_" in prefix) != ("_" in keep)):
                matches[param.name or opt] = opt
    if len(matches) == 1:
        return next(iter(matches.values()))
    if len(matches) > 1:
        options = ", ".join(sorted(matches.values()))
        raise ConfigError(f"ambiguous option: {prefix} could match {options}")
    return prefix


class AbbreviatingCommand(TyperCommand):
    """A typer command whose long options may be abbreviated to a unique prefix (argparse's rule)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        return super().parse_args(ctx, expand_abbreviations(self, args))
