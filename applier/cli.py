"""Command line: sub-commands and their options. Wiring only; no logic beyond it.

Every option comes from ``config.OPTIONS`` so that the command line, the environment
(``APPLIER_*``), the config file and the documentation stay one list.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from . import __version__
from .config import ConfigError, Settings, load_settings, options_for
from .ops.logs import configure_logging

__all__ = ["main", "build_parser"]

log = logging.getLogger("applier")

COMMANDS: dict[str, str] = {
    "run": "Stream changes from a slot and apply them to the target, exactly once, in commit order.",
    "sync": "Copy every published table from a snapshot matching the slot (in parallel, resumable), "
            "then stream as run does.",
    "peek": "Print the decoded messages waiting in a slot as JSON lines, without consuming them.",
    "status": "Show a slot and its replica: slot state, WAL retained, last applied transaction, "
              "lag, prepared transactions, spill; exit non-zero when the slot is missing or lag "
              "exceeds --max-lag.",
    "verify": "Compare source and replica table by table: counts, per-range hashes, then exactly "
              "which keys differ.",
    "pipeline": "Example PySpark job: a consistent per-group aggregate of a replicated table to "
                "Parquet, tagged with the source LSN.",
    "demo": "Try it in one command: two throwaway servers, a workload, streaming, verification.",
    "skip": "Skip exactly one source transaction (a poison transaction that stops the worker), "
            "named by its finish LSN; crash-safe and recorded on the target.",
}

#: Commands with their own argument parsing: module, argument-adding function, runner.
_STANDALONE: dict[str, tuple[str, str, str]] = {
    "verify": ("applier.verify", "add_arguments", "run_verify"),
    "pipeline": ("applier.spark.pipeline", "add_arguments", "run_pipeline"),
    "demo": ("applier.demo", "add_arguments", "run_demo"),
}

_EPILOG = ("Every option can also be set in a TOML config file (--config, or APPLIER_CONFIG) and "
           "as an environment variable APPLIER_<NAME>; the command line beats the environment, "
           "which beats the file. See config/applier.example.toml.")


def _add_options(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file with any of these options "
                        "(keys as the long option names, with - or _).")
    for option in options_for(command):
        help_text = f"{option.help} [env {option.env}]"
        if option.default_text is not None and option.kind != "bool":
            help_text += f" (default: {option.default_text})"
        if option.kind == "bool":
            parser.add_argument(option.flag, dest=option.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        elif option.kind == "choice" and {"on", "off"} <= set(option.choices):
            # Once a boolean (--binary): the bare flag still means on, and --no-... off.
            parser.add_argument(option.flag, dest=option.name, choices=option.choices, default=None,
                                nargs="?", const="on", help=help_text)
            parser.add_argument("--no-" + option.flag[2:], dest=option.name, action="store_const",
                                const="off", help=argparse.SUPPRESS)
        elif option.kind == "choice":
            parser.add_argument(option.flag, dest=option.name, choices=option.choices, default=None,
                                help=help_text)
        elif option.repeatable:
            parser.add_argument(option.flag, dest=option.name, metavar=option.metavar or "VALUE",
                                action="append",
                                default=None, help=help_text)
        else:
            metavar = {"int": "N", "size": "SIZE", "list": "NAME[,NAME...]", "path": "DIR",
                       "lsn": "LSN"}.get(option.kind, "DSN" if option.secret else "NAME")
            parser.add_argument(option.flag, dest=option.name, metavar=metavar, default=None,
                                help=help_text)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command``, only that command gets its options (argparse
    parses no other): the standalone commands' modules (Spark, the demo's servers) are then
    not imported, which is a fifth of a second off every start of ``run``."""
    parser = argparse.ArgumentParser(
        prog="applier",
        description="PostgreSQL logical-replication replica applier: reads a pgoutput slot "
                    "(protocol 1-4) and applies each source transaction exactly once to a target "
                    "database.",
        epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"applier {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, summary in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary, epilog=_EPILOG)
        if command is not None and name != command:
            continue
        if name in _STANDALONE:
            module, add_arguments, _ = _STANDALONE[name]
            getattr(importlib.import_module(module), add_arguments)(sub)
            continue
        _add_options(sub, name)
    return parser


def _runner(command: str) -> Callable[[Settings], int]:
    if command == "run":
        return _run
    if command == "sync":
        from .sync.runner import run_sync
        return run_sync
    if command == "peek":
        from .peek import peek
        return peek
    if command == "skip":
        from .skip import run_skip
        return run_skip
    if command == "status":
        from .ops.status import status
        return status
    raise AssertionError(command)


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
        arguments = sys.argv[1:] if argv is None else list(argv)
        chosen = arguments[0] if arguments and arguments[0] in COMMANDS else None
        parser = build_parser(chosen)
        args = parser.parse_args(arguments)
        if args.command in _STANDALONE:
            module, _, name = _STANDALONE[args.command]
            standalone = getattr(importlib.import_module(module), name)
        else:
            runner = _runner(args.command)
    if args.command in _STANDALONE:
        configure_logging("WARNING")
        return int(standalone(args))
    cli_values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        settings = load_settings(args.command, cli_values, args.config)
    except ConfigError as exc:
        parser.exit(2, f"applier {args.command}: configuration error: {exc}\n")
    configure_logging(settings.log_level, settings.log_format)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # migration chatter is not news
    try:
        return runner(settings)
    except ConfigError as exc:
        parser.exit(2, f"applier {args.command}: configuration error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
