"""``applier status``: the state of one slot and its replica, for people or scripts.

Owns the read-only queries that describe a slot on the source and the bookkeeping on the target
(also used by the metrics probe, so both report the same lag), and the status report: a table,
or JSON with ``--json``. Exit status (``ExitCode``): OK; FAILED when a server could not be read;
CHECK when the slot is missing or the lag exceeds ``--max-lag``. Must never write to either
database or touch the slot.

Bookkeeping tables that newer versions add (``applier.table_sync``, ``applier.conflicts``,
``applier.skipped_transactions``, ``applier.origins``) are read only when the target's catalog has them, so status
works on a target whatever version of the schema it carries.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from ..config import Settings, mask_dsn
from ..exit_codes import ExitCode
from ..progress.store import make_engine
from ..protocol.lsn import LSN
from .lag import Lag, measure_lag

__all__ = ["Progress", "SlotState", "StatusReport", "read_progress", "read_slot",
           "source_wal_position", "status", "collect_status", "StatusError"]

#: Two-phase GIDs the worker prepares on the target start with this prefix.
PREPARED_GID_PREFIX = "applier_"

#: Columns naming the kind of an event row in optional bookkeeping tables, most specific first.
_KIND_COLUMNS = ("conflict_type", "skip_reason", "kind", "type", "reason")


@dataclass
class SlotState:
    name: str
    plugin: str | None
    database: str | None
    active: bool
    active_pid: int | None
    two_phase: bool
    restart_lsn: LSN | None
    confirmed_flush_lsn: LSN | None
    wal_status: str | None


@dataclass
class Progress:
    """The last source transaction applied for a slot (``applier.progress``)."""

    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime | None
    applied_at: datetime | None


@dataclass
class StatusReport:
    slot_name: str
    source_database: str
    source_wal_lsn: LSN
    slot: SlotState | None
    retained_wal_bytes: int | None
    progress: Progress | None
    lag: Lag
    max_lag: str | None
    lag_exceeded: bool
    prepared_transactions: list[dict[str, Any]]
    table_sync: list[dict[str, Any]] | None
    conflicts: dict[str, int] | None
    skipped_transactions: dict[str, int] | None
    origins: list[dict[str, Any]] | None
    spill_dir: str
    spill_bytes: int | None
    notes: list[str] = field(default_factory=list)

    def exit_status(self) -> ExitCode:
        return ExitCode.CHECK if self.slot is None or self.lag_exceeded else ExitCode.OK

    def as_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


# -- queries shared with the metrics probe --------------------------------------------------------

def source_wal_position(conn: Connection) -> tuple[str, LSN]:
    """(database name, the source's current WAL position; replayed position on a standby)."""
    row = conn.execute(text(
        "SELECT pg_catalog.current_database(), CASE WHEN pg_catalog.pg_is_in_recovery() "
        "THEN pg_catalog.pg_last_wal_replay_lsn() ELSE pg_catalog.pg_current_wal_lsn() END::text")).one()
    return row[0], LSN.parse(row[1])


def read_slot(conn: Connection, slot: str) -> SlotState | None:
    two_phase = "two_phase" if conn.dialect.server_version_info >= (14,) else "false"
    row = conn.execute(text(
        f"SELECT slot_name, plugin, database, active, active_pid, {two_phase}, restart_lsn::text, "
        "confirmed_flush_lsn::text, wal_status FROM pg_catalog.pg_replication_slots "
        "WHERE slot_name = :slot"), {"slot": slot}).first()
    if row is None:
        return None
    return SlotState(row[0], row[1], row[2], bool(row[3]), row[4], bool(row[5]),
                     LSN.parse(row[6]) if row[6] else None, LSN.parse(row[7]) if row[7] else None,
                     row[8])


def bookkeeping_tables(conn: Connection) -> set[str]:
    """Names of the tables in the target's ``applier`` schema (empty before the first run)."""
    rows = conn.execute(text(
        "SELECT c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = 'applier' AND c.relkind IN ('r', 'p')"))
    return {row[0] for row in rows}


def read_progress(conn: Connection, slot: str, tables: set[str] | None = None) -> Progress | None:
    if "progress" not in (bookkeeping_tables(conn) if tables is None else tables):
        return None
    row = conn.execute(text(
        "SELECT commit_lsn::text, end_lsn::text, commit_time, applied_at FROM applier.progress "
        "WHERE slot_name = :slot"), {"slot": slot}).first()
    if row is None:
        return None
    return Progress(LSN.parse(row[0]), LSN.parse(row[1]), row[2], row[3])


def done_position(progress: Progress | None, confirmed: LSN | None) -> LSN:
    """Furthest position the replica has handled: applied, or confirmed as holding nothing."""
    return LSN(max(progress.end_lsn if progress else 0, confirmed or 0))


# -- the report ------------------------------------------------------------------------------------

def collect_status(settings: Settings) -> StatusReport:
    settings.require("source", "target", "slot")
    source_dsn, target_dsn, slot_name = settings.source, settings.target, settings.slot
    assert source_dsn and target_dsn and slot_name  # required just above
    limit = settings.max_lag
    with _reading("source", source_dsn) as source:
        database, wal_lsn = source_wal_position(source)
        slot = read_slot(source, slot_name)
    with _reading("target", target_dsn) as target:
        tables = bookkeeping_tables(target)
        progress = read_progress(target, slot_name, tables)
        prepared = _prepared_transactions(target, slot_name, tables)
        table_sync = _rows_for_slot(target, "table_sync", slot_name) if "table_sync" in tables else None
        conflicts = _count_by_kind(target, "conflicts", slot_name) if "conflicts" in tables else None
        skipped = (_count_by_kind(target, "skipped_transactions", slot_name)
                   if "skipped_transactions" in tables else None)
        origins = _rows_for_slot(target, "origins", slot_name) if "origins" in tables else None
    notes: list[str] = []
    if slot is None:
        notes.append(f"replication slot {slot_name!r} does not exist on the source")
    elif slot.database != database:
        notes.append(f"slot {slot_name!r} belongs to database {slot.database!r}, but the source "
                     f"DSN connects to {database!r}")
    if progress is None:
        notes.append("nothing applied yet for this slot on the target")
    lag = measure_lag(wal_lsn, done_position(progress, slot.confirmed_flush_lsn if slot else None),
                      progress.commit_time if progress else None, datetime.now(timezone.utc))
    from ..worker import default_spill_dir  # the worker owns where it spills
    spill_dir = settings.spill_dir or default_spill_dir(slot_name)
    return StatusReport(
        slot_name=slot_name, source_database=database, source_wal_lsn=wal_lsn, slot=slot,
        retained_wal_bytes=(max(0, int(wal_lsn) - int(slot.restart_lsn))
                            if slot and slot.restart_lsn is not None else None),
        progress=progress, lag=lag, max_lag=limit.text if limit else None,
        lag_exceeded=bool(limit and limit.exceeded_by(lag)), prepared_transactions=prepared,
        table_sync=table_sync, conflicts=conflicts, skipped_transactions=skipped, origins=origins,
        spill_dir=str(spill_dir), spill_bytes=_directory_bytes(spill_dir), notes=notes)


class StatusError(Exception):
    """A server could not be read; the message names which and why."""


@contextmanager
def _reading(side: str, dsn: str) -> Iterator[Connection]:
    try:
        with make_engine(dsn).connect() as conn:
            yield conn
    except DBAPIError as exc:
        reason = str(exc.orig).strip() if exc.orig is not None else str(exc)
        raise StatusError(f"cannot read the {side} ({mask_dsn(dsn)}): {mask_dsn(reason)}") from exc


def _prepared_transactions(conn: Connection, slot: str, tables: set[str]) -> list[dict[str, Any]]:
    """Source transactions pending between PREPARE and COMMIT/ROLLBACK PREPARED: prepared on the
    target (prepare mode) or held in the bookkeeping schema (defer mode)."""
    rows = conn.execute(text(
        "SELECT gid, prepared, owner FROM pg_catalog.pg_prepared_xacts "
        "WHERE database = pg_catalog.current_database() AND starts_with(gid, :prefix) "
        "ORDER BY prepared"), {"prefix": PREPARED_GID_PREFIX})
    pending = [{"gid": r[0], "prepared": r[1], "owner": r[2], "mode": "prepare"} for r in rows]
    if "prepared_transactions" in tables:
        deferred = conn.execute(text(
            "SELECT source_gid, prepare_time, prepare_lsn::text, changes "
            "FROM applier.prepared_transactions WHERE slot_name = :slot AND mode = 'defer' "
            "ORDER BY prepare_lsn"), {"slot": slot})
        pending += [{"gid": r[0], "prepared": r[1], "prepare_lsn": r[2], "changes": r[3],
                     "mode": "defer"} for r in deferred]
    return pending


def _columns(conn: Connection, table: str) -> list[str]:
    rows = conn.execute(text(
        "SELECT attname FROM pg_catalog.pg_attribute WHERE attrelid = "
        "pg_catalog.to_regclass(:name) AND attnum > 0 AND NOT attisdropped ORDER BY attnum"),
        {"name": f'"applier".{_quote(table)}'})
    return [r[0] for r in rows]


def _slot_filter(columns: list[str]) -> str:
    return " WHERE slot_name = :slot" if "slot_name" in columns else ""


def _rows_for_slot(conn: Connection, table: str, slot: str) -> list[dict[str, Any]]:
    columns = _columns(conn, table)
    rows = conn.execute(text(f'SELECT * FROM "applier".{_quote(table)}{_slot_filter(columns)}'),
                        {"slot": slot})
    return [dict(row._mapping) for row in rows]


def _count_by_kind(conn: Connection, table: str, slot: str) -> dict[str, int]:
    columns = _columns(conn, table)
    kind = next((c for c in _KIND_COLUMNS if c in columns), None)
    if kind is None:
        total = conn.execute(text(f'SELECT count(*) FROM "applier".{_quote(table)}'
                                  f'{_slot_filter(columns)}'), {"slot": slot}).scalar_one()
        return {"all": int(total)}
    rows = conn.execute(text(f'SELECT {_quote(kind)}::text, count(*) FROM "applier".{_quote(table)}'
                             f'{_slot_filter(columns)} GROUP BY 1 ORDER BY 1'), {"slot": slot})
    return {str(r[0]): int(r[1]) for r in rows}


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _directory_bytes(path: Path) -> int | None:
    """Total size of the files in ``path``; None when it does not exist on this machine."""
    if not path.is_dir():
        return None
    total = 0
    for entry in path.iterdir():
        try:
            if entry.is_file():
                total += entry.stat().st_size
        except FileNotFoundError:  # a transaction ended and removed its file meanwhile
            continue
    return total


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, LSN):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# -- rendering ------------------------------------------------------------------------------------

