"""Slot administration over an ordinary (non-replication) source connection, and whether a new
slot is a failover slot.

Must never create a slot anywhere but where it is asked to, nor decide whether one may be
created (the worker and sync do, from what the target has recorded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..errors import Cause, SourceError, cause_of
from ..protocol.lsn import LSN
from ..queries import rows
from .options import UnsupportedOption

__all__ = ["SlotInfo", "create_slot", "failover_slot", "publications_missing", "slot_from_row",
           "slot_info", "slot_query"]


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
    #: PostgreSQL 17+ (None before): synchronised to standbys with sync_replication_slots.
    failover: bool | None = None
    #: PostgreSQL 17+: a copy the slot sync worker made from a primary (on a standby), or one
    #: that survived the standby's promotion (on a primary that was one).
    synced: bool | None = None


#: The view's columns by name through to_jsonb, so one query serves every version: ``failover``
#: and ``synced`` (17+) come back NULL where the view has no such column.
_SLOT_QUERY = ("SELECT s.slot_name::text, s.plugin::text, s.database::text, s.two_phase, "
               "s.active_pid, s.confirmed_flush_lsn::text, s.restart_lsn::text, s.active, "
               "s.wal_status, (pg_catalog.to_jsonb(s) ->> 'failover')::bool, "
               "(pg_catalog.to_jsonb(s) ->> 'synced')::bool "
               "FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = {slot}")


def slot_query(slot: str | None = None) -> sql.Composed:
    """The query of ``slot_info``: with the parameter ``%(slot)s``, or with ``slot`` written in
    (a replication connection takes no parameters)."""
    return sql.SQL(_SLOT_QUERY).format(
        slot=sql.Placeholder("slot") if slot is None else sql.Literal(slot))


def slot_info(conn: Any, slot: str) -> SlotInfo | None:
    """The slot as ``pg_replication_slots`` shows it (a psycopg or a SQLAlchemy connection)."""
    found = rows(conn, slot_query(), {"slot": slot})
    return slot_from_row(found[0]) if found else None


def slot_from_row(row: Any) -> SlotInfo:
    """A ``SlotInfo`` from a row of ``slot_query``."""
    return SlotInfo(row[0], row[1], row[2], bool(row[3]), row[4],
                    LSN.parse(row[5]) if row[5] else None, LSN.parse(row[6]) if row[6] else None,
                    bool(row[7]), row[8], row[9], row[10])


def failover_slot(requested: bool | None, server_version: int, two_phase: bool) -> bool:
    """Whether a new slot is a failover slot: as ``requested`` (``--failover-slot``), by default
    wherever the source supports it. PostgreSQL 17 added failover slots, but its standbys do not
    learn where a slot's two-phase decoding began (18 synchronises it), and a promoted 17
    standby may then skip prepared transactions: so on 17 not for a two-phase slot by default,
    and never when asked for one. Raises ``UnsupportedOption`` for what was asked of a source
    that cannot do it."""
    major = server_version // 10000
    if major >= 18 or (major == 17 and not two_phase):
        return requested is not False
    if requested:
        if major == 17:
            raise UnsupportedOption("--failover-slot with --two-phase needs PostgreSQL 18 or later "
                                    "(a promoted 17 standby may skip prepared transactions of a "
                                    "two-phase slot); the source runs PostgreSQL 17: leave one "
                                    "of them out")
        raise UnsupportedOption(f"--failover-slot needs PostgreSQL 17 or later (failover slots); "
                                f"the source runs PostgreSQL {major}: leave it out, and after a "
                                "failover of the source start a new replica (applier sync)")
    return False


def create_slot(conn: psycopg.Connection, slot: str, two_phase: bool,
                failover: bool = False) -> SlotInfo:
    """Create a pgoutput logical slot (two-phase and failover when asked and supported:
    ``failover_slot`` decides the latter)."""
    if two_phase and conn.info.server_version < 150000:
        raise SourceError("two-phase slots need PostgreSQL 15 or later", cause=Cause.NEEDS_OPERATOR)
    args = "%s, 'pgoutput', false, %s" + (", true" if failover else "")
    try:
        conn.execute(f"SELECT pg_catalog.pg_create_logical_replication_slot({args})",
                     (slot, two_phase))
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
