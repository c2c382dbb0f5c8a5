"""Settings: one typed, validated object per command (``Settings``), resolved from a config file,
the environment and the command line, where the command line beats the environment, which beats
the file, which beats the default; and masking secrets for logs. Callers read
``settings.<option>`` as it is. Must never open a connection or decide anything about replication.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..ops.lag import LagLimit
from ..protocol.lsn import LSN
from .option import ConfigError
from .options import OPTIONS, entry
from .values import parse_conflict_policies, parse_table_name

__all__ = ["Settings", "load_settings", "mask_dsn"]


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
    failover_slot: bool | None
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
    timeout: float
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
    standby: list[str]
    # -- verify and pipeline
    table: list[str]
    keep_target_columns: bool
    repair: bool
    engine: Literal["sql", "spark"]
    settle: float
    max_keys: int
    master: str | None
    jdbc_jar: Path | None
    group_by: str
    measure: str
    output: Path | None
    full: bool
    every: float | None
    rounds: int | None
    # -- a replica's last steps
    margin: int
    dry_run: bool
    verify: Literal["full", "counts", "off"]
    keep_bookkeeping: bool
    keep_change_feed: bool
    yes: bool
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
        missing = [entry(self.command, n) for n in names if getattr(self, n) in (None, [], "")]
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
        return {name: _masked(value) if value and entry(self.command, name).secret else value
                for name, value in self.values.items()}


def _masked(value: str | list[str]) -> str | list[str]:
    return [mask_dsn(item) for item in value] if isinstance(value, list) else mask_dsn(value)


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
        option = entry(command, name)
        # Converting the default too gives each Settings its own list to keep.
        value, origin = option.convert(option.default), "default"
        if command in option.commands:
            if name in file_values:
                value, origin = option.convert(file_values[name], f"{name} in {path}"), "file"
            if option.env in environ:
                value, origin = option.convert(environ[option.env], option.env), "env"
            if cli_values.get(name) is not None:
                value, origin = option.convert(cli_values[name], option.flag), "cli"
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
    for name in ("batch_time", "jobs"):
        if getattr(settings, name) < 1:
            raise ConfigError(f"{name} must be at least 1")
    if settings.batch_rows < 0:
        raise ConfigError("batch_rows must be at least 1, or 0 to turn fast apply off")
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
    if settings.repair and settings.engine != "sql":
        raise ConfigError("repair: --repair compares with the sql engine; leave out --engine spark")
    if settings.command == "pipeline" and len(settings.table) != 1:
        raise ConfigError(f"table: pipeline aggregates one table, not {len(settings.table)}")
    if settings.every is not None and settings.every <= 0:
        raise ConfigError("every must be a positive duration")
    if settings.rounds is not None and settings.rounds < 1:
        raise ConfigError("rounds must be at least 1")
    for name in ("settle", "seconds", "max_keys", "margin", "timeout", "limit"):
        if (getattr(settings, name) or 0) < 0:
            raise ConfigError(f"{name} must not be negative")
