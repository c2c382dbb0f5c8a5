"""The change feed's registry and maintenance, off the hot path: ``applier.change_tables``,
``applier.change_partitions`` and the change tables themselves.

Owns registering the tables a worker records (creating the ``applier_changes`` schema, a change
table with its pending and first partitions, columns the target table gained since; history
started again when the feed of a table is switched on again or the table was copied anew, and
marked stopped when it is switched off), loading them for the apply stage, pruning old
partitions (``prune``: never while a reader holds the feed's shared advisory lock, which
``spark.reader.open_snapshot`` takes before its snapshot), removing a retired slot's change feed
(``remove``, for ``applier drop``), and what status and the Spark reader read. Runs on
whatever connection the caller holds (psycopg or SQLAlchemy, ``queries.rows``), inside the
caller's transaction except where a method says it commits. SQL is composed with
psycopg.sql (``feed`` builds the statements the apply session sends). Must never apply a row
change or decide which tables the feed records (the settings do).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg import sql

from ..errors import ApplierError, Cause
from ..protocol.lsn import LSN
from ..queries import rows
from .feed import (
    META_COLUMNS,
    PENDING,
    SCHEMA,
    ChangeTable,
    Partition,
    change_table_name,
    create_table_sql,
    first_span,
    partition_name,
    partition_row_sql,
    partition_sql,
)
from .records import TableName

__all__ = ["FEED_LOCK", "REGISTRY_TABLES", "FeedError", "FeedRegistry", "FeedStatus", "RetainedHistory"]

log = logging.getLogger(__name__)

#: Advisory lock (namespace 'APPF', key 0): readers of change tables hold it shared for the life
#: of their snapshot, pruning takes it exclusively (and skips a round when it cannot).
FEED_LOCK = (0x41505046, 0)
#: The bookkeeping tables that describe change tables: their rows go (or stay) with them.
REGISTRY_TABLES = ("change_tables", "change_partitions", "change_commits")


class FeedError(ApplierError):
    """A table cannot be recorded (no target table, a column named like a meta column)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.NEEDS_OPERATOR)


@dataclass(frozen=True)
class RetainedHistory:
    """What a reader may ask of one change table: every change committed after
    ``retained_after`` (and, when ``stopped_lsn`` is set, up to it)."""

    slot: str
    change_table: str
    retained_after: LSN
    stopped_lsn: LSN | None


@dataclass(frozen=True)
class FeedStatus:
    """One change table as ``applier status`` shows it."""

    table: str
    change_table: str            # its SQL name: "applier_changes"."public.orders"
    retained_after: LSN          # every change committed after it is kept ...
    stopped_lsn: LSN | None      # ... up to here, or to the slot's applied position when None
    partitions: int              # regular partitions (the pending one is not counted)
    estimated_rows: int
    bytes: int


_TARGET_COLUMNS = """
    SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod)
    FROM pg_catalog.pg_attribute a
    WHERE a.attrelid = (SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n
                        ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s
                        AND c.relname = %(name)s AND c.relkind IN ('r', 'p'))
      AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
    ORDER BY a.attnum
"""
_REGISTERED = """
    SELECT id, table_schema, table_name, change_table, created_lsn::text, retained_after::text,
           stopped_lsn::text
    FROM applier.change_tables WHERE slot_name = %(slot)s ORDER BY id
"""
_PARTITIONS = """
    SELECT partition_name, from_lsn::text, to_lsn::text, opened_lsn::text, created_at
    FROM applier.change_partitions p WHERE change_table = %(name)s ORDER BY p.from_lsn
"""


