"""The recorded position of a slot: the last source transaction durably applied on the target.

Read with psycopg alone (no SQLAlchemy), so that ``applier run`` can read it and start its
replication stream before the rest of the worker is loaded (``applier/headstart.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from ..protocol.lsn import LSN

__all__ = ["AppliedPosition", "read_position"]


@dataclass
class AppliedPosition:
    """The last source transaction durably applied on the target."""

    commit_lsn: LSN
    end_lsn: LSN


def read_position(conn: psycopg.Connection, slot: str) -> AppliedPosition | None:
    """The slot's recorded position on the target; None when nothing was applied for it yet.
    Raises ``psycopg.errors.UndefinedTable`` before the bookkeeping schema exists."""
    row = conn.execute("SELECT commit_lsn::text, end_lsn::text FROM applier.progress "
                       "WHERE slot_name = %s", (slot,)).fetchone()
    if row is None:
        return None
    return AppliedPosition(LSN.parse(row[0]), LSN.parse(row[1]))
