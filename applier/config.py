"""Settings: one typed, validated object from a config file, the environment and the command line.

Owns the option table (``OPTIONS``: name, help, kind, default, choices, commands) that the command
line of every command, the ``APPLIER_*`` environment variables, the TOML config file and the
generated configuration reference are all built from; the ``Settings`` dataclass with one typed
field per option; and the rule that the command line beats the environment, which beats the file,
which beats the default. Defaults live here only: callers read ``settings.<option>`` as it is.
Also owns masking secrets for logs. Must never open a connection or decide anything about
replication.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .ops.lag import LagLimit, parse_lag_limit
from .protocol.lsn import LSN
from .units import format_duration, format_size, parse_duration, parse_size

__all__ = ["ConfigError", "Option", "OPTIONS", "Settings", "parse_size", "mask_dsn", "load_settings",
           "options_for", "CONFLICT_POLICIES", "parse_conflict_policies", "parse_table_name"]


class ConfigError(ValueError):
    """A bad option value, file or combination; the message says which and how to fix it."""


def _parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"invalid boolean {text!r}: use true or false")


def _parse_list(text: str | Sequence[str]) -> list[str]:
    items = text.split(",") if isinstance(text, str) else list(text)
    return [item.strip() for item in items if item.strip()]


def _parse_lag(value: str | int | LagLimit) -> LagLimit:
    return value if isinstance(value, LagLimit) else parse_lag_limit(str(value))


#: Command-line placeholders by kind; a plain string names its own (``Option.metavar``).
_PLACEHOLDERS = {"int": "N", "float": "N", "size": "SIZE", "list": "NAME[,NAME...]", "path": "DIR",
                 "lsn": "LSN", "lag": "SIZE|DURATION", "duration": "DURATION"}


@dataclass(frozen=True)
class Option:
    """One setting of one or more commands, as every front end sees it.

    A name may have several entries for disjoint sets of commands where its meaning or default
    differs by command (``--slot`` of ``verify`` is optional, of ``run`` required); they share
    one ``Settings`` field, so they must share ``kind``.
    """

    name: str                      # snake_case; --kebab-case on the command line; APPLIER_UPPER in env
    help: str                      # says what the default means when ``default`` cannot show it
    kind: str = "str"              # str | int | float | bool | size | list | choice | path | lsn | lag | duration
    default: Any = None            # the field's value as typed (64 * 1024**2, not "64MB")
    choices: tuple[str, ...] = ()  # for kind choice (and an int may have them too)
    commands: tuple[str, ...] = ("run", "sync")
    secret: bool = False           # DSNs: passwords are masked wherever the value is shown
    repeatable: bool = False       # list options given several times on the command line
    metavar: str | None = None     # command-line placeholder, when the kind's is unclear

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "APPLIER_" + self.name.upper()

    @property
    def placeholder(self) -> str | None:
        """What the command line shows for the value (None: a flag, or a choice of its own)."""
        if self.kind in ("bool", "choice") or self.choices:
            return None
        return self.metavar or _PLACEHOLDERS.get(self.kind) or ("DSN" if self.secret else None)

    @property
    def default_text(self) -> str | None:
        """The default as a person writes it (``64MB``, ``60s``, ``false``); None when there is
        none to show (the help then says what happens)."""
        value = self.default
        if value is None or value == []:
            return None
        if isinstance(value, bool):
            return "true" if value else "false"
        if self.kind == "size":
            return format_size(value)
        if self.kind == "duration":
            return format_duration(value)
        if isinstance(value, LagLimit):
            return value.text
        if isinstance(value, list):
            return ",".join(value)
        if isinstance(value, float):
            return f"{value:g}"  # 10, not 10.0
        return str(value)

    def _choice(self, raw: Any) -> str:
        # A choice of on/off (and more) also takes a boolean, as the option once was one.
        if "on" in self.choices and "off" in self.choices:
            try:
                return "on" if _parse_bool(raw) else "off"
            except ValueError:
                pass
        return str(raw)

    def convert(self, raw: Any) -> Any:
        """A value from the command line, the environment, the file or the default -> its type."""
        if raw is None:
            return None
        converters: dict[str, Callable[[Any], Any]] = {
            "str": str, "int": int, "float": float, "bool": _parse_bool, "size": parse_size,
            "list": _parse_list, "path": lambda v: Path(v).expanduser(), "choice": self._choice,
            "lsn": lambda v: LSN.parse(str(v)), "lag": _parse_lag, "duration": parse_duration,
        }
        try:
            value = converters[self.kind](raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.name}: {exc}") from None
        if self.choices and str(value) not in self.choices:
            raise ConfigError(f"{self.name}: {value!r} is not one of {', '.join(self.choices)}")
        return value


_REPLICATION = ("run", "sync", "peek")
#: Commands that print their own result: logging only adds warnings unless asked for more.
_REPORTING = ("verify", "pipeline", "demo")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_SPARK = "For verify --engine spark and pipeline: "

OPTIONS: tuple[Option, ...] = (
    Option("source", "libpq connection string or URL of the source (publisher) database. TLS and "
           "other libpq options pass through. Required (optional for skip, which then checks "
           "the slot on the target only).", secret=True,
           commands=_REPLICATION + ("status", "verify", "skip")),
    Option("target", "libpq connection string or URL of the target (replica) database. Required.",
           secret=True, commands=("run", "sync", "status", "skip", "verify", "pipeline")),
    Option("slot", "Logical replication slot on the source: the one run and sync consume, peek "
           "reads without consuming, status and skip report on. Required.", metavar="NAME",
           commands=_REPLICATION + ("status", "skip")),
    Option("slot", "Report the position on the target of this slot only. Default: every slot's.",
           metavar="NAME", commands=("verify",)),
    Option("slot", "Slot whose applied position on the target tags the result. Default: the only "
           "one the target has.", metavar="NAME", commands=("pipeline",)),
    Option("publication", "Publication name(s) on the source, comma separated: what run, sync "
           "and peek receive, whose tables verify compares. Required.", kind="list", default=[],
           commands=_REPLICATION + ("verify",)),
    Option("create_slot", "Create the slot (pgoutput plugin) when it does not exist.", kind="bool",
           default=False, commands=("run",)),
    Option("proto_version", "pgoutput protocol version 1-4. Default: the highest the source "
           "supports (15: 3, 16+: 4).", kind="int", commands=_REPLICATION),
    Option("streaming", "Stream large in-progress transactions: off, on, or parallel (protocol 4, "
           "adds abort LSNs). Default: parallel on protocol 4, on for 2-3, off for 1.",
           kind="choice", choices=("off", "on", "parallel"), commands=_REPLICATION),
    Option("two_phase", "Decode prepared transactions at PREPARE time (protocol 3+). Default: "
           "on when the slot was created with two_phase.", kind="bool", commands=_REPLICATION),
    Option("binary", "Column values in binary (PostgreSQL 14+ source), which is cheaper to "
           "produce and to load than text. on: always (source and target types must then match "
           "exactly). auto: binary while every replicated column has the same built-in type on "
           "both sides; the first relation that does not restarts the session in text, for the "
           "rest of the process. off: text. A bare --binary means on. peek shows text unless on.",
           kind="choice", choices=("auto", "on", "off"), default="auto", commands=_REPLICATION),
    Option("messages", "Receive pg_logical_emit_message messages.", kind="bool", default=False,
           commands=_REPLICATION),
    Option("origin", "Publisher-side origin filter (PostgreSQL 16+): 'none' sends only changes "
           "that originated on the source itself, 'any' sends everything. Default: no filter "
           "(as any).", kind="choice", choices=("any", "none"), commands=_REPLICATION),
    Option("two_phase_mode", "How prepared source transactions are applied when two-phase "
           "decoding is on. prepare: applied and PREPAREd on the target at once, committed or "
           "rolled back when the source does. defer: held durably in the applier schema and "
           "applied only at COMMIT PREPARED. auto: prepare when the target has "
           "max_prepared_transactions > 0, else defer.", kind="choice",
           choices=("auto", "prepare", "defer"), default="auto"),
    Option("skip_origin", "Drop source transactions that came from this replication origin (the "
           "name in their Origin message); repeatable. With two workers replicating in opposite "
           "directions, give each the other's --replication-origin to stop loops on PostgreSQL "
           "15 (16+ can use --origin none instead). Default: drop none.", kind="list",
           default=[], repeatable=True, metavar="NAME"),
    Option("replication_origin", "Replication origin that tags the worker's writes on the target, "
           "so a replication out of the target with origin=none (or --skip-origin) ignores them. "
           "Default: applier_<slot>_<target database>; 'none' leaves the writes untagged. Needs "
           "superuser or EXECUTE on pg_replication_origin_create/_session_setup; without them "
           "the worker logs it once and runs untagged.", metavar="NAME"),
    Option("message_sink", "Where --messages delivers pg_logical_emit_message payloads: 'table' "
           "(applier.messages on the target; transactional ones in their own transaction) or "
           "'log'.", kind="choice", choices=("table", "log"), default="table"),
    Option("message_prefix", "Deliver only logical messages whose prefix matches this pattern "
           "(shell-style: * and ? wildcards); repeatable. Default: every message.", kind="list",
           default=[], repeatable=True, metavar="PATTERN"),
    Option("conflict_policy", "What to do on an apply conflict: apply (the source wins: upsert, "
           "or skip a change whose row is missing), error (stop the worker), keep-local (the "
           "target row wins). POLICY sets the default, SCHEMA.TABLE=POLICY one table; "
           "repeatable. Default: apply.", kind="list", default=[], repeatable=True,
           metavar="[SCHEMA.TABLE=]POLICY"),
    Option("skip_lsn", "Skip the one source transaction that finishes (commits or prepares) at "
           "this LSN, as 'applier skip --lsn' does; recorded in applier.skipped_transactions. "
           "Default: skip nothing.", kind="lsn"),
    Option("lsn", "Finish LSN (commit or prepare LSN) of the source transaction to skip, as the "
           "worker's error message names it. Required.", kind="lsn", commands=("skip",)),
    Option("sql", "Peek over the SQL interface (pg_logical_slot_peek_binary_changes) instead of "
           "the replication protocol.", kind="bool", default=False, commands=("peek",)),
    Option("limit", "Stop after printing this many messages. Default: no limit.", kind="int",
           commands=("peek",)),
    Option("timeout", "Stop after this many seconds without a new message.", kind="int",
           default=5, metavar="SECONDS", commands=("peek",)),
    Option("memory_budget", "Memory for open streamed transactions, over all of them; the rest "
           "spills to --spill-dir. What run receives ahead while it starts (at most a quarter) "
           "counts against it. Units kB, MB, GB.", kind="size", default=64 * 1024**2),
    Option("streamed_apply", "When a streamed (large, still running) source transaction is "
           "applied. early: as it streams, in a second target session, committed at its Stream "
           "Commit (one such transaction at a time; one that holds a logical message or an "
           "Origin, meets a conflict or a lock wait of over 5 s, or ends in a Stream Prepare is "
           "applied at its commit instead, the source sending it again). commit: buffered "
           "(spilled beyond --memory-budget) and applied at its commit.",
           kind="choice", choices=("early", "commit"), default="early"),
    Option("schema_changes", "What a source table's changed columns do to the target. follow: "
           "a column the target lacks is added (nullable, no default; a type that is not built "
           "in must exist on the target by the same name), a column whose source type now holds "
           "more is widened along a safe list (smallint, integer, bigint; real, double "
           "precision; a longer varchar or text; a wider numeric), a column gone from the source "
           "stays and loses its NOT NULL when it has no default; each change in the target "
           "transaction of the first row change that needs it, recorded in "
           "applier.schema_changes. Any other type change stops the worker. error: the worker "
           "stops at a missing column, as PostgreSQL's subscriber does.",
           kind="choice", choices=("follow", "error"), default="follow"),
    Option("change_feed", "Record every row change applied to these tables, in the same target "
           "transaction, in a change table of each (schema applier_changes, partitioned by "
           "source commit LSN): the row, the operation (insert, update, delete; truncate as a "
           "marker), the source commit LSN, commit time, xid and the change's order in its "
           "transaction. 'all': every published table; else SCHEMA.TABLE names, comma separated. "
           "Spark reads it with applier.spark.read_changes. Default: off.", kind="list",
           default=[], metavar="all|TABLE[,TABLE...]"),
    Option("change_feed_retention", "How long the change feed keeps history: partitions whose "
           "changes are all older than this are dropped in the background (never while a reader "
           "holds a snapshot of the change tables). Units s, min, h, d.", kind="duration",
           default=7 * 86400.0),
    Option("spill_dir", "Directory for spill files of streamed transactions over the memory "
           "budget. Default: a directory per slot under the system temp directory.", kind="path",
           commands=("run", "sync", "status")),
    Option("batch_rows", "Fast apply: row changes (of one or more consecutive source transactions) "
           "per target transaction before it commits; also the most rows held in memory.",
           kind="int", default=20000),
    Option("batch_bytes", "Fast apply: bytes of row data per target transaction before it commits "
           "(at most half of --memory-budget is used: the batch counts against the budget too). "
           "Units kB, MB, GB.", kind="size", default=8 * 1024**2),
    Option("batch_time", "Fast apply: milliseconds a target transaction may stay open collecting "
           "source transactions (it also commits whenever the stream is idle).", kind="int",
           default=500, metavar="MS"),
    Option("batch_wait", "Fast apply: milliseconds a batch may wait, when the stream pauses, for "
           "more source transactions to join it before it commits. 0 commits at every pause (the "
           "least lag); a few let batches grow with the load, so the target commits and flushes "
           "less often: less CPU per transaction for a little more lag.", kind="int", default=2,
           metavar="MS"),
    Option("synchronous_commit", "synchronous_commit of the target session. 'off' is safe here: the "
           "slot is only told positions whose target commits the target has flushed to disk.",
           kind="choice", choices=("on", "off"), default="off"),
    Option("exit_when_caught_up", "Exit 0 once everything the source committed before start-up "
           "is applied and confirmed, instead of running until SIGTERM/SIGINT.", kind="bool",
           default=False),
    Option("status_interval", "Seconds between standby status updates to the source (at most 10).",
           kind="int", default=10, metavar="SECONDS"),
    Option("jobs", "Copy sessions run in parallel by applier sync: several tables at once, and "
           "the block ranges of large tables.", kind="int", default=4, commands=("sync",)),
    Option("range_size", "applier sync cuts plain tables larger than this (on-disk size) into "
           "block ranges of this size, copied in parallel from the same snapshot. A table copied "
           "whole has its indexes built after its data instead. Units kB, MB, GB.",
           kind="size", default=1024**3, commands=("sync",)),
    Option("create_tables", "Create missing target tables from the source definitions "
           "(published columns, types, NOT NULL, portable defaults, primary key and replica "
           "identity index), building other indexes after the data is in: every table applier "
           "sync copies, and a table added to a publication while run runs.", kind="bool",
           default=False, commands=("sync", "run")),
    Option("truncate_target", "applier sync empties target tables that are not empty before "
           "copying into them, instead of refusing to start.", kind="bool", default=False,
           commands=("sync",)),
    Option("progress_interval", "Seconds between progress log lines: what run (and sync once it "
           "streams) applied meanwhile, while it has work; and the copy of applier sync when "
           "stderr is not a terminal (a terminal gets a live display).", kind="int", default=10,
           metavar="SECONDS", commands=("run", "sync")),
    Option("log_level", "Logging level: DEBUG, INFO, WARNING, ERROR.", default="INFO",
           kind="choice", choices=_LOG_LEVELS, commands=("run", "sync", "peek", "status", "skip")),
    Option("log_level", "Logging level: DEBUG, INFO, WARNING, ERROR (this command prints its "
           "result itself; logging adds warnings).", default="WARNING", kind="choice",
           choices=_LOG_LEVELS, commands=_REPORTING),
    # -- operations (applier/ops) -----------------------------------------------------------------
    Option("log_format", "Log line format: text (for people) or json (one object per line with "
           "slot, lsn and xid fields).", default="text", kind="choice", choices=("text", "json"),
           commands=("run", "sync", "peek", "status", "skip") + _REPORTING),
    Option("metrics_port", "Serve Prometheus metrics on this TCP port at /metrics, with /healthz "
           "(live) and /readyz (streaming and within --ready-max-lag). Default: no server.",
           kind="int", metavar="PORT"),
    Option("metrics_address", "Address the metrics server listens on.", default="0.0.0.0",
           metavar="ADDRESS"),
    Option("ready_max_lag", "/readyz fails while the apply lag exceeds this: a size of WAL "
           "(e.g. 64MB) or a duration (e.g. 30s, 5min).", kind="lag",
           default=parse_lag_limit("60s")),
    Option("json", "Print the result as JSON instead of a table.", kind="bool", default=False,
           commands=("status", "verify")),
    Option("max_lag", "Exit with status 3 when the apply lag exceeds this: a size of WAL (e.g. "
           "64MB) or a duration (e.g. 30s, 5min). Default: no limit.", kind="lag",
           commands=("status",)),
    # -- verify and pipeline (applier/verify/, applier/spark) -------------------------------------
    Option("table", "Compare only this published table (schema.table or table); repeatable. "
           "Default: every table of the publications.", kind="list", default=[], repeatable=True,
           metavar="TABLE", commands=("verify",)),
    Option("table", "Replicated table to aggregate (schema.table or table).", kind="list",
           default=["orders"], metavar="TABLE", commands=("pipeline",)),
    Option("engine", "sql: compare inside the databases; spark: with PySpark, for tables too "
           "large for one machine.", kind="choice", choices=("sql", "spark"), default="sql",
           commands=("verify",)),
    Option("settle", "Compare differing tables again for up to this many seconds, so that "
           "changes still in flight to a live replica are not reported; 0: compare once.",
           kind="float", default=10.0, metavar="SECONDS", commands=("verify",)),
    Option("max_keys", "List at most N keys per table and kind of difference (missing, extra, "
           "changed).", kind="int", default=100, commands=("verify",)),
    Option("master", _SPARK + "Spark master URL. Default: local[*] (this machine, every core).",
           metavar="URL", commands=("verify", "pipeline")),
    Option("jdbc_jar", _SPARK + "PostgreSQL JDBC driver jar. Default: Debian's "
           "libpostgresql-jdbc-java, else the newest in the local Maven repository (~/.m2).",
           kind="path", metavar="PATH", commands=("verify", "pipeline")),
    Option("group_by", "Column to group by.", default="customer_id", metavar="COLUMN",
           commands=("pipeline",)),
    Option("measure", "Numeric column to sum per group.", default="total", metavar="COLUMN",
           commands=("pipeline",)),
    Option("output", "Directory of the Parquet result and its state file. Required.", kind="path",
           commands=("pipeline",)),
    Option("full", "Recompute everything even if an incremental run is possible.", kind="bool",
           default=False, commands=("pipeline",)),
    # -- demo (applier/demo.py) ---------------------------------------------------------------------
    Option("pg_version", "PostgreSQL major version of both throwaway servers.", kind="int",
           default=18, choices=("15", "18"), commands=("demo",)),
    Option("seconds", "How long the live workload writes while the worker streams.", kind="float",
           default=15.0, metavar="SECONDS", commands=("demo",)),
    Option("keep", "Leave both servers running at the end and print their connection strings.",
           kind="bool", default=False, commands=("demo",)),
)


def options_for(command: str) -> tuple[Option, ...]:
    """The options ``command`` takes, one entry per name."""
    return tuple(option for option in OPTIONS if command in option.commands)


@dataclass(frozen=True)
class Settings:
    """Resolved settings for one command: a typed field per option name.

    Every field is set, also for options the command does not take (to their first entry's
    default), so ``sync`` can go on as ``run``. ``sources`` says where each of the command's own
    options came from: 'default', 'file', 'env' or 'cli'.
    """

    command: str
    # -- replication (run, sync, peek) and where it reads and writes
    source: str | None
    target: str | None
    slot: str | None
    publication: list[str]
    create_slot: bool
    proto_version: int | None
    streaming: Literal["off", "on", "parallel"] | None
    two_phase: bool | None
    binary: Literal["auto", "on", "off"]
    messages: bool
    origin: Literal["any", "none"] | None
    two_phase_mode: Literal["auto", "prepare", "defer"]
    skip_origin: list[str]
    replication_origin: str | None
    message_sink: Literal["table", "log"]
    message_prefix: list[str]
    conflict_policy: list[str]
    skip_lsn: LSN | None
    lsn: LSN | None
    sql: bool
    limit: int | None
    timeout: int
    memory_budget: int
    streamed_apply: Literal["early", "commit"]
    schema_changes: Literal["follow", "error"]
    change_feed: list[str]
    change_feed_retention: float
    spill_dir: Path | None
    batch_rows: int
    batch_bytes: int
    batch_time: int
    batch_wait: int
    synchronous_commit: Literal["on", "off"]
    exit_when_caught_up: bool
    status_interval: int
    # -- sync
    jobs: int
    range_size: int
    create_tables: bool
    truncate_target: bool
    progress_interval: int
    # -- operations
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"]
    log_format: Literal["text", "json"]
    metrics_port: int | None
    metrics_address: str
    ready_max_lag: LagLimit
    json: bool
    max_lag: LagLimit | None
    # -- verify and pipeline
    table: list[str]
    engine: Literal["sql", "spark"]
    settle: float
    max_keys: int
    master: str | None
    jdbc_jar: Path | None
    group_by: str
    measure: str
    output: Path | None
    full: bool
    # -- demo
    pg_version: int
    seconds: float
    keep: bool
    # -- provenance
    sources: Mapping[str, str]

    @property
    def values(self) -> dict[str, Any]:
        """The command's own options and their values (a fresh dict: changing it changes nothing)."""
        return {name: getattr(self, name) for name in self.sources}

    def require(self, *names: str) -> None:
        missing = [_entry(self.command, n) for n in names if getattr(self, n) in (None, [], "")]
        if missing:
            listed = ", ".join(f"{o.flag} (or {o.env}, or '{o.name}' in the config file)" for o in missing)
            raise ConfigError(f"missing required setting(s): {listed}")

    def required(self, name: str) -> str:
        """A text setting the command cannot run without (a DSN, the slot): its value, or the
        same ``ConfigError`` as ``require``. Typed ``str``, where the field is ``str | None``."""
        self.require(name)
        value = getattr(self, name)
        assert isinstance(value, str)
        return value

    def describe(self) -> dict[str, Any]:
        """The command's settings as they may be logged: DSN passwords masked."""
        return {name: mask_dsn(value) if value and _entry(self.command, name).secret else value
                for name, value in self.values.items()}


