"""The snapshot every copy session reads from, tied to a slot's consistent point.

Owns the replication connection that creates a slot with ``SNAPSHOT 'export'`` and keeps the
exported snapshot alive (it stays importable only while that connection is open and runs no other
command), and opening source sessions that import it. A fresh sync creates the worker's own slot
this way, so the copy reflects exactly the slot's start point. A resumed sync (the slot exists,
its snapshot died with the previous process) creates a TEMPORARY slot the same way: its
consistent point becomes the sync LSN of every table copied now, and the apply skips those
tables' changes committed before it. Must never run anything on the replication connection after
the slot is created, and never confirm or consume the slot.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..errors import Cause, SourceError
from ..progress.records import SourceIdentity
from ..protocol.lsn import LSN
from ..quoting import ident
from ..source.stream import classify, replication_conninfo

__all__ = ["ExportedSnapshot", "source_session", "temporary_slot_name"]

log = logging.getLogger(__name__)


def source_session(dsn: str, client_encoding: str, application_name: str) -> psycopg.Connection:
    """An ordinary source connection with the settings that make text output round-trip exactly
    (the replication stream's own) and an empty search_path, so catalog expressions come back
    schema-qualified and no user object can hijack the copy queries."""
    params = conninfo_to_dict(replication_conninfo(dsn, client_encoding))
    del params["replication"]
    params["application_name"] = application_name
    conn = psycopg.connect(make_conninfo("", **params), autocommit=True)
    conn.execute("SELECT pg_catalog.set_config('search_path', '', false)")
    return conn


def temporary_slot_name(slot: str, purpose: str = "sync") -> str:
    """A name for a temporary slot taken for ``slot`` (a resumed sync's, a verify's): valid, at
    most 63 bytes, unique per process and purpose."""
    stem = "".join(ch if ch.isalnum() and ch.isascii() else "_" for ch in slot.lower())[:40]
    return f"{stem}_{purpose}_{os.getpid()}"


@dataclass
class ExportedSnapshot:
    """A slot created with an exported snapshot; ``close()`` ends the snapshot (and drops the slot
    when it is temporary)."""

    slot: str
    temporary: bool
    consistent_point: LSN
    name: str
    #: The server the slot was created on (IDENTIFY_SYSTEM just before).
    source: SourceIdentity
    _conn: psycopg.Connection

    @classmethod
    def create(cls, dsn: str, slot: str, *, temporary: bool, two_phase: bool,
               failover: bool = False) -> ExportedSnapshot:
        """``failover``: a failover slot (PostgreSQL 17+; ``slots.failover_slot`` decides)."""
        conn = psycopg.connect(replication_conninfo(dsn), autocommit=True)
        version = conn.info.server_version
        command = f"CREATE_REPLICATION_SLOT {ident(slot)}"
        if temporary:
            command += " TEMPORARY"
        if version >= 150000:
            options = (["SNAPSHOT 'export'"] + (["TWO_PHASE"] if two_phase else [])
                       + (["FAILOVER"] if failover else []))
            command += f" LOGICAL pgoutput ({', '.join(options)})"
        elif two_phase:
            conn.close()
            raise SourceError("two-phase slots need PostgreSQL 15 or later", cause=Cause.NEEDS_OPERATOR)
        else:
            command += " LOGICAL pgoutput EXPORT_SNAPSHOT"
        try:
            identified = conn.execute("IDENTIFY_SYSTEM").fetchone()
            assert identified is not None
            source = SourceIdentity(str(identified[0]), int(identified[1]))
            row = conn.execute(command).fetchone()
        except psycopg.Error as exc:
            conn.close()
            error = classify(exc)
            raise SourceError(f"source: cannot create slot {slot!r}: {str(exc).strip()}",
                              cause=error.cause, sqlstate=error.sqlstate) from exc
        assert row is not None
        snapshot = cls(slot, temporary, LSN.parse(row[1]), row[2], source, conn)
        log.info("created %s%sslot %r at %s with exported snapshot %s",
                 "temporary " if temporary else "", "failover " if failover else "", slot,
                 snapshot.consistent_point, snapshot.name)
        return snapshot

    def begin(self, conn: psycopg.Connection) -> None:
        """Start a read-only REPEATABLE READ transaction on ``conn`` that sees this snapshot."""
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(self.name)))

    def close(self) -> None:
        self._conn.close()
