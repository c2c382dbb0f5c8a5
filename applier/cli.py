"""Command line: sub-commands, their options, and the one way every command reads its settings.

Wiring only; no logic beyond it. Every option of every command comes from ``config.OPTIONS``, so
that the command line, the environment (``APPLIER_*``), the config file and the documentation
stay one list; every command's settings come from ``config.load_settings``; a bad option or
setting ends the command with its own usage and ``ExitCode.USAGE``. Must never import a
command's module before that command was chosen: ``run`` starts in a fraction of a second, and
the Spark and demo modules are slow to import.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from .config import ConfigError, Option, Settings, load_settings, options_for
from .exit_codes import ExitCode, exit_code_summary, exit_code_table
from .ops.logs import configure_logging

__all__ = ["main", "build_parser", "parse_settings"]

log = logging.getLogger("applier")

COMMANDS: dict[str, str] = {
    "run": "Stream changes from a slot and apply them to the target, exactly once, in commit order.",
    "sync": "Copy every published table from a snapshot matching the slot (in parallel, resumable), "
            "then stream as run does.",
    "peek": "Print the decoded messages waiting in a slot as JSON lines, without consuming them.",
    "status": "Show a slot and its replica: slot state, WAL retained, last applied transaction, "
              "lag, prepared transactions, spill, readiness for a failover of the source; exit "
              "non-zero when the slot is missing, lag exceeds --max-lag or a --standby is not ready.",
    "verify": "Compare source and replica table by table, at one source position while the worker "
              "runs: counts, per-range hashes, then exactly which keys differ; --repair makes "
              "them equal.",
    "resync": "Have the worker copy published tables again from a snapshot (emptied first) while "
              "it streams the others; the next run does it first when no worker runs.",
    "pipeline": "Example PySpark job: a consistent per-group aggregate of a replicated table to "
                "Parquet, tagged with the source LSN.",
    "demo": "Try it in one command: two throwaway servers, a workload, streaming, verification.",
    "skip": "Skip exactly one source transaction (a poison transaction that stops the worker), "
            "named by its finish LSN; crash-safe and recorded on the target.",
    "sequences": "Set every target sequence of the published tables (identity, serial, and "
                 "nextval defaults) to the source's value plus --margin, read in one snapshot; "
                 "never moves a target sequence backwards.",
    "cutover": "Once writes to the source have stopped: wait until the replica has applied "
               "everything, set the sequences, check that no prepared transaction or table copy "
               "is pending, compare the tables' schemas and rows, weigh skipped transactions "
               "and conflicts, and say whether the target is a safe replacement.",
    "drop": "Retire a replica: remove its slot on the source, its replication origin, change "
            "feed, bookkeeping rows and pending prepared transactions on the target, and its "
            "spill files. Refused while a worker holds the slot; safe to run twice.",
}

#: What the CHECK exit status means, for the commands that check something.
_CHECKS: dict[str, str] = {
    "status": "the slot is missing, the lag exceeds --max-lag, or a --standby could not take over "
              "the replica",
    "verify": "the tables differ (with --repair: some difference could not be repaired)",
    "demo": "the target differs from the source",
    "cutover": "the target is not (yet) a safe replacement, or not confirmed one: each failed "
               "check says what to do",
}

#: Where each command's entry point lives (``run`` is below), imported once it is chosen.
_RUNNERS: dict[str, tuple[str, str]] = {
    "sync": ("applier.sync.runner", "run_sync"),
    "peek": ("applier.peek", "peek"),
    "skip": ("applier.skip", "run_skip"),
    "status": ("applier.ops.status", "status"),
    "verify": ("applier.verify", "run_verify"),
    "resync": ("applier.repair.resync", "run_resync"),
    "pipeline": ("applier.spark.pipeline", "run_pipeline"),
    "demo": ("applier.demo", "run_demo"),
    "sequences": ("applier.lifecycle.sequences", "run_sequences"),
    "cutover": ("applier.lifecycle.cutover", "run_cutover"),
    "drop": ("applier.lifecycle.drop", "run_drop"),
}

_SETTINGS = ("Every option can also be set in a TOML config file (--config, or APPLIER_CONFIG) and "
             "as an environment variable APPLIER_<NAME>; the command line beats the environment, "
             "which beats the file. See config/applier.example.toml.")


class _Formatter(argparse.HelpFormatter):
    """Fills each line of a description or epilog on its own, and keeps indented lines as they
    are: the exit status table is laid out already (argparse would run it into one paragraph)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line if line[:1].isspace() else
                         textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         for line in text.splitlines())