def _entry(command: str, name: str) -> Option:
    """The entry of option ``name`` for ``command``, else its first entry."""
    entries = [option for option in OPTIONS if option.name == name]
    return next((option for option in entries if command in option.commands), entries[0])


# Neither part may span whitespace or a slash, so a password inside a longer log line is masked
# without swallowing the text around it (URLs percent-encode those characters anyway).
_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)([^@\s/]*)(@)")
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def mask_dsn(dsn: str) -> str:
    """Hide the password in a libpq URL or key/value connection string."""
    masked = _URL_PASSWORD.sub(r"\1****\3", str(dsn))
    return _KV_PASSWORD.sub(r"\1****", masked)


def load_settings(command: str, cli_values: Mapping[str, Any], config_file: Path | None = None,
                  environ: Mapping[str, str] | None = None) -> Settings:
    """Resolve the options of ``command``: defaults < config file < environment < command line.

    ``cli_values`` holds only what was given on the command line (None means not given).
    Raises ConfigError for a bad file, value or combination.
    """
    environ = os.environ if environ is None else environ
    file_values: dict[str, Any] = {}
    path = config_file or (Path(environ["APPLIER_CONFIG"]) if environ.get("APPLIER_CONFIG") else None)
    if path is not None:
        file_values = _read_config_file(path)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in dict.fromkeys(option.name for option in OPTIONS):
        option = _entry(command, name)
        # Converting the default too gives each Settings its own list to keep.
        value, origin = option.convert(option.default), "default"
        if command in option.commands:
            if name in file_values:
                value, origin = option.convert(file_values[name]), "file"
            if option.env in environ:
                value, origin = option.convert(environ[option.env]), "env"
            if cli_values.get(name) is not None:
                value, origin = option.convert(cli_values[name]), "cli"
            sources[name] = origin
        values[name] = value
    settings = Settings(command=command, sources=sources, **values)
    _validate(settings)
    return settings


