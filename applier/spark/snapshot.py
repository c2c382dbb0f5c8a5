"""One exported snapshot of a database held open for Spark's reads, and the position it reflects.

Owns: exporting a snapshot in a REPEATABLE READ, READ ONLY transaction that stays open until the
``with`` block ends (:class:`Snapshot`), the statement with which every partition's connection
imports it, and reading, in that same snapshot, the source position the applier worker recorded
in ``applier.progress`` (:class:`ReadPosition`). On a replica with a change feed it first takes
the feed's shared advisory lock, so that the history :mod:`.changes` reads in the snapshot stays
there. Must never write to the database, or let the server's idle-in-transaction limit end the
snapshot under a long Spark job.

Each Spark action re-reads the table, so every action (or ``persist()`` and materialise) must run
inside the block; after it a read fails loudly with "snapshot ... does not exist", never with a
different state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from ..connections import connect, reached
from ..progress.feed_registry import FEED_LOCK
from ..quoting import literal

__all__ = ["ReadPosition", "SlotPosition", "Snapshot", "database_label", "open_snapshot"]


@dataclass(frozen=True)
class SlotPosition:
    """One ``applier.progress`` row: the last source transaction applied through a slot."""
    slot_name: str
    commit_lsn: str
    end_lsn: str
    commit_time: str | None  # ISO 8601, UTC
    applied_at: str | None


@dataclass(frozen=True)
class ReadPosition:
    """What a read reflects: the snapshot, this database's WAL position, the applied source."""
    snapshot: str
    wal_lsn: str
    positions: tuple[SlotPosition, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ReadPosition:
        data = json.loads(text)
        return cls(data["snapshot"], data["wal_lsn"],
                   tuple(SlotPosition(**row) for row in data["positions"]))


class Snapshot:
    """An exported snapshot held open by a REPEATABLE READ, READ ONLY transaction.

    ``query`` runs in the snapshot (used for bounds, probes and the catalog); partitions import
    ``snapshot_id``. Close it (or leave the ``with`` block) only after every Spark action ran.
    """

    def __init__(self, dsn: str, conn: psycopg.Connection[Any], position: ReadPosition,
                 history_locked: bool = False) -> None:
        self.dsn = dsn
        self.position = position
        self._conn = conn
        #: The change feed's history cannot shrink while this snapshot is open (its shared
        #: lock was taken before the snapshot): :func:`.changes.read_changes` may read it.
        self.history_locked = history_locked

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The connection holding the snapshot (queries on it run in the snapshot)."""
        return self._conn

    @property
    def snapshot_id(self) -> str:
        return self.position.snapshot

    @property
    def session_init_statement(self) -> str:
        # The isolation level must be in BEGIN: without it the import is refused, and the
        # SET TRANSACTION ISOLATION form is silently inconsistent with autocommit reads.
        return ("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; "
                f"SET TRANSACTION SNAPSHOT {literal(self.snapshot_id)}")

    def query(self, statement: str | sql.SQL | sql.Composed,
              params: Sequence[Any] | Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        if self._conn.closed:
            raise RuntimeError(f"snapshot {self.snapshot_id} is closed")
        return self._conn.execute(statement, params).fetchall()

    def literal(self, value: Any) -> str:
        """``value`` as an SQL literal, quoted the way this connection would."""
        return sql.Literal(value).as_string(self._conn)

    def close(self) -> None:
        if not self._conn.closed:
            self._conn.rollback()
            self._conn.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_snapshot(dsn: str, *, slot: str | None = None) -> Snapshot:
    """Export a snapshot of ``dsn`` and read, in it, the position the worker had applied.

    ``slot`` restricts the reported ``applier.progress`` rows to one slot (an error if it has
    none); by default every row is reported (normally there is one). A database without
    ``applier.progress`` (a source, say) reports no slot positions, only its WAL position.
    """
    conn = connect(dsn, application_name="applier spark snapshot", autocommit=True)
    try:
        history_locked = _lock_history(conn)
        conn.autocommit = False
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        row = conn.execute("SELECT pg_export_snapshot(), CASE WHEN pg_is_in_recovery() "
                           "THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END::text").fetchone()
        assert row is not None
        snapshot_id, wal_lsn = row
        # A long Spark job must not lose its snapshot to the server's idle-in-transaction limit.
        conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
        positions: list[SlotPosition] = []
        if conn.execute("SELECT to_regclass('applier.progress')").fetchone() != (None,):
            rows = conn.execute(
                "SELECT slot_name, commit_lsn::text, end_lsn::text, "
                "to_char(commit_time AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), "
                "to_char(applied_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') "
                "FROM applier.progress WHERE %(slot)s::text IS NULL OR slot_name = %(slot)s "
                "ORDER BY slot_name", {"slot": slot}).fetchall()
            positions = [SlotPosition(*r) for r in rows]
        if slot is not None and not positions:
            raise LookupError(f"no applier.progress row for slot {slot!r} in {database_label(dsn)}: "
                              "has the worker applied anything through it?")
        # Partitions import the snapshot, which only this server has: of a DSN naming several
        # hosts, they name the one reached here.
        return Snapshot(reached(dsn, conn), conn, ReadPosition(snapshot_id, wal_lsn, tuple(positions)),
                        history_locked)
    except BaseException:
        conn.close()
        raise


def _lock_history(conn: psycopg.Connection[Any]) -> bool:
    """On a replica with a change feed, take the feed's shared lock for the session, before the
    snapshot exists: retention then drops no history this snapshot may read (and none was dropped
    after the snapshot was taken, which the snapshot's registry would not show). Closing the
    snapshot's connection lets go of it."""
    if conn.execute("SELECT to_regclass('applier.change_tables') IS NOT NULL").fetchone() != (True,):
        return False
    conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", FEED_LOCK)
    return True


def database_label(dsn: str) -> str:
    """``host:port/dbname`` of a DSN, for messages (never its password or other options)."""
    params = conninfo_to_dict(dsn)
    return f"{params.get('host', 'localhost')}:{params.get('port', 5432)}/{params.get('dbname', '')}"