class _Parser(argparse.ArgumentParser):
    """Bad usage gets the one line that says what is wrong, and where the rest is explained,
    not the whole usage block before it (exit status 2, as argparse's own)."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message}\n"
                                  f"(see {self.prog} --help for every option)\n")


class _Version(argparse.Action):
    """``--version``: the version and the implementation (``implementation.summary``), worked
    out only when asked: it imports the C accelerators, which other commands may never need."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        from .implementation import summary

        print(f"applier {__version__}, {summary()}")  # on stdout, as argparse's version action
        parser.exit()


def _help(option: Option) -> str:
    text = option.help
    if option.default_text is not None:
        text += f" (default: {option.default_text})"
    return (text + f" [env {option.env}]").replace("%", "%%")  # argparse formats help with %


def _add_options(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="TOML config file with any of these options (keys as the long option "
                             "names, with - or _). Default: the file APPLIER_CONFIG names, if set.")
    for option in options_for(command):
        common: dict[str, Any] = {"dest": option.name, "default": None, "help": _help(option)}
        if option.kind == "bool":
            parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, **common)
        elif {"on", "off"} <= set(option.choices):
            # Once a boolean (--binary): the bare flag still means on, and --no-... off.
            parser.add_argument(option.flag, choices=option.choices, nargs="?", const="on",
                                type=option.choice, **common)
            parser.add_argument("--no-" + option.flag[2:], dest=option.name, action="store_const",
                                const="off", help=argparse.SUPPRESS)
        elif option.choices and option.kind == "choice":  # in any case: --log-level debug
            parser.add_argument(option.flag, choices=option.choices, type=option.choice, **common)
        elif option.choices:
            parser.add_argument(option.flag, choices=option.choices, **common)
        else:
            parser.add_argument(option.flag, metavar=option.placeholder,
                                action="append" if option.repeatable else "store", **common)


def _build(command: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = _Parser(
        prog="applier", formatter_class=_Formatter,
        description="PostgreSQL logical-replication replica applier: reads a pgoutput slot "
                    "(protocol 1-4) and applies each source transaction exactly once to a target "
                    "database.",
        epilog=f"{_SETTINGS}\n\n{exit_code_table()}")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="show applier's version and which implementation runs (the C "
                             "accelerators in use, or pure Python and why), then exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subs: dict[str, argparse.ArgumentParser] = {}
    for name, summary in COMMANDS.items():
        subs[name] = commands.add_parser(
            name, help=summary, description=summary, formatter_class=_Formatter,
            epilog=f"{_SETTINGS}\n\n{exit_code_summary(_CHECKS.get(name))}")
        if command is None or name == command:
            _add_options(subs[name], name)
    return parser, subs


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command``, only that command gets its options (argparse
    parses no other), which keeps the start of ``run`` short."""
    return _build(command)[0]


def _parse(arguments: Sequence[str], environ: Mapping[str, str] | None
           ) -> tuple[argparse.ArgumentParser, Settings]:
    """The chosen command's parser and settings; bad usage exits with that command's usage."""
    chosen = arguments[0] if arguments and arguments[0] in COMMANDS else None
    parser, subs = _build(chosen)
    # parse_args would report an unknown option of a command with the top-level usage.
    args, unknown = parser.parse_known_args(arguments)
    usage = subs[args.command]
    if unknown:
        usage.error(f"unrecognized arguments: {' '.join(unknown)}")
    cli_values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        return usage, load_settings(args.command, cli_values, args.config, environ)
    except ConfigError as exc:
        usage.error(str(exc))


def parse_settings(arguments: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """The settings ``applier ARGUMENTS`` would run with (``environ``: os.environ by default);
    exits with status 2 and the command's usage when they are bad, as ``main`` does."""
    return _parse(arguments, environ)[1]


def _runner(command: str) -> Callable[[Settings], int]:
    if command == "run":
        return _run
    module, name = _RUNNERS[command]
    runner: Callable[[Settings], int] = getattr(importlib.import_module(module), name)
    return runner


def _run(settings: Settings) -> int:
    """``applier run``: the replication stream is started before the worker is loaded, so that
    the source decodes while we import (headstart.py)."""
    with _start_up():  # psycopg, first of all
        from .headstart import start_early
    head_start = start_early(settings)
    with _start_up():
        from .worker import run
    return run(settings, head_start)


@contextmanager
def _start_up() -> Iterator[None]:
    """Start-up makes many objects that live as long as the process (modules, classes) and next
    to no garbage: the collector stays off while the command's modules are imported (a good part
    of the import time), and what they made is then frozen out of its generations, so neither
    later collections nor the one at exit (~0.2 s) walk it again."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    with _start_up():
        usage, settings = _parse(sys.argv[1:] if argv is None else list(argv), None)
        runner = _runner(settings.command)
    configure_logging(settings.log_level, settings.log_format)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # migration chatter is not news
    try:
        return int(runner(settings))
    except ConfigError as exc:
        usage.error(str(exc))
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