def _read_config_file(path: Path) -> dict[str, Any]:
    import tomllib  # only with a config file: importing it compiles regexes (~20 ms)
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values = {key.replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(values) - {option.name for option in OPTIONS})
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(unknown)}; "
                          "see config/applier.example.toml for the valid names")
    return values


def _validate(settings: Settings) -> None:
    """Combinations and ranges; only options the command takes are checked (others hold their
    defaults, which are valid)."""
    version = settings.proto_version
    if version is not None and not 1 <= version <= 4:
        raise ConfigError(f"proto_version: {version} is not a pgoutput protocol version (1-4)")
    streaming = settings.streaming
    if version is not None and streaming not in (None, "off") and version < 2:
        raise ConfigError("streaming needs protocol version 2 or later; use --proto-version 2+ "
                          "or --streaming off")
    if version is not None and streaming == "parallel" and version < 4:
        raise ConfigError("streaming=parallel needs protocol version 4 (PostgreSQL 16+)")
    if version is not None and settings.two_phase and version < 3:
        raise ConfigError("two_phase needs protocol version 3 or later (PostgreSQL 15+)")
    if not 1 <= settings.status_interval <= 10:
        raise ConfigError("status_interval must be between 1 and 10 seconds")
    for name in ("batch_rows", "batch_time", "jobs"):
        if getattr(settings, name) < 1:
            raise ConfigError(f"{name} must be at least 1")
    if not 0 <= settings.batch_wait <= settings.batch_time:
        raise ConfigError(f"batch_wait must be between 0 and batch_time ({settings.batch_time} ms)")
    if settings.range_size < 8192:
        raise ConfigError("range_size must be at least one block (8kB)")
    if settings.progress_interval < 1:
        raise ConfigError("progress_interval must be at least 1 second")
    if settings.memory_budget < 64 * 1024:
        raise ConfigError("memory_budget must be at least 64kB")
    if settings.change_feed_retention < 1:
        raise ConfigError("change_feed_retention must be at least 1s")
    if "all" in settings.change_feed and len(settings.change_feed) > 1:
        raise ConfigError("change_feed: 'all' already names every published table; give it alone")
    for name in settings.change_feed:
        if name != "all":
            parse_table_name(name, "change_feed")
    if settings.conflict_policy:
        parse_conflict_policies(settings.conflict_policy)
    if settings.command == "pipeline" and len(settings.table) != 1:
        raise ConfigError(f"table: pipeline aggregates one table, not {len(settings.table)}")
    for name in ("settle", "seconds", "max_keys"):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{name} must not be negative")


