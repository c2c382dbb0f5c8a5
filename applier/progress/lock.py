"""The single-worker lock: one worker per slot and target, ever.

Owns a session advisory lock per slot on the target, held on its own connection for the worker's
lifetime (PostgreSQL releases it if that connection dies, so a crashed worker never blocks its
successor). Must never touch the bookkeeping rows.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import psycopg

from ..connections import connect
from ..errors import ApplierError, Cause, TargetError
from ..queries import rows
from .schema import LOCK_NAMESPACE

__all__ = ["AlreadyRunning", "LockHolder", "WorkerLock", "lock_holder"]


class AlreadyRunning(ApplierError):
    """Another worker holds the slot's lock on this target."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.NEEDS_OPERATOR)


@dataclass(frozen=True)
class LockHolder:
    """The target session holding a slot's lock: a worker or a sync of that slot runs."""

    backend_pid: int
    application_name: str


_HOLDER_SQL = """
    SELECT a.pid, a.application_name FROM pg_catalog.pg_locks l
    JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.classid = %(ns)s::oid AND l.objid = %(key)s::oid
      AND l.objsubid = 2 AND l.database = (SELECT oid FROM pg_catalog.pg_database
                                           WHERE datname = pg_catalog.current_database())
      AND l.granted
"""


def _key(slot: str) -> int:
    return zlib.crc32(slot.encode()) - 2**31  # advisory keys are signed int4


def lock_holder(conn: Any, slot: str) -> LockHolder | None:
    """Who holds ``slot``'s lock on the target ``conn`` is connected to (None: no worker or
    sync of the slot runs against it), read on any connection (psycopg or SQLAlchemy)."""
    found = rows(conn, _HOLDER_SQL, {"ns": LOCK_NAMESPACE, "key": _key(slot) & 0xFFFFFFFF})
    return LockHolder(int(found[0][0]), str(found[0][1] or "")) if found else None


class WorkerLock:
    """A session advisory lock per slot on the target, on a connection of its own."""

    def __init__(self, dsn: str, slot: str) -> None:
        self.dsn = dsn
        self.slot = slot
        self._conn: psycopg.Connection | None = None
        #: The target backend that held the lock for this worker, once it had it.
        self._backend_pid: int | None = None

    def acquire(self) -> None:
        conn = connect(self.dsn, autocommit=True, application_name=f"applier lock {self.slot}")
        key = self._key()
        got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (LOCK_NAMESPACE, key)).fetchone()
        if not got or not got[0]:
            holder = lock_holder(conn, self.slot)
            conn.close()
            if holder and holder.backend_pid == self._backend_pid:
                # This worker's own lock session, whose connection was lost, has not ended yet.
                raise TargetError(f"target: the lock of slot {self.slot!r} is still held by this "
                                  f"worker's lost session (backend pid {holder.backend_pid})",
                                  cause=Cause.BUSY)
            who = (f" (target backend pid {holder.backend_pid}, {holder.application_name!r})"
                   if holder else "")
            raise AlreadyRunning(f"another applier worker is already running for slot {self.slot!r} "
                                 f"on this target{who}; stop it first")
        self._conn = conn
        self._backend_pid = conn.info.backend_pid

    def ensure(self) -> None:
        """Still hold the lock: after its connection was lost (a target restart, a network cut),
        take it again, unless another worker took it meanwhile (``AlreadyRunning``)."""
        conn = self._conn
        if conn is not None and not conn.closed:
            try:
                conn.execute("SELECT 1")
                return
            except psycopg.Error:
                conn.close()
        self._conn = None
        self.acquire()

    def release(self) -> None:
        if self._conn is not None:
            # Unlocked before closing: the server ends a closed session a moment later, and a
            # worker taking over at once (applier sync hands over to it) would find it still held.
            try:
                self._conn.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_NAMESPACE, self._key()))
            except psycopg.Error:
                pass  # a connection already lost holds no lock
            self._conn.close()
            self._conn = None

    def _key(self) -> int:
        return _key(self.slot)