def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, factor in (("GB", 1024**3), ("MB", 1024**2), ("kB", 1024)):
        if n >= factor:
            return f"{n / factor:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def render_table(report: StatusReport) -> str:
    rows: list[tuple[str, str]] = []
    slot = report.slot
    if slot is None:
        rows.append(("slot", f"{report.slot_name} MISSING on the source"))
    else:
        state = f"active (walsender pid {slot.active_pid})" if slot.active else "inactive"
        rows += [("slot", f"{slot.name} ({slot.plugin}, database {slot.database}): {state}"),
                 ("two-phase slot", "yes" if slot.two_phase else "no"),
                 ("confirmed flush LSN", str(slot.confirmed_flush_lsn or "none")),
                 ("restart LSN", str(slot.restart_lsn or "none")),
                 ("WAL retained by slot", _size(report.retained_wal_bytes)),
                 ("WAL status", slot.wal_status or "unknown")]
    rows.append(("source WAL position", str(report.source_wal_lsn)))
    progress = report.progress
    if progress is None:
        rows.append(("last applied", "nothing yet"))
    else:
        rows += [("last applied commit LSN", f"{progress.commit_lsn} (end {progress.end_lsn})"),
                 ("last applied commit time", progress.commit_time.isoformat() if progress.commit_time else "unknown"),
                 ("applied at", progress.applied_at.isoformat() if progress.applied_at else "unknown")]
    seconds = "unknown" if report.lag.seconds is None else f"{report.lag.seconds:.1f} s"
    lag = f"{_size(report.lag.bytes)}, {seconds}"
    if report.max_lag:
        lag += f" ({'EXCEEDS' if report.lag_exceeded else 'within'} --max-lag {report.max_lag})"
    rows.append(("apply lag", lag))
    rows.append(("pending prepared transactions", str(len(report.prepared_transactions))
                 + "".join(f"\n  {p['gid']} ({p['mode']} mode) prepared {_jsonable(p['prepared'])}"
                           for p in report.prepared_transactions)))
    for label, counts in (("conflicts", report.conflicts),
                          ("skipped transactions", report.skipped_transactions)):
        if counts is not None:
            rows.append((label, ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"))
    if report.origins:
        rows.append(("origins", f"{len(report.origins)} origin(s)" + "".join(
            f"\n  '{row['origin_name']}': origin LSN {row['origin_lsn']}" for row in report.origins)))
    if report.table_sync is not None:
        rows.append(("table sync", f"{len(report.table_sync)} table(s)" + "".join(
            "\n  " + " ".join(f"{k}={_jsonable(v)}" for k, v in row.items() if k != "slot_name")
            for row in report.table_sync)))
    spill = ("no spill directory on this machine" if report.spill_bytes is None
             else _size(report.spill_bytes))
    rows.append(("spill", f"{spill} in {report.spill_dir}"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label.ljust(width)}  {value}" for label, value in rows]
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


def status(settings: Settings) -> int:
    """Entry point of ``applier status``."""
    try:
        report = collect_status(settings)
    except StatusError as exc:
        print(f"applier status: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    if settings.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(render_table(report))
    return report.exit_status()