#: Conflict policies (--conflict-policy): the source wins, stop, or the target row wins.
CONFLICT_POLICIES = ("apply", "error", "keep-local")


def parse_table_name(text: str, option: str = "conflict_policy") -> tuple[str, str]:
    """``schema.table`` (either part may be double-quoted) or ``table`` (schema public)."""
    parts: list[str] = []
    current: list[str] = []
    i, quoted = 0, False
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == '"' and text[i + 1:i + 2] == '"':
                current.append('"')
                i += 1
            elif ch == '"':
                quoted = False
            else:
                current.append(ch)
        elif ch == '"':
            quoted = True
        elif ch == ".":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch.lower())
        i += 1
    parts.append("".join(current))
    if quoted or not 1 <= len(parts) <= 2 or not all(parts):
        raise ConfigError(f"{option}: {text!r} is not a table name (schema.table or table)")
    return ("public", parts[0]) if len(parts) == 1 else (parts[0], parts[1])


def parse_conflict_policies(entries: Sequence[str]) -> tuple[str, dict[tuple[str, str], str]]:
    """``["error", "app.orders=keep-local"]`` -> (default policy, {(schema, table): policy})."""
    default = "apply"
    per_table: dict[tuple[str, str], str] = {}
    for entry in entries:
        table, sep, policy = entry.rpartition("=")
        policy = policy.strip().lower()
        if policy not in CONFLICT_POLICIES:
            raise ConfigError(f"conflict_policy: {policy!r} in {entry!r} is not one of "
                              f"{', '.join(CONFLICT_POLICIES)}")
        if sep:
            per_table[parse_table_name(table.strip())] = policy
        else:
            default = policy
    return default, per_table


