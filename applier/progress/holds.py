"""The position hold: how ``applier verify`` (and ``verify --repair``) and the running worker agree
on one source position at which the target holds exactly what the source held.

Owns the rows of ``applier.position_holds`` and the advisory lock that says their owner still
runs. One request per slot: the command takes the hold lock (a session advisory lock, so it dies
with the command's connection), writes the request, and raises ``step`` each time it changes it;
the worker reads the request (``poll``), holds as asked, and answers a step with ``ack`` once it
holds: before the first source transaction committing at or after ``hold_lsn``, or (``hold_lsn``
NULL, a pause) at its next transaction boundary. The worker lets go when the row is gone, its
owner's lock is gone (the command was killed) or it expired. Must never decide when to hold or
apply anything: ``worker.requests`` and ``verify.held`` do.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import psycopg

from ..protocol.lsn import LSN
from ..queries import rows
from .schema import LOCK_NAMESPACE

__all__ = ["CHANNEL", "HoldRequest", "HoldState", "ack", "drop", "lock_key", "move", "notify", "poll",
           "read", "release", "request", "take_lock"]

#: The channel a new request is announced on (payload: the slot), so that a worker listening
#: there looks at once instead of at its next poll.
CHANNEL = "applier_requests"


def lock_key(slot: str) -> int:
    """The second key of the hold lock of ``slot`` (the first is ``LOCK_NAMESPACE``); not the
    worker lock's (``progress.lock``)."""
    return zlib.crc32(b"position hold " + slot.encode()) - 2**31  # advisory keys are signed int4


@dataclass(frozen=True)
class HoldRequest:
    """A request as the worker reads it."""

    step: int
    hold_lsn: LSN | None  # None: hold at the next transaction boundary
    alive: bool           # the owner still runs and the request has not expired


@dataclass(frozen=True)
class HoldState:
    """A request as its owner reads it back: the worker's answer."""

    step: int
    acked_step: int | None
    frontier_lsn: LSN | None        # the worker applied every transaction before it, none after
    applied_commit_lsn: LSN | None  # the last source transaction applied


def _lsn(text: str | None) -> LSN | None:
    return None if text is None else LSN.parse(text)


# -- the owner (a command) ---------------------------------------------------------------------

def take_lock(conn: psycopg.Connection, slot: str, timeout: float) -> bool:
    """Take the slot's hold lock on ``conn`` (autocommit), waiting up to ``timeout`` seconds while
    another command holds it; False when it did not come free."""
    conn.execute(f"SET lock_timeout = '{max(1, int(timeout * 1000))}ms'")
    try:
        conn.execute("SELECT pg_catalog.pg_advisory_lock(%s, %s)", (LOCK_NAMESPACE, lock_key(slot)))
    except psycopg.errors.LockNotAvailable:
        return False
    finally:
        conn.execute("SET lock_timeout TO DEFAULT")
    return True


def request(conn: psycopg.Connection, slot: str, purpose: str, expires: float) -> None:
    """With the hold lock: a new request (step 1, a pause), replacing one a dead owner left."""
    conn.execute("DELETE FROM applier.position_holds WHERE slot_name = %s", (slot,))
    conn.execute("INSERT INTO applier.position_holds (slot_name, purpose, owner_pid, step, hold_lsn, "
                 "expires_at) VALUES (%s, %s, pg_catalog.pg_backend_pid(), 1, NULL, "
                 "clock_timestamp() + %s * interval '1 second')", (slot, purpose, expires))
    notify(conn, slot)


def notify(conn: Any, slot: str) -> None:
    """Announce a request for ``slot`` (at the commit of the caller's transaction)."""
    rows(conn, "SELECT pg_catalog.pg_notify(%(channel)s, %(slot)s)", {"channel": CHANNEL, "slot": slot})


def move(conn: psycopg.Connection, slot: str, step: int, hold_lsn: LSN, expires: float) -> None:
    """Ask the worker to hold before ``hold_lsn`` instead (``step`` one more than the last)."""
    conn.execute("UPDATE applier.position_holds SET step = %s, hold_lsn = %s::pg_lsn, "
                 "expires_at = clock_timestamp() + %s * interval '1 second' WHERE slot_name = %s",
                 (step, str(hold_lsn), expires, slot))


def read(conn: psycopg.Connection, slot: str) -> HoldState | None:
    """The request and the worker's answer; None when the worker dropped it (it expired)."""
    row = conn.execute("SELECT step, acked_step, frontier_lsn::text, applied_commit_lsn::text "
                       "FROM applier.position_holds WHERE slot_name = %s", (slot,)).fetchone()
    if row is None:
        return None
    return HoldState(row[0], row[1], _lsn(row[2]), _lsn(row[3]))


def release(conn: psycopg.Connection, slot: str) -> None:
    """The worker may go on; the lock is let go."""
    conn.execute("DELETE FROM applier.position_holds WHERE slot_name = %s", (slot,))
    conn.execute("SELECT pg_catalog.pg_advisory_unlock(%s, %s)", (LOCK_NAMESPACE, lock_key(slot)))


# -- the worker ----------------------------------------------------------------------------------

_POLL = """
    SELECT 'resync', r.schema_name, r.table_name, NULL::int, NULL::text, NULL::bool
    FROM applier.publication_tables r WHERE r.slot_name = %(slot)s AND r.state = 'resync'
    UNION ALL
    SELECT 'hold', NULL, NULL, h.step, h.hold_lsn::text,
           h.expires_at > clock_timestamp() AND EXISTS (
               SELECT FROM pg_catalog.pg_locks l WHERE l.locktype = 'advisory' AND l.granted
               AND l.pid = h.owner_pid AND l.classid = %(ns)s::oid AND l.objid = %(key)s::oid
               AND l.objsubid = 2)
    FROM applier.position_holds h WHERE h.slot_name = %(slot)s
"""


def poll(conn: psycopg.Connection, slot: str) -> tuple[list[tuple[str, str]], HoldRequest | None]:
    """In one round trip: the tables ``applier resync`` marked, and the hold request, if any."""
    params = {"slot": slot, "ns": LOCK_NAMESPACE, "key": lock_key(slot) & 0xFFFFFFFF}
    tables: list[tuple[str, str]] = []
    hold = None
    for kind, schema, name, step, hold_lsn, alive in conn.execute(_POLL, params).fetchall():
        if kind == "resync":
            tables.append((schema, name))
        else:
            hold = HoldRequest(step, _lsn(hold_lsn), bool(alive))
    return tables, hold


def ack(conn: psycopg.Connection, slot: str, step: int, frontier: LSN, applied: LSN) -> None:
    """The worker holds as step ``step`` asked: every transaction before ``frontier`` applied,
    none after; ``applied``: the last one's commit LSN."""
    conn.execute("UPDATE applier.position_holds SET acked_step = %s, frontier_lsn = %s::pg_lsn, "
                 "applied_commit_lsn = %s::pg_lsn, acked_at = clock_timestamp() "
                 "WHERE slot_name = %s AND step = %s",
                 (step, str(frontier), str(applied), slot, step))


def drop(conn: psycopg.Connection, slot: str, step: int) -> None:
    """The worker lets go of a request whose owner is gone or which expired."""
    conn.execute("DELETE FROM applier.position_holds WHERE slot_name = %s AND step = %s", (slot, step))
