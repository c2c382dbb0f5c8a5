"""Slot administration over an ordinary (non-replication) source connection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from ..errors import Cause, SourceError, cause_of
from ..protocol.lsn import LSN
from ..queries import rows

__all__ = ["SlotInfo", "slot_info", "create_slot", "publications_missing"]


@dataclass(frozen=True)
class SlotInfo:
    name: str
    plugin: str | None
    database: str | None
    two_phase: bool
    active_pid: int | None
    confirmed_flush_lsn: LSN | None
    restart_lsn: LSN | None
    active: bool = False
    wal_status: str | None = None


def slot_info(conn: Any, slot: str) -> SlotInfo | None:
    """The slot as ``pg_replication_slots`` shows it (a psycopg or a SQLAlchemy connection)."""
    found = rows(conn, "SELECT slot_name, plugin, database, two_phase, active_pid, "
                       "confirmed_flush_lsn::text, restart_lsn::text, active, wal_status "
                       "FROM pg_catalog.pg_replication_slots WHERE slot_name = %(slot)s",
                 {"slot": slot})
    if not found:
        return None
    row = found[0]
    return SlotInfo(row[0], row[1], row[2], bool(row[3]), row[4],
                    LSN.parse(row[5]) if row[5] else None, LSN.parse(row[6]) if row[6] else None,
                    bool(row[7]), row[8])


def create_slot(conn: psycopg.Connection, slot: str, two_phase: bool) -> SlotInfo:
    """Create a pgoutput logical slot (two_phase when asked and supported)."""
    if two_phase and conn.info.server_version < 150000:
        raise SourceError("two-phase slots need PostgreSQL 15 or later", cause=Cause.NEEDS_OPERATOR)
    args = "%s, 'pgoutput', false, true" if two_phase else "%s, 'pgoutput'"
    try:
        conn.execute(f"SELECT pg_catalog.pg_create_logical_replication_slot({args})", (slot,))
    except psycopg.Error as exc:
        raise SourceError(f"source: cannot create slot {slot!r}: {str(exc).strip()}",
                          cause=cause_of(exc, side="source") or Cause.NEEDS_OPERATOR,
                          sqlstate=exc.sqlstate) from exc
    info = slot_info(conn, slot)
    assert info is not None
    return info


def publications_missing(conn: psycopg.Connection, publications: list[str]) -> list[str]:
    rows = conn.execute("SELECT pubname FROM pg_catalog.pg_publication WHERE pubname = ANY(%s)",
                        (publications,)).fetchall()
    found = {row[0] for row in rows}
    return [name for name in publications if name not in found]
