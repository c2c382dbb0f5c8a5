"""One source position at which both sides are read (and a repair written): the command's side
of the position hold (``progress.holds``; the worker's side is ``worker.requests``).

Owns the sequence: take the slot's hold lock and ask the worker to stop at its next transaction
boundary; once it has (so it cannot pass the position about to be chosen), create a temporary
slot with an exported snapshot on the source, import it into the caller's source session (the
slot's consistent point P is then the snapshot's exact position: it shows every source
transaction committing before P and none after), and ask the worker to apply on up to P and
stop before the first transaction committing at or after P. ``reached`` waits until it has: the
target then holds exactly what the source snapshot shows, until ``release``. The worker stops
only for the moment the slot is created and for what the caller does between ``reached`` and
the end (take a snapshot of the target, or write a repair). Must never write to the source, or
to the target outside ``applier.position_holds``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..connections import connect
from ..errors import ApplierError
from ..progress import holds
from ..progress.lock import lock_holder
from ..protocol.lsn import LSN
from ..sync.snapshot import ExportedSnapshot, temporary_slot_name
from .report import VerifyError

__all__ = ["Held", "NoPositionSnapshot", "held_position", "worker_running"]

log = logging.getLogger(__name__)

#: Seconds between looks at the worker's answer.
ANSWER_POLL = 0.01


def worker_running(conn: psycopg.Connection[Any], slot: str) -> bool:
    """A worker holds ``slot``'s lock on the target ``conn`` connects to."""
    return lock_holder(conn, slot) is not None


class NoPositionSnapshot(VerifyError):
    """The source would not give a snapshot with a known position (a temporary slot): no
    REPLICATION privilege, no free slot or WAL sender. Nothing was held."""


@dataclass
class Held:
    """The position and how far the worker has got."""

    slot: str
    position: LSN
    timeout: float
    _control: psycopg.Connection[Any]
    _deadline: float
    applied: LSN | None = None

    def reached(self) -> None:
        """Wait until the worker holds before ``position``: the target then holds exactly the
        source transactions committing before it."""
        state = _answer(self._control, self.slot, 2, self._deadline, self.timeout)
        self.applied = state.applied_commit_lsn


@contextmanager
def held_position(source_dsn: str, target_dsn: str, slot: str, *, timeout: float, purpose: str,
                  source: psycopg.Connection[Any]) -> Iterator[Held]:
    """Import into ``source`` (a session with no transaction open: autocommit, or REPEATABLE
    READ) a snapshot whose position the worker of ``slot`` then applies up to; released on
    leaving. The worker lets go by itself ``timeout`` seconds after each request."""
    deadline = time.monotonic() + timeout
    control = connect(target_dsn, autocommit=True, application_name=f"applier {purpose} (hold)")
    try:
        if not holds.take_lock(control, slot, timeout):
            raise VerifyError(f"another applier verify holds slot {slot!r}'s worker; try again "
                              "once it ended")
        try:
            holds.request(control, slot, purpose, timeout)
            _answer(control, slot, 1, deadline, timeout)
            position = _import_snapshot(source_dsn, slot, purpose, source)
            holds.move(control, slot, 2, position, timeout)
            log.info("worker of slot %r asked to hold before %s", slot, position)
            yield Held(slot, position, timeout, control, deadline)
        finally:
            if not control.closed:
                holds.release(control, slot)
    finally:
        control.close()


def _import_snapshot(source_dsn: str, slot: str, purpose: str,
                     source: psycopg.Connection[Any]) -> LSN:
    try:
        snapshot = ExportedSnapshot.create(source_dsn, temporary_slot_name(slot, purpose),
                                           temporary=True, two_phase=False)
    except ApplierError as exc:
        raise NoPositionSnapshot(f"the source gave no snapshot with a known position ({exc}); it "
                                 "takes a role with REPLICATION and room for one more replication "
                                 "slot and WAL sender") from exc
    try:
        if source.autocommit:
            source.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        source.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot.name)))
    finally:
        snapshot.close()  # the imported snapshot stays: the slot and its export can go
    return snapshot.consistent_point


def _answer(control: psycopg.Connection[Any], slot: str, step: int, deadline: float,
            timeout: float) -> holds.HoldState:
    """Wait until the worker answered ``step``."""
    waiting: Callable[[], str] = lambda: ("the worker is running but did not get there (is it "  # noqa: E731
                                          "far behind, or stopped on an error?)"
                                          if worker_running(control, slot) else
                                          "no worker is running for it on this target")
    while True:
        state = holds.read(control, slot)
        if state is None:
            raise VerifyError(f"the worker of slot {slot!r} let the hold go before it was done "
                              f"(it lasted over {timeout:g} s)")
        if state.acked_step == step:
            return state
        if time.monotonic() > deadline:
            raise VerifyError(f"slot {slot!r}: the worker did not reach the position within "
                              f"{timeout:g} s: {waiting()}; see --timeout")
        time.sleep(ANSWER_POLL)
