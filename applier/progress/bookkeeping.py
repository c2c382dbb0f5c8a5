"""``Bookkeeping`` on PostgreSQL: the ``applier.*`` reads and writes made off the hot path.

Owns the SQL that status, metrics, verify, skip, sync and the Spark reader run against the
bookkeeping schema, on whatever connection the caller holds: a psycopg connection (inside the
caller's transaction, as sync's copy transactions need) or a SQLAlchemy connection (whose
``exec_driver_sql`` takes the same psycopg-style parameters). Reads of tables a newer schema
version adds check that the table exists, so status works on a target of any schema version.
Must never commit or roll back the caller's transaction, and must not import SQLAlchemy (``applier
run`` reads the position with psycopg alone before loading it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from psycopg import sql

from ..protocol.lsn import LSN
from ..queries import rows
from .records import AppliedPosition, Progress, SourceIdentity, TableName
from .store import TableState

__all__ = ["SqlBookkeeping"]

#: Columns naming the kind of an event row in optional bookkeeping tables, most specific first.
#: The bookkeeping tables whose rows say that a worker or a sync has run for a slot.
RECORDS_OF_A_SLOT = ("progress", "table_sync", "publication_tables", "conflicts", "source_identity")
_KIND_COLUMNS = ("conflict_type", "skip_reason", "kind", "type", "reason")


def _lsn(text: str | None) -> LSN | None:
    return None if text is None else LSN.parse(text)


class SqlBookkeeping:
    """``Bookkeeping`` over ``conn``: a psycopg ``Connection`` or a SQLAlchemy ``Connection``."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def _rows(self, query: str | sql.Composable, params: Mapping[str, Any] | Sequence[Any] = ()
              ) -> list[tuple[Any, ...]]:
        return rows(self.conn, query, params)

    # -- reads -------------------------------------------------------------------------------------
    def tables(self) -> set[str]:
        return {row[0] for row in self._rows(
            "SELECT c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = 'applier' AND c.relkind IN ('r', 'p')")}

    def position(self, slot: str) -> AppliedPosition | None:
        """The slot's recorded position; None when nothing was applied for it yet. Raises
        ``psycopg.errors.UndefinedTable`` before the bookkeeping schema exists."""
        rows = self._rows("SELECT commit_lsn::text, end_lsn::text FROM applier.progress "
                          "WHERE slot_name = %(slot)s", {"slot": slot})
        return AppliedPosition(LSN.parse(rows[0][0]), LSN.parse(rows[0][1])) if rows else None

    def positions(self, slot: str | None = None) -> list[Progress]:
        """Every slot's progress (or one slot's); empty before the bookkeeping schema exists."""
        if "progress" not in self.tables():
            return []
        rows = self._rows(
            "SELECT slot_name, commit_lsn::text, end_lsn::text, commit_time, applied_at "
            "FROM applier.progress WHERE %(slot)s::text IS NULL OR slot_name = %(slot)s "
            "ORDER BY slot_name", {"slot": slot})
        return [Progress(r[0], LSN.parse(r[1]), LSN.parse(r[2]), r[3], r[4]) for r in rows]

    def progress(self, slot: str) -> Progress | None:
        found = self.positions(slot)
        return found[0] if found else None

    def slot_recorded(self, slot: str) -> bool:
        """A worker or a sync has run for ``slot`` (a schema not created yet names nothing). A
        worker records its published tables as it starts, before it applies anything: a worker
        that stopped on its very first transaction has run too."""
        tables = [name for name in RECORDS_OF_A_SLOT if name in self.tables()]
        if not tables:
            return False
        query = sql.SQL("SELECT EXISTS ({})").format(sql.SQL(" UNION ALL ").join(
            sql.SQL("SELECT FROM {} WHERE slot_name = %(slot)s").format(sql.Identifier("applier", name))
            for name in tables))
        return bool(self._rows(query, {"slot": slot})[0][0])

    def source_identity(self, slot: str) -> SourceIdentity | None:
        """The source server the slot's progress comes from; None when not recorded (before
        schema 0009, or before the slot's first session)."""
        if "source_identity" not in self.tables():
            return None
        found = self._rows("SELECT system_identifier, timeline FROM applier.source_identity "
                           "WHERE slot_name = %(slot)s", {"slot": slot})
        return SourceIdentity(found[0][0], int(found[0][1])) if found else None

    def table_states(self, slot: str) -> dict[TableName, TableState]:
        rows = self._rows("SELECT schema_name, table_name, state, sync_lsn::text "
                          "FROM applier.table_sync WHERE slot_name = %(slot)s", {"slot": slot})
        return {(r[0], r[1]): TableState(r[2], _lsn(r[3])) for r in rows}

    def deferred_prepared(self, slot: str) -> list[dict[str, Any]]:
        """Prepared source transactions held in the bookkeeping schema (two-phase mode defer)."""
        if "prepared_transactions" not in self.tables():
            return []
        rows = self._rows(
            "SELECT source_gid, prepare_time, prepare_lsn::text, changes "
            "FROM applier.prepared_transactions p WHERE slot_name = %(slot)s AND mode = 'defer' "
            "ORDER BY p.prepare_lsn", {"slot": slot})
        return [{"gid": r[0], "prepared": r[1], "prepare_lsn": r[2], "changes": r[3],
                 "mode": "defer"} for r in rows]

    def _columns(self, table: str) -> list[str]:
        return [row[0] for row in self._rows(
            "SELECT attname FROM pg_catalog.pg_attribute WHERE attrelid = "
            "pg_catalog.to_regclass(%(name)s) AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            {"name": sql.Identifier("applier", table).as_string()})]

    def _for_slot(self, columns: list[str]) -> sql.Composable:
        return sql.SQL(" WHERE slot_name = %(slot)s" if "slot_name" in columns else "")

    def rows(self, table: str, slot: str) -> list[Mapping[str, Any]]:
        """Every row of an ``applier`` table for the slot, as column -> value."""
        columns = self._columns(table)
        query = sql.SQL("SELECT {} FROM {}{}").format(
            sql.SQL(", ").join(map(sql.Identifier, columns)), sql.Identifier("applier", table),
            self._for_slot(columns))
        return [dict(zip(columns, row)) for row in self._rows(query, {"slot": slot})]

    def count_by_kind(self, table: str, slot: str) -> dict[str, int]:
        """Rows of an event table for the slot, counted by their kind column."""
        columns = self._columns(table)
        kind = next((c for c in _KIND_COLUMNS if c in columns), None)
        name = sql.Identifier("applier", table)
        if kind is None:
            total = self._rows(sql.SQL("SELECT count(*) FROM {}{}").format(
                name, self._for_slot(columns)), {"slot": slot})
            return {"all": int(total[0][0])}
        rows = self._rows(sql.SQL("SELECT {}::text, count(*) FROM {}{} GROUP BY 1 ORDER BY 1").format(
            sql.Identifier(kind), name, self._for_slot(columns)), {"slot": slot})
        return {str(r[0]): int(r[1]) for r in rows}

    def schema_changes(self, slot: str, limit: int = 20) -> list[Mapping[str, Any]]:
        """The latest schema changes made for the slot, newest first (none before schema 0005)."""
        if "schema_changes" not in self.tables():
            return []
        columns = ("table_schema", "table_name", "kind", "statement", "source_lsn", "applied_at")
        rows = self._rows(
            "SELECT table_schema, table_name, kind, statement, source_lsn::text, applied_at "
            "FROM applier.schema_changes WHERE slot_name = %(slot)s ORDER BY id DESC "
            "LIMIT %(limit)s", {"slot": slot, "limit": limit})
        return [dict(zip(columns, row)) for row in rows]

    def skipped(self, slot: str) -> list[tuple[LSN, list[str]]]:
        """The slot's skipped source transactions: (finish LSN, the tables they changed)."""
        if "skipped_transactions" not in self.tables():
            return []
        return [(LSN.parse(r[0]), list(r[1])) for r in self._rows(
            "SELECT finish_lsn::text, tables FROM applier.skipped_transactions "
            "WHERE slot_name = %(slot)s ORDER BY id", {"slot": slot})]

    def conflicts_by_table(self, slot: str) -> dict[str, dict[str, int]]:
        """The slot's recorded conflicts: ``schema.table`` -> type -> how many."""
        if "conflicts" not in self.tables():
            return {}
        found: dict[str, dict[str, int]] = {}
        for table, kind, count in self._rows(
                "SELECT table_schema || '.' || table_name, conflict_type, count(*) "
                "FROM applier.conflicts WHERE slot_name = %(slot)s GROUP BY 1, 2 ORDER BY 1, 2",
                {"slot": slot}):
            found.setdefault(table, {})[kind] = int(count)
        return found

    def tables_with_slots(self) -> list[str]:
        """The ``applier`` tables that hold rows per slot (a ``slot_name`` column), by name."""
        return [row[0] for row in self._rows(
            "SELECT c.relname::text FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
            "ON n.oid = c.relnamespace JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid "
            "WHERE n.nspname = 'applier' AND c.relkind IN ('r', 'p') "
            "AND a.attname = 'slot_name' AND NOT a.attisdropped ORDER BY 1")]

    def slots(self) -> list[str]:
        """Every slot with a row in some bookkeeping table, by name."""
        tables = self.tables_with_slots()
        if not tables:
            return []
        query = sql.SQL(" UNION ").join(
            sql.SQL("SELECT slot_name FROM {}").format(sql.Identifier("applier", name))
            for name in tables)
        return sorted(row[0] for row in self._rows(query))

    def slot_row_counts(self, slot: str, *, besides: Iterable[str] = ()) -> dict[str, int]:
        """Rows ``slot`` has in each bookkeeping table that holds any (none before the schema),
        but for the tables ``besides``."""
        tables = [name for name in self.tables_with_slots() if name not in set(besides)]
        if not tables:
            return {}
        query = sql.SQL(" UNION ALL ").join(
            sql.SQL("SELECT {}, count(*) FROM {} WHERE slot_name = %(slot)s").format(
                sql.Literal(name), sql.Identifier("applier", name)) for name in tables)
        return {name: int(count) for name, count in self._rows(query, {"slot": slot}) if count}

    # -- writes --------------------------------------------------------------------------------------
    def forget_slot(self, slot: str, *, besides: Iterable[str] = ()) -> dict[str, int]:
        """Delete ``slot``'s rows from every bookkeeping table but the tables ``besides``; the
        rows deleted, per table."""
        deleted = {}
        for name in self.tables_with_slots():
            if name in set(besides):
                continue
            count = self._rows(sql.SQL(
                "WITH gone AS (DELETE FROM {} WHERE slot_name = %(slot)s RETURNING 1) "
                "SELECT count(*) FROM gone").format(sql.Identifier("applier", name)),
                {"slot": slot})[0][0]
            if count:
                deleted[name] = int(count)
        return deleted

    def record_source_identity(self, slot: str, identity: SourceIdentity) -> None:
        """From now on the slot's progress comes from this source server."""
        self._rows("INSERT INTO applier.source_identity (slot_name, system_identifier, timeline) "
                   "VALUES (%(slot)s, %(system)s, %(timeline)s) ON CONFLICT (slot_name) DO UPDATE "
                   "SET system_identifier = EXCLUDED.system_identifier, timeline = "
                   "EXCLUDED.timeline, recorded_at = clock_timestamp()",
                   {"slot": slot, "system": identity.system_identifier, "timeline": identity.timeline})

    def request_skip(self, slot: str, lsn: LSN) -> LSN | None:
        position = self._rows("SELECT commit_lsn::text FROM applier.progress "
                              "WHERE slot_name = %(slot)s", {"slot": slot})
        if position and lsn <= LSN.parse(position[0][0]):
            raise ValueError(f"slot {slot!r} has already applied everything up to commit LSN "
                             f"{position[0][0]}; a transaction finishing at {lsn} is behind it and "
                             "cannot be skipped any more")
        previous = self._rows("SELECT lsn::text FROM applier.skip_requests WHERE slot_name = %(slot)s",
                              {"slot": slot})
        self._rows("INSERT INTO applier.skip_requests (slot_name, lsn) VALUES "
                   "(%(slot)s, %(lsn)s::pg_lsn) ON CONFLICT (slot_name) DO UPDATE SET "
                   "lsn = EXCLUDED.lsn, requested_at = now()", {"slot": slot, "lsn": str(lsn)})
        return LSN.parse(previous[0][0]) if previous else None

    def publication_tables(self, slot: str) -> dict[TableName, str]:
        """The tables the slot's publications published as the worker last saw them, and their
        state (published, copying, removed); empty before schema 0005 or the first run."""
        if "publication_tables" not in self.tables():
            return {}
        rows = self._rows("SELECT schema_name, table_name, state FROM applier.publication_tables "
                          "WHERE slot_name = %(slot)s", {"slot": slot})
        return {(r[0], r[1]): r[2] for r in rows}

    def set_publication_tables(self, slot: str, tables: Iterable[TableName], state: str) -> None:
        for schema, name in tables:
            self._rows("INSERT INTO applier.publication_tables (slot_name, schema_name, table_name, "
                       "state) VALUES (%(slot)s, %(schema)s, %(name)s, %(state)s) ON CONFLICT "
                       "(slot_name, schema_name, table_name) DO UPDATE SET state = EXCLUDED.state, "
                       "changed_at = clock_timestamp()",
                       {"slot": slot, "schema": schema, "name": name, "state": state})

    def publication_relids(self, slot: str) -> dict[TableName, int]:
        """The source OID of each followed table whose OID is known (schema 0008)."""
        if "publication_tables" not in self.tables():
            return {}
        rows = self._rows("SELECT schema_name, table_name, relid::int8 FROM applier.publication_tables "
                          "WHERE slot_name = %(slot)s AND relid IS NOT NULL", {"slot": slot})
        return {(r[0], r[1]): int(r[2]) for r in rows}

    def set_publication_relids(self, slot: str, relids: Mapping[TableName, int]) -> None:
        for (schema, name), relid in relids.items():
            self._rows("UPDATE applier.publication_tables SET relid = %(relid)s::int8::oid "
                       "WHERE slot_name = %(slot)s AND schema_name = %(schema)s AND table_name = %(name)s",
                       {"slot": slot, "schema": schema, "name": name, "relid": relid})

    def rename_table(self, slot: str, old: TableName, new: TableName) -> None:
        """The source renamed (or moved to another schema) a followed table: every record of the
        slot about it follows the new name (the table it follows, its copy, its change table)."""
        names = {"slot": slot, "old_schema": old[0], "old_name": old[1], "schema": new[0],
                 "name": new[1]}
        tables = self.tables()
        for table, schema_column, name_column in (("publication_tables", "schema_name", "table_name"),
                                                  ("table_sync", "schema_name", "table_name"),
                                                  ("change_tables", "table_schema", "table_name")):
            if table in tables:
                self._rows(sql.SQL("UPDATE {} SET {} = %(schema)s, {} = %(name)s WHERE slot_name = "
                                   "%(slot)s AND {} = %(old_schema)s AND {} = %(old_name)s").format(
                    sql.Identifier("applier", table), sql.Identifier(schema_column),
                    sql.Identifier(name_column), sql.Identifier(schema_column),
                    sql.Identifier(name_column)), names)

    def start_copies(self, slot: str, tables: Iterable[TableName], forget_position: bool) -> None:
        """Mark ``tables`` as copying (in the caller's transaction, with their truncation).

        ``forget_position``: the slot is about to be created afresh, so the position recorded for
        an older slot of that name means nothing any more."""
        for schema, name in tables:
            self._rows(
                "INSERT INTO applier.table_sync (slot_name, schema_name, table_name, state) "
                "VALUES (%(slot)s, %(schema)s, %(name)s, 'copying') "
                "ON CONFLICT (slot_name, schema_name, table_name) DO "
                "UPDATE SET state = 'copying', sync_lsn = NULL, rows_copied = NULL, "
                "bytes_copied = NULL, started_at = now(), finished_at = NULL",
                {"slot": slot, "schema": schema, "name": name})
        if forget_position:
            self._rows("DELETE FROM applier.progress WHERE slot_name = %(slot)s", {"slot": slot})
            self._rows("DELETE FROM applier.table_sync WHERE slot_name = %(slot)s AND state = 'done'",
                       {"slot": slot})

    def mark_done(self, slot: str, table: TableName, sync_lsn: LSN, rows: int, nbytes: int) -> None:
        """In a copy's transaction: the table is copied as of ``sync_lsn``."""
        self._rows("UPDATE applier.table_sync SET state = 'done', sync_lsn = %(lsn)s::pg_lsn, "
                   "rows_copied = %(rows)s, bytes_copied = %(bytes)s, finished_at = now() "
                   "WHERE slot_name = %(slot)s AND schema_name = %(schema)s AND table_name = %(name)s",
                   {"lsn": str(sync_lsn), "rows": rows, "bytes": nbytes, "slot": slot,
                    "schema": table[0], "name": table[1]})

    def record_copied_position(self, slot: str, consistent_point: LSN) -> None:
        """In a copy's transaction, for a slot the copy created: the replica is at the slot's
        consistent point, so give it a position if the worker has not recorded one yet (without
        it, a sync that streams nothing after its copy leaves the target positionless).

        Recorded as every commit *before* the point applied: commit LSN one below it, end LSN at
        it. A transaction whose commit record starts exactly at the point is not in the copy
        (``SyncFilter`` keeps it), and the worker skips commits at or below the recorded commit
        LSN, as a change feed reader starts after it."""
        self._rows("INSERT INTO applier.progress (slot_name, commit_lsn, end_lsn, commit_time, "
                   "applied_at) VALUES (%(slot)s, %(commit)s::pg_lsn, %(end)s::pg_lsn, NULL, "
                   "clock_timestamp()) ON CONFLICT (slot_name) DO NOTHING",
                   {"slot": slot, "commit": str(LSN(int(consistent_point) - 1)),
                    "end": str(consistent_point)})

    def record_copy_transaction(self, slot: str) -> None:
        """In a copy's target transaction: note its xid, so that the worker knows the rows it
        wrote (which carry no replication origin) as its own, not as local writes of another
        origin."""
        self._rows("INSERT INTO applier.copy_transactions (slot_name, xid) "
                   "VALUES (%(slot)s, pg_catalog.txid_current() %% 4294967296) ON CONFLICT DO NOTHING",
                   {"slot": slot})
