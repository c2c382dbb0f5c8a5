"""``applier status``: the state of one slot and its replica, for people or scripts.

Owns the read-only queries that describe a slot on the source and the bookkeeping on the target
(also used by the metrics probe, so both report the same lag), and the status report: a table,
or JSON with ``--json``; the failover part (the slot's failover flag, the source's
synchronized_standby_slots, each ``--standby``'s settings and copy of the slot) comes from
``failover``. Exit status (``ExitCode``): OK; FAILED when the source or the target could not be
read; CHECK when the slot is missing, the lag exceeds ``--max-lag``, or a ``--standby`` could not
take over the replica. Must never write to any database or touch the slot.

Bookkeeping tables that newer versions add (``applier.table_sync``, ``applier.conflicts``,
``applier.skipped_transactions``, ``applier.origins``, ``applier.change_tables``,
``applier.repairs``) are read only when the target's catalog has them, so status works on a
target whatever version of the schema it carries. Whether a worker or a sync of the slot runs is
read from its lock on the target, so a table whose copy stopped unfinished is told from one
being copied. Resyncs and repairs are shown newest first. The change feed is shown per table:
the LSN range it retains, its partitions, a row estimate and its size.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..assembler.buffer import default_spill_dir
from ..config import Settings, mask_dsn
from ..exit_codes import ExitCode
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.feed_registry import FeedRegistry
from ..progress.lock import LockHolder, lock_holder
from ..progress.records import Progress
from ..progress.repairs import Repairs
from ..progress.schema import make_engine
from ..protocol.lsn import LSN
from ..queries import rows
from ..source.slots import SlotInfo, slot_info
from ..units import readable_size
from .failover import (
    FailoverReport,
    StandbyFacts,
    assess,
    read_primary,
    read_standby,
    render_failover,
    standby_label,
)
from .lag import Lag, measure_lag

if TYPE_CHECKING:
    from sqlalchemy import Connection

__all__ = ["StatusReport", "source_wal_position", "done_position", "status", "collect_status",
           "StatusError"]

#: Two-phase GIDs the worker prepares on the target start with this prefix.
PREPARED_GID_PREFIX = "applier_"


@dataclass
class StatusReport:
    slot_name: str
    source_database: str
    source_wal_lsn: LSN
    slot: SlotInfo | None
    retained_wal_bytes: int | None
    progress: Progress | None
    lag: Lag | None  # None without a slot: nothing measures how far it is behind
    max_lag: str | None
    lag_exceeded: bool
    prepared_transactions: list[dict[str, Any]]
    table_sync: list[dict[str, Any]] | None
    conflicts: dict[str, int] | None
    skipped_transactions: dict[str, int] | None
    origins: list[dict[str, Any]] | None
    schema_changes: list[dict[str, Any]]
    publication_tables: list[dict[str, Any]]
    change_feed: list[dict[str, Any]] | None
    #: The target session holding the slot's lock (a worker or a sync of the slot runs), if any.
    running: LockHolder | None
    repairs: list[dict[str, Any]]
    spill_dir: str
    spill_bytes: int | None
    failover: FailoverReport | None = None
    notes: list[str] = field(default_factory=list)

    def exit_status(self) -> ExitCode:
        standbys_unready = self.failover is not None and not self.failover.ready
        return (ExitCode.CHECK if self.slot is None or self.lag_exceeded or standbys_unready
                else ExitCode.OK)

    def as_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


# -- queries shared with the metrics probe --------------------------------------------------------

def source_wal_position(conn: Any) -> tuple[str, LSN]:
    """(database name, the source's current WAL position; replayed position on a standby)."""
    row = rows(conn, "SELECT pg_catalog.current_database(), CASE WHEN pg_catalog.pg_is_in_recovery() "
                     "THEN pg_catalog.pg_last_wal_replay_lsn() ELSE pg_catalog.pg_current_wal_lsn() "
                     "END::text")[0]
    return row[0], LSN.parse(row[1])


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
        slot = slot_info(source, slot_name)
        primary = read_primary(source)
    standbys: list[tuple[str, StandbyFacts | str]] = []
    for standby_dsn in settings.standby:
        label = standby_label(standby_dsn)
        try:
            with _reading(f"standby {label}", standby_dsn) as standby:
                standbys.append((label, read_standby(standby, slot_name)))
        except StatusError as exc:
            standbys.append((label, str(exc)))
    failover = assess(slot_name, slot, primary, wal_lsn, standbys)
    with _reading("target", target_dsn) as target:
        store = SqlBookkeeping(target)
        tables = store.tables()
        progress = store.progress(slot_name) if "progress" in tables else None
        prepared = [_with_lsns(p) for p in _prepared_on_target(target)
                    + store.deferred_prepared(slot_name)]
        table_sync = ([_with_lsns(row) for row in store.rows("table_sync", slot_name)]
                      if "table_sync" in tables else None)
        conflicts = store.count_by_kind("conflicts", slot_name) if "conflicts" in tables else None
        skipped = (store.count_by_kind("skipped_transactions", slot_name)
                   if "skipped_transactions" in tables else None)
        origins = ([_with_lsns(row) for row in store.rows("origins", slot_name)]
                   if "origins" in tables else None)
        schema_changes = [_with_lsns(row) for row in store.schema_changes(slot_name)]
        publication_tables = [{"schema_name": schema, "table_name": table, "state": state}
                              for (schema, table), state in
                              sorted(store.publication_tables(slot_name).items())]
        change_feed = ([asdict(row) for row in FeedRegistry(target).status(slot_name)]
                       if "change_tables" in tables else None)
        running = lock_holder(target, slot_name)
        repairs = [_with_lsns(row) for row in Repairs(target).latest(slot_name)]
    notes: list[str] = list(failover.warnings)
    if slot is None:
        notes.append(f"replication slot {slot_name!r} does not exist on the source")
    elif slot.database != database:
        notes.append(f"slot {slot_name!r} belongs to database {slot.database!r}, but the source "
                     f"DSN connects to {database!r}")
    if progress is None:
        notes.append("nothing applied yet for this slot on the target")
    lag = None if slot is None else measure_lag(
        wal_lsn, done_position(progress, slot.confirmed_flush_lsn),
        progress.commit_time if progress else None, datetime.now(UTC))
    spill_dir = settings.spill_dir or default_spill_dir(slot_name, settings.required("target"))
    return StatusReport(
        slot_name=slot_name, source_database=database, source_wal_lsn=wal_lsn, slot=slot,
        retained_wal_bytes=(max(0, int(wal_lsn) - int(slot.restart_lsn))
                            if slot and slot.restart_lsn is not None else None),
        progress=progress, lag=lag, max_lag=limit.text if limit else None,
        lag_exceeded=bool(limit and lag and limit.exceeded_by(lag)), prepared_transactions=prepared,
        table_sync=table_sync, conflicts=conflicts, skipped_transactions=skipped, origins=origins,
        schema_changes=schema_changes, publication_tables=publication_tables,
        change_feed=change_feed, running=running, repairs=repairs, spill_dir=str(spill_dir),
        spill_bytes=_directory_bytes(spill_dir), failover=failover, notes=notes)


class StatusError(Exception):
    """A server could not be read; the message names which and why."""


@contextmanager
def _reading(side: str, dsn: str) -> Iterator[Connection]:
    from sqlalchemy.exc import DBAPIError  # status only: the worker's telemetry does not load it

    try:
        with make_engine(dsn).connect() as conn:
            yield conn
    except DBAPIError as exc:
        reason = str(exc.orig).strip() if exc.orig is not None else str(exc)
        raise StatusError(f"cannot read the {side} ({mask_dsn(dsn)}): {mask_dsn(reason)}") from exc


def _with_lsns(row: Mapping[str, Any]) -> dict[str, Any]:
    """A bookkeeping row with its ``*_lsn`` values as LSNs: every LSN of the report prints in one
    style, whatever the server version wrote."""
    return {name: LSN.parse(value) if name.endswith("_lsn") and isinstance(value, str) else value
            for name, value in row.items()}


def _prepared_on_target(conn: Connection) -> list[dict[str, Any]]:
    """Source transactions the worker prepared on the target (two-phase mode prepare), pending
    until COMMIT/ROLLBACK PREPARED."""
    found = rows(conn, "SELECT gid, prepared, owner FROM pg_catalog.pg_prepared_xacts "
                       "WHERE database = pg_catalog.current_database() "
                       "AND starts_with(gid, %(prefix)s) ORDER BY prepared",
                 {"prefix": PREPARED_GID_PREFIX})
    return [{"gid": r[0], "prepared": r[1], "owner": r[2], "mode": "prepare"} for r in found]


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
    return f"{readable_size(n)} ({n} bytes)" if n >= 1024 else f"{n} bytes"


def _table_sync_line(row: Mapping[str, Any], running: bool) -> str:
    """``public.orders: copied at 0/1A2B3C4D: 200000 rows, 12.3 MB, in 4.2 s``, or not copied
    yet: being copied while a sync (or worker) of the slot runs, else left unfinished."""
    name = f"{row.get('schema_name')}.{row.get('table_name')}"
    if row.get("state") != "done":
        started = row.get("started_at")
        if running:
            return f"{name}: in the copy under way (begun {_jsonable(started)})"
        return (f"{name}: not copied: the copy that began {_jsonable(started)} stopped "
                "unfinished, and no sync runs; run applier sync to finish it")
    text = f"{name}: copied at {row.get('sync_lsn')}"
    if row.get("rows_copied") is not None:
        text += f": {row['rows_copied']} rows, {_size(row.get('bytes_copied')).split(' (')[0]}"
    started, finished = row.get("started_at"), row.get("finished_at")
    if isinstance(started, datetime) and isinstance(finished, datetime):
        text += f", in {(finished - started).total_seconds():.1f} s"
    return text


#: What a table the worker does not simply apply is doing, by its state in publication_tables.
_PUBLICATION_STATES = {"removed": "no longer published: not applied, target rows kept",
                       "copying": "being copied (added to the publication, or applier resync)",
                       "resync": "to be copied again (applier resync): the worker starts within "
                                 "seconds, or the next run first"}


def _repair_line(row: Mapping[str, Any]) -> str:
    """``2024-... public.t: resync done at 0/1A2B: 5000 rows`` or a repair's rows and keys."""
    name = f"{row['schema_name']}.{row['table_name']}"
    when = _jsonable(row.get("finished_at") or row.get("started_at") or row.get("requested_at"))
    if row["kind"] == "resync":
        if row["state"] != "done":
            return f"{when} {name}: resync {'copying' if row['state'] == 'copying' else 'requested'}"
        return f"{when} {name}: resync done at {row['source_lsn']}: {row.get('inserted')} rows copied"
    keys = ", ".join(_key_text(k) for k in row.get("keys") or [])
    more = row.get("key_count", 0) - len(row.get("keys") or [])
    return (f"{when} {name}: repaired at {row['source_lsn']}: {row.get('inserted')} inserted, "
            f"{row.get('updated')} updated, {row.get('deleted')} deleted; keys {keys}"
            + (f" and {more} more" if more > 0 else ""))


def _key_text(key: list[Any]) -> str:
    """A repaired key (a list of text values) or key range (two integers)."""
    if all(isinstance(v, int) for v in key):
        return str(key[0]) if key[0] == key[-1] else f"{key[0]}-{key[-1]}"
    return str(key[0]) if len(key) == 1 else f"({', '.join(map(str, key))})"


def _feed_line(row: Mapping[str, Any], progress: Progress | None) -> str:
    """``public.orders -> applier_changes.public.orders: changes committed after 0/0 up to
    0/1B2C3D4, 3 partition(s), ~1200 rows, 240.0 kB``."""
    upper = row.get("stopped_lsn") or (progress.commit_lsn if progress else None)
    stopped = " (stopped: no longer recorded)" if row.get("stopped_lsn") else ""
    return (f"{row['table']} -> {row['change_table']}: changes committed after "
            f"{row['retained_after']} up to {upper or 'the applied position'}{stopped}, "
            f"{row['partitions']} partition(s), ~{row['estimated_rows']} rows, "
            f"{_size(row['bytes']).split(' (')[0]}")


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
    if report.failover is not None:
        rows += render_failover(report.failover)
    rows.append(("source WAL position", str(report.source_wal_lsn)))
    progress = report.progress
    if progress is None:
        rows.append(("last applied", "nothing yet"))
    else:
        rows += [("last applied commit LSN", f"{progress.commit_lsn} (end {progress.end_lsn})"),
                 ("last applied commit time", progress.commit_time.isoformat() if progress.commit_time else "unknown"),
                 ("applied at", progress.applied_at.isoformat() if progress.applied_at else "unknown")]
    if report.lag is None:
        lag = "unknown: the slot is missing"
    else:
        seconds = "unknown" if report.lag.seconds is None else f"{report.lag.seconds:.1f} s"
        lag = f"{_size(report.lag.bytes)}, {seconds}"
    if report.max_lag and report.lag is not None:
        lag += f" ({'EXCEEDS' if report.lag_exceeded else 'within'} --max-lag {report.max_lag})"
    rows.append(("apply lag", lag))
    holder = report.running
    rows.append(("worker", "not running" if holder is None else
                 f"running (target backend pid {holder.backend_pid}, {holder.application_name!r})"))
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
    not_applied = [t for t in report.publication_tables if t["state"] != "published"]
    if report.publication_tables:
        rows.append(("published tables", f"{len(report.publication_tables)} followed" + "".join(
            f"\n  {t['schema_name']}.{t['table_name']}: " + _PUBLICATION_STATES.get(t["state"], t["state"])
            for t in not_applied)))
    if report.schema_changes:
        rows.append(("schema changes", f"{len(report.schema_changes)} latest" + "".join(
            f"\n  {_jsonable(c.get('applied_at'))} {c['statement']}" for c in report.schema_changes)))
    if report.change_feed:
        rows.append(("change feed", f"{len(report.change_feed)} table(s)" + "".join(
            f"\n  {_feed_line(row, progress)}" for row in report.change_feed)))
    if report.repairs:
        rows.append(("repairs", f"{len(report.repairs)} latest" + "".join(
            f"\n  {_repair_line(row)}" for row in report.repairs)))
    if report.table_sync is not None:
        rows.append(("table sync", f"{len(report.table_sync)} table(s)" + "".join(
            f"\n  {_table_sync_line(row, holder is not None)}" for row in report.table_sync)))
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
