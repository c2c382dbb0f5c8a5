"""The exit status of every ``applier`` command, and how help texts explain it.

Owns the one table of exit codes, so that a script can tell apart "could not do it" from "bad
usage" from "did it, and found a problem" whichever command it runs. Must never decide what a
command's check is: each command says that in its own help.
"""

from __future__ import annotations

import textwrap
from enum import IntEnum

__all__ = ["ExitCode", "exit_code_table", "exit_code_summary"]


class ExitCode(IntEnum):
    OK = 0
    #: The command could not do its work: a server unreachable, an object missing, a permanent error.
    FAILED = 1
    #: Bad usage or configuration: an unknown option, an invalid value, a missing required
    #: setting, a bad config file (argparse also exits 2 on its own errors).
    USAGE = 2
    #: The check the command makes found a problem (status: lag or slot; verify: differences).
    CHECK = 3
    #: Interrupted (Ctrl-C) outside ``run``, whose stop on SIGINT/SIGTERM is a clean 0.
    INTERRUPTED = 130


_MEANING = {
    ExitCode.OK: "success",
    ExitCode.FAILED: "the command could not do its work (a server unreachable, an object "
                     "missing, a permanent error)",
    ExitCode.USAGE: "bad usage or configuration (unknown option, invalid value, missing "
                    "required setting, bad config file)",
    ExitCode.CHECK: "the check the command makes found a problem (status: lag over --max-lag "
                    "or the slot missing; verify: the tables differ)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C); run stops cleanly with 0 on SIGINT/SIGTERM",
}


def exit_code_table(width: int = 78) -> str:
    """The whole table for ``applier --help``: a row per code, each meaning wrapped under itself."""
    rows = []
    for code in ExitCode:
        lead = f"  {code.value:<4}{code.name:<12}"
        rows.append(textwrap.fill(_MEANING[code], width, initial_indent=lead,
                                  subsequent_indent=" " * len(lead)))
    return "exit status:\n" + "\n".join(rows)


def exit_code_summary(check: str | None) -> str:
    """One line for a command's help; ``check`` says what its CHECK status means, if it has one."""
    text = (f"exit status: {ExitCode.OK} ok, {ExitCode.FAILED} failed, "
            f"{ExitCode.USAGE} usage or configuration error")
    if check:
        text += f", {ExitCode.CHECK} {check}"
    return text + " (applier --help explains each)."
