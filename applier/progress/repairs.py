"""The record of what ``applier resync`` and ``applier verify --repair`` did (``applier.repairs``),
and the ``resync`` state of a table in ``applier.publication_tables`` that asks the worker to
copy it again (and back to ``published`` once copied, unless asked again meanwhile).

Owns that SQL, on whatever connection the caller holds (a psycopg connection or a SQLAlchemy one,
as ``bookkeeping``), inside the caller's transaction: a resync request and its record commit
together, a repair's record commits with its rows. Reads of ``applier.repairs`` on a target whose
schema predates it return nothing. Must never commit, roll back or decide what to repair.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..protocol.lsn import LSN
from ..queries import rows
from .holds import notify
from .records import TableName

__all__ = ["RepairCounts", "RepairTotals", "Repairs"]


@dataclass(frozen=True)
class RepairCounts:
    """Rows a repair wrote to one table."""

    inserted: int
    updated: int
    deleted: int


@dataclass(frozen=True)
class RepairTotals:
    """What the metrics show: repairs and resyncs done, the rows they wrote, resyncs to come."""

    done: dict[str, int]
    rows: dict[str, int]
    pending_resyncs: int


class Repairs:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def _exists(self) -> bool:
        found = rows(self.conn, "SELECT pg_catalog.to_regclass('applier.repairs') IS NOT NULL")
        return bool(found and found[0][0])

    # -- resync -------------------------------------------------------------------------------------
    def request_resync(self, slot: str, tables: Iterable[TableName]) -> None:
        """Mark ``tables`` for a new copy (the worker copies them next) and record the request,
        unless one is already pending for a table; a listening worker hears of it at commit."""
        for schema, name in tables:
            params = {"slot": slot, "schema": schema, "name": name}
            rows(self.conn, "INSERT INTO applier.publication_tables (slot_name, schema_name, "
                            "table_name, state) VALUES (%(slot)s, %(schema)s, %(name)s, 'resync') "
                            "ON CONFLICT (slot_name, schema_name, table_name) DO UPDATE SET "
                            "state = 'resync', changed_at = clock_timestamp()", params)
            rows(self.conn, "INSERT INTO applier.repairs (slot_name, kind, schema_name, table_name, "
                            "state) SELECT %(slot)s, 'resync', %(schema)s, %(name)s, 'requested' "
                            "WHERE NOT EXISTS (SELECT FROM applier.repairs WHERE slot_name = "
                            "%(slot)s AND kind = 'resync' AND schema_name = %(schema)s AND "
                            "table_name = %(name)s AND state = 'requested')", params)
        notify(self.conn, slot)

    def resync_started(self, slot: str, tables: Iterable[TableName]) -> None:
        """The worker starts copying ``tables`` (a copy started again after a crash too)."""
        for schema, name in tables:
            rows(self.conn, "UPDATE applier.repairs SET state = 'copying', started_at = "
                            "clock_timestamp() WHERE slot_name = %(slot)s AND kind = 'resync' AND "
                            "schema_name = %(schema)s AND table_name = %(name)s AND state <> 'done'",
                 {"slot": slot, "schema": schema, "name": name})

    def copies_done(self, slot: str, tables: Iterable[TableName], sync_lsn: LSN) -> None:
        """The copy of ``tables`` from the snapshot at ``sync_lsn`` is committed: published again
        (unless marked for another resync meanwhile, which a later copy makes), and the resync
        recorded as done."""
        for schema, name in tables:
            rows(self.conn, "UPDATE applier.publication_tables SET state = 'published', changed_at = "
                            "clock_timestamp() WHERE slot_name = %(slot)s AND schema_name = "
                            "%(schema)s AND table_name = %(name)s AND state = 'copying'",
                 {"slot": slot, "schema": schema, "name": name})
            rows(self.conn, "UPDATE applier.repairs r SET state = 'done', source_lsn = "
                            "%(lsn)s::pg_lsn, finished_at = clock_timestamp(), inserted = "
                            "(SELECT rows_copied FROM applier.table_sync s WHERE s.slot_name = "
                            "r.slot_name AND s.schema_name = r.schema_name AND s.table_name = "
                            "r.table_name) WHERE slot_name = %(slot)s AND kind = 'resync' AND "
                            "schema_name = %(schema)s AND table_name = %(name)s AND state = 'copying'",
                 {"slot": slot, "schema": schema, "name": name, "lsn": str(sync_lsn)})

    # -- repair -------------------------------------------------------------------------------------
    def record_repair(self, slot: str, table: TableName, source_lsn: LSN,
                      keys: Sequence[Any], counts: RepairCounts) -> None:
        """In the repair's target transaction: ``keys`` of ``table`` were written as the source
        had them at ``source_lsn``."""
        rows(self.conn, "INSERT INTO applier.repairs (slot_name, kind, schema_name, table_name, state, "
                        "source_lsn, keys, inserted, updated, deleted, started_at, finished_at) "
                        "VALUES (%(slot)s, 'repair', %(schema)s, %(name)s, 'done', %(lsn)s::pg_lsn, "
                        "%(keys)s::jsonb, %(inserted)s, %(updated)s, %(deleted)s, now(), "
                        "clock_timestamp())",
             {"slot": slot, "schema": table[0], "name": table[1], "lsn": str(source_lsn),
              "keys": json.dumps(list(keys)), "inserted": counts.inserted,
              "updated": counts.updated, "deleted": counts.deleted})

    # -- reads ----------------------------------------------------------------------------------------
    def latest(self, slot: str, limit: int = 10) -> list[dict[str, Any]]:
        """The latest records for the slot, newest first; the keys cut to the first ten."""
        if not self._exists():
            return []
        columns = ("kind", "schema_name", "table_name", "state", "source_lsn", "keys", "inserted",
                   "updated", "deleted", "requested_at", "started_at", "finished_at")
        found = rows(self.conn, "SELECT kind, schema_name, table_name, state, source_lsn::text, "
                                "keys, inserted, updated, deleted, requested_at, started_at, "
                                "finished_at FROM applier.repairs WHERE slot_name = %(slot)s "
                                "ORDER BY id DESC LIMIT %(limit)s", {"slot": slot, "limit": limit})
        records = []
        for row in found:
            record = dict(zip(columns, row))
            keys = record["keys"]
            if isinstance(keys, list):
                record["key_count"] = len(keys)
                record["keys"] = keys[:10]
            records.append(record)
        return records

    def totals(self, slot: str) -> RepairTotals | None:
        """Counts for the metrics; None before the table exists."""
        if not self._exists():
            return None
        done: dict[str, int] = {"repair": 0, "resync": 0}
        written: dict[str, int] = {"repair": 0, "resync": 0}
        pending = 0
        for kind, state, count, total in rows(
                self.conn, "SELECT kind, state = 'done', count(*), coalesce(sum(coalesce(inserted, 0) "
                           "+ coalesce(updated, 0) + coalesce(deleted, 0)), 0) FROM applier.repairs "
                           "WHERE slot_name = %(slot)s GROUP BY 1, 2", {"slot": slot}):
            if state:
                done[kind] = int(count)
                written[kind] = int(total)
            elif kind == "resync":
                pending += int(count)
        return RepairTotals(done, written, pending)