class FeedRegistry:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def _rows(self, query: str | sql.Composable, params: Any = ()) -> list[tuple[Any, ...]]:
        return rows(self.conn, query, params)

    def exists(self) -> bool:
        return self._rows("SELECT pg_catalog.to_regclass('applier.change_tables') IS NOT NULL")[0][0]

    # -- the worker's start ---------------------------------------------------------------------
    def register(self, slot: str, wanted: Iterable[TableName], position: LSN,
                 sync_lsns: dict[TableName, LSN], interval: float) -> dict[TableName, ChangeTable]:
        """Make sure every table in ``wanted`` has a change table recording the changes committed
        after ``position`` (the slot's applied commit LSN, or after the table's copy); mark the
        slot's other change tables stopped at ``position``. Returns the change tables.
        ``interval``: the seconds of WAL a partition is sized for."""
        wanted = sorted(set(wanted))
        self._rows("SELECT pg_catalog.set_config('search_path', '', true)")
        if not self._rows("SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s", (SCHEMA,)):
            self._rows(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
        known = {(r[1], r[2]): r for r in self._rows(_REGISTERED, {"slot": slot})}
        for key, row in known.items():
            if key not in wanted and row[6] is None:
                self._rows("UPDATE applier.change_tables SET stopped_lsn = %(lsn)s::pg_lsn "
                           "WHERE id = %(id)s", {"lsn": str(position), "id": row[0]})
                log.warning("change feed of %s.%s stopped at %s (no longer in --change-feed); its "
                            "history is kept until retention drops it, and starts again if it is "
                            "recorded again", key[0], key[1], position)
        for key in wanted:
            sync_lsn = sync_lsns.get(key)
            after = LSN(max(position, sync_lsn - 1 if sync_lsn else 0))
            columns = self._target_columns(key)
            found = known.get(key)
            if found is None:
                self._create(slot, key, columns, after, interval)
                continue
            restart = found[6] is not None or (sync_lsn is not None
                                               and sync_lsn - 1 > LSN.parse(found[4]))
            self._add_columns(found[3], columns)
            if restart:
                self._restart(found, after)
        tables = {(ct.schema, ct.table): ct for ct in self.load(slot)}
        return {key: tables[key] for key in wanted}

    def _target_columns(self, key: TableName) -> dict[str, str]:
        found = self._rows(_TARGET_COLUMNS, {"schema": key[0], "name": key[1]})
        if not found:
            raise FeedError(f"change feed: target table {key[0]}.{key[1]} does not exist; create "
                            "it (or run applier sync --create-tables) before recording its changes")
        columns = {name: kind for name, kind in found}
        clash = sorted(set(columns) & set(META_COLUMNS))
        if clash:
            raise FeedError(f"change feed: {key[0]}.{key[1]} has column(s) {', '.join(clash)}, "
                            "which the change table uses for its meta columns; it cannot be "
                            "recorded (rename the column, or leave the table out of --change-feed)")
        return columns

    def _create(self, slot: str, key: TableName, columns: dict[str, str], after: LSN,
                interval: float) -> None:
        taken = {r[0] for r in self._rows("SELECT change_table FROM applier.change_tables")}
        name = change_table_name(key[0], key[1], slot, taken)
        for statement in create_table_sql(name, columns):
            self._rows(statement)
        table_id = self._rows(
            "INSERT INTO applier.change_tables (slot_name, table_schema, table_name, change_table, "
            "created_lsn, retained_after) VALUES (%(slot)s, %(schema)s, %(table)s, %(name)s, "
            "%(after)s::pg_lsn, %(after)s::pg_lsn) RETURNING id",
            {"slot": slot, "schema": key[0], "table": key[1], "name": name, "after": str(after)})[0][0]
        now = datetime.now(UTC)
        first = Partition("", LSN(0), LSN(min(int(PENDING), int(after) + first_span(interval))),
                          after, now)
        change_table = ChangeTable(table_id, slot, key[0], key[1], name, columns, after, first)
        first.name = partition_name(change_table, 1)
        for statement in partition_sql(change_table, partition_name(change_table, None), PENDING, None):
            self._rows(statement)
        for statement in partition_sql(change_table, first.name, first.from_lsn, first.to_lsn):
            self._rows(statement)
        self._rows(partition_row_sql(change_table, first))
        log.info("change feed: recording the changes of %s.%s committed after %s in %s.%s",
                 key[0], key[1], after, SCHEMA, name)

    def _add_columns(self, name: str, columns: dict[str, str]) -> None:
        have = self._change_columns(name)
        for column, kind in columns.items():
            if column not in have:
                self._rows(sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(
                    sql.Identifier(SCHEMA, name), sql.Identifier(column), sql.SQL(kind)))

    def _restart(self, row: tuple[Any, ...], after: LSN) -> None:
        """History starts again at ``after``: what the change table held no longer describes
        the table (its feed was off for a while, or it was copied anew)."""
        self._rows(sql.SQL("TRUNCATE {}").format(sql.Identifier(SCHEMA, row[3])))
        self._rows("UPDATE applier.change_tables SET created_lsn = %(after)s::pg_lsn, "
                   "retained_after = %(after)s::pg_lsn, stopped_lsn = NULL WHERE id = %(id)s",
                   {"after": str(after), "id": row[0]})
        log.warning("change feed of %s.%s starts again after %s (%s): earlier history dropped",
                    row[1], row[2], after, "it was switched off" if row[6] else "the table was copied anew")

    def _change_columns(self, name: str) -> dict[str, str]:
        found = self._rows(
            "SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod) "
            "FROM pg_catalog.pg_attribute a WHERE a.attrelid = %(table)s::regclass "
            "AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            {"table": sql.Identifier(SCHEMA, name).as_string()})
        return {n: k for n, k in found if n not in META_COLUMNS}

    def load(self, slot: str) -> list[ChangeTable]:
        """The slot's change tables, with their columns and newest partition."""
        self._rows("SELECT pg_catalog.set_config('search_path', '', true)")
        tables = []
        for table_id, schema, table, name, _, retained, stopped in self._rows(_REGISTERED, {"slot": slot}):
            parts = self.partitions(name)
            tables.append(ChangeTable(table_id, slot, schema, table, name, self._change_columns(name),
                                      LSN.parse(retained), parts[-1], _number(parts[-1].name),
                                      LSN.parse(stopped) if stopped else None))
        return tables

    def partitions(self, name: str) -> list[Partition]:
        return [Partition(p, LSN.parse(lo), LSN.parse(hi), LSN.parse(opened), created)
                for p, lo, hi, opened, created in self._rows(_PARTITIONS, {"name": name})]

    # -- retention ---------------------------------------------------------------------------------
    def prune(self, slot: str, retention: float, now: datetime) -> list[str] | None:
        """Drop the partitions every change of which is older than ``retention`` seconds (the
        next partition was created before then), oldest first, never the newest; record the
        retained history in the same transaction. Run inside a transaction with a short
        ``lock_timeout``. None (nothing done) when a reader holds the feed lock."""
        todo: list[tuple[ChangeTable, list[Partition]]] = []
        for change_table in self.load(slot):
            parts = self.partitions(change_table.name)
            old = []
            for part, after in zip(parts, parts[1:]):
                if (now - after.created_at).total_seconds() < retention:
                    break
                old.append(part)
            if old:
                todo.append((change_table, old))
        if not todo:
            return []
        if not self._rows("SELECT pg_catalog.pg_try_advisory_xact_lock(%s, %s)", FEED_LOCK)[0][0]:
            return None
        dropped = []
        for change_table, old in todo:
            if self._rows("SELECT 1 FROM pg_catalog.pg_locks WHERE locktype = 'relation' AND "
                          "relation = %s::regclass AND pid IS NULL",
                          (change_table.ident.as_string(),)):
                # A transaction prepared on the target holds it until COMMIT PREPARED: waiting
                # would only hold up the apply session queued behind this lock request.
                continue
            self._rows(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(change_table.ident))
            for part in old:
                self._rows(sql.SQL("DROP TABLE {}").format(sql.Identifier(SCHEMA, part.name)))
                self._rows("DELETE FROM applier.change_partitions WHERE partition_name = %s", (part.name,))
                dropped.append(part.name)
            retained = LSN(old[-1].to_lsn - 1)
            self._rows("UPDATE applier.change_tables SET retained_after = %(lsn)s::pg_lsn "
                       "WHERE id = %(id)s AND retained_after < %(lsn)s::pg_lsn",
                       {"lsn": str(retained), "id": change_table.id})
            log.info("change feed of %s: dropped %d partition(s) older than the retention; changes "
                     "committed after %s are kept", change_table.display, len(old), retained)
        if dropped:
            # The end LSNs of transactions no change table of the slot holds a row of any more.
            self._rows("DELETE FROM applier.change_commits WHERE slot_name = %(slot)s AND last_lsn <= "
                       "(SELECT min(retained_after) FROM applier.change_tables WHERE slot_name = %(slot)s)",
                       {"slot": slot})
        return dropped

    # -- retiring a replica (applier drop) ---------------------------------------------------------
    def remove(self, slot: str) -> list[str]:
        """Drop the slot's change tables (their partitions with them) and every row describing
        them (``change_tables``, ``change_partitions``, ``change_commits``), then the
        ``applier_changes`` schema when no other slot's change table is left in it; in the
        caller's transaction. What was removed, for people."""
        if not self.exists():
            return []
        removed = []
        for (name,) in self._rows("SELECT change_table FROM applier.change_tables "
                                  "WHERE slot_name = %(slot)s ORDER BY id", {"slot": slot}):
            self._rows(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(SCHEMA, name)))
            parts = self._rows("WITH gone AS (DELETE FROM applier.change_partitions WHERE "
                               "change_table = %(name)s RETURNING 1) SELECT count(*) FROM gone",
                               {"name": name})[0][0]
            removed.append(f"dropped change table {sql.Identifier(SCHEMA, name).as_string()} "
                           f"({parts} partition(s))")
        for table in ("change_tables", "change_commits"):
            count = self._rows(sql.SQL("WITH gone AS (DELETE FROM {} WHERE slot_name = %(slot)s "
                                       "RETURNING 1) SELECT count(*) FROM gone").format(
                sql.Identifier("applier", table)), {"slot": slot})[0][0]
            if count:
                removed.append(f"deleted {count} row(s) of applier.{table}")
        if self._rows("SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s", (SCHEMA,)) \
                and not self._rows("SELECT 1 FROM applier.change_tables LIMIT 1") \
                and not self._rows("SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
                                   "ON n.oid = c.relnamespace WHERE n.nspname = %s LIMIT 1", (SCHEMA,)):
            self._rows(sql.SQL("DROP SCHEMA {}").format(sql.Identifier(SCHEMA)))
            removed.append(f"dropped schema {SCHEMA}")
        return removed

    # -- readers -----------------------------------------------------------------------------------
    def history(self, schema: str, table: str, slots: Iterable[str]) -> list[RetainedHistory]:
        """The change tables of ``schema.table`` for any of ``slots``, as this snapshot sees them."""
        if not self.exists():
            return []
        found = self._rows(
            "SELECT slot_name, change_table, retained_after::text, stopped_lsn::text "
            "FROM applier.change_tables WHERE table_schema = %(schema)s AND table_name = %(table)s "
            "AND slot_name = ANY(%(slots)s) ORDER BY slot_name",
            {"schema": schema, "table": table, "slots": list(slots)})
        return [RetainedHistory(s, n, LSN.parse(r), LSN.parse(x) if x else None) for s, n, r, x in found]

    def status(self, slot: str) -> list[FeedStatus]:
        if not self.exists():
            return []
        result = []
        for change_table in self.load(slot):
            stats = self._rows(
                "SELECT count(*), COALESCE(sum(GREATEST(c.reltuples, 0)), 0)::int8, "
                "COALESCE(sum(pg_catalog.pg_total_relation_size(c.oid)), 0)::int8 "
                "FROM pg_catalog.pg_partition_tree(%(table)s::regclass) t "
                "JOIN pg_catalog.pg_class c ON c.oid = t.relid WHERE t.isleaf",
                {"table": change_table.ident.as_string()})[0]
            result.append(FeedStatus(change_table.display, change_table.ident.as_string(),
                                     change_table.retained_after, change_table.stopped_lsn,
                                     int(stats[0]) - 1, int(stats[1]), int(stats[2])))
        return result


def _number(name: str) -> int:
    """The number in a regular partition's name (``<id>.<number>:...``)."""
    return int(name.split(":", 1)[0].split(".", 1)[1])