def example_config() -> str:
    """The fully commented example config file (config/applier.example.toml is this text)."""
    lines = ["# applier configuration file (TOML). Every key is optional here and may instead come",
             "# from the command line (--kebab-case) or the environment (APPLIER_UPPER_CASE);",
             "# the command line beats the environment, which beats this file.",
             "# Generated from applier/config.py; a test checks that it is current.", ""]
    for option in OPTIONS:
        lines.extend("# " + line for line in textwrap.wrap(option.help, 94))
        lines.append(f"# commands: {', '.join(option.commands)}; environment: {option.env}")
        lines.append(f"# {option.name} = {_toml_example(option)}")
        lines.append("")
    return "\n".join(lines)


#: Example values for options whose default shows nothing useful.
_SAMPLES: dict[str, Any] = {
    "source": "host=source.example port=5432 dbname=app user=replicator sslmode=verify-full",
    "target": "postgresql://applier@replica.example:5432/app?sslmode=verify-full",
    "slot": "applier_app", "publication": ["app_pub"], "spill_dir": "/var/lib/applier/spill",
    "skip_lsn": "16/B374D848", "lsn": "16/B374D848", "metrics_port": 9188, "max_lag": "64MB",
    "master": "spark://spark.example:7077", "jdbc_jar": "/usr/share/java/postgresql.jar",
    "output": "/var/lib/applier/pipeline", "change_feed": ["public.orders", "public.customers"],
}
_KIND_SAMPLES: dict[str, Any] = {"bool": True, "int": 4, "str": ""}


def _toml_example(option: Option) -> str:
    value = _SAMPLES.get(option.name, option.default)
    if value is None:
        value = option.choices[0] if option.choices else _KIND_SAMPLES[option.kind]
    if option.kind == "size" and isinstance(value, int):
        value = format_size(value)
    elif option.kind == "duration" and isinstance(value, float):
        value = format_duration(value)
    elif isinstance(value, (LagLimit, Path)):
        value = str(value.text if isinstance(value, LagLimit) else value)
    return json.dumps(value)  # the JSON of a string, number, boolean or list is TOML too
