"""What the running worker takes from the target's bookkeeping: tables ``applier resync`` marked
for a new copy, and a position ``applier verify`` (or ``verify --repair``) asks it to hold at.

Owns polling for both (one small query every ``POLL_SECONDS``, on a target connection of its
own, from the stream loop between source transactions; once at the session's start, before
anything is applied), starting a resync (a copy beside the stream, ``resync.RunningCopy``, or a
new session that copies first: ``publication``), and holding. A hold asks the worker to apply
every source transaction committing before ``hold_lsn`` and none at or after it until the
request is gone (``progress.holds``); ``hold_lsn`` NULL asks it to stop at its next transaction
boundary. The worker reaches the position either at the Begin of a transaction at or after it
(``Applier.hold``) or between transactions once a keepalive's WAL end is past it (nothing before
it is then left to come), commits what it holds, answers, and waits, keeping the replication
connection alive and honouring SIGTERM. While a hold is asked for, every transaction takes the
ordinary path (the lane is off), so the test costs one comparison per transaction; with none
asked for, the stream loop pays one clock reading per batch of messages. Must never apply
anything itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import psycopg
from psycopg import sql

from .. import faults
from ..apply.dispatch import NO_HOLD, Applier
from ..connections import connect
from ..errors import Cause, TargetError
from ..faults import FailPoint
from ..progress import holds
from ..progress.holds import HoldRequest
from ..protocol.lsn import LSN
from .loop import StopRequested
from .publication import PublicationFollower
from .resync import RunningCopy

if TYPE_CHECKING:
    from ..source import ReplicationStream

__all__ = ["POLL_SECONDS", "Requests"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between looks at the bookkeeping for requests while streaming, and between looks for
#: a notification that one was made (``holds.CHANNEL``: one non-blocking read of the socket).
POLL_SECONDS = 1.0
NOTICE_SECONDS = 0.05
#: Seconds between looks at the request while holding (the command waits for each answer).
HELD_POLL = 0.01
#: Seconds between keepalives asked for while a position to hold at is not known to be reached.
KEEPALIVE_ASK = 0.05


class Requests:
    def __init__(self, target_dsn: str, slot: str, applier: Applier, stream: ReplicationStream,
                 publications: PublicationFollower, stopping: Callable[[], bool],
                 early_open: Callable[[], bool]) -> None:
        self.target_dsn = target_dsn
        self.slot = slot
        self.applier = applier
        self.stream = stream
        self.publications = publications
        self.stopping = stopping
        #: A streamed transaction is open in the early session (a copy cannot start beside it).
        self.early_open = early_open
        self._conn: psycopg.Connection | None = None
        self._next_poll = 0.0
        self._next_notice = 0.0
        self._asked = 0.0
        self._hold: HoldRequest | None = None
        self.copy: RunningCopy | None = None
        applier.on_hold = self._reached
        applier.on_copy_wait = self._wait_for_copy

    # -- the stream loop ---------------------------------------------------------------------------
    def start(self) -> None:
        """At the session's start: honour a hold asked for from the first transaction on."""
        self._poll()

    def between_transactions(self) -> None:
        """The stream loop, between source transactions."""
        copy = self.copy
        if copy is not None and copy.done.is_set():
            copy.check()
            self.publications.copied(copy.keys)
            self.copy = None
        now = time.monotonic()
        if now >= self._next_notice:
            self._next_notice = now + NOTICE_SECONDS
            if self._notified():
                self._next_poll = now
        if now >= self._next_poll:
            tables = self._poll()
            if tables and self.copy is None:
                self._resync(tables)
        hold = self._hold
        if hold is None:
            return
        self.applier.flush()  # short-lived: a verify's request is answered within moments
        frontier = LSN(max(self.stream.keepalive_wal_end, self.applier.tx.applied.end_lsn))
        if hold.hold_lsn is None or frontier >= hold.hold_lsn:
            self._reached(frontier)
        elif now - self._asked >= KEEPALIVE_ASK:
            # Its WAL end says when nothing before the position is left to come.
            self.stream.send_status(reply_requested=True)
            self._asked = now

    def close(self) -> None:
        if self.copy is not None:
            self.copy.close()
        if self._conn is not None:
            self._conn.close()

    # -- polling -------------------------------------------------------------------------------------
    def _query(self, step: Callable[..., T], *args: object) -> T:
        """``step(connection, slot, *args)`` on the requests' connection."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self.target_dsn, autocommit=True,
                                     application_name=f"applier {self.slot} (requests)")
                self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(holds.CHANNEL)))
            return step(self._conn, self.slot, *args)
        except psycopg.Error as exc:
            if self._conn is not None:
                self._conn.close()
            raise TargetError(f"target: reading the requests of slot {self.slot!r} failed: "
                              f"{str(exc).strip()}", cause=Cause.LOST_CONNECTION) from exc

    def _notified(self) -> bool:
        """A request was announced since the last look (for any slot: the poll tells)."""
        conn = self._conn
        if conn is None or conn.closed:
            return False
        pgconn = conn.pgconn
        try:
            pgconn.consume_input()
        except psycopg.Error:
            return True  # the poll reconnects, or says what is wrong
        heard = False
        while pgconn.notifies() is not None:
            heard = True
        return heard

    def _poll(self) -> list[tuple[str, str]]:
        """The tables marked for resync; the hold request taken in (or let go)."""
        self._next_poll = time.monotonic() + POLL_SECONDS
        tables, hold = self._query(holds.poll)
        if hold is not None and not hold.alive:
            self._query(holds.drop, hold.step)
            log.info("a hold asked for by a verify that is gone (or expired) is let go")
            hold = None
        self._take(hold)
        return tables

    def _take(self, hold: HoldRequest | None) -> None:
        if hold is None:
            if self._hold is not None:
                log.info("held position let go; applying on")
            self.applier.hold_before = NO_HOLD
        else:
            if self._hold is None:
                log.info("asked to hold %s (verify); the target stops there for a moment",
                         "at the next transaction" if hold.hold_lsn is None
                         else f"before source position {hold.hold_lsn}")
            self.applier.hold_before = hold.hold_lsn if hold.hold_lsn is not None else LSN(0)
        self._hold = hold

    # -- holding ---------------------------------------------------------------------------------------
    def _reached(self, frontier: LSN) -> None:
        """Everything before ``frontier`` is applied and committed, nothing at or after it:
        answer the request and wait until it moves past ``frontier`` or is gone."""
        while True:
            hold = self._hold
            if hold is None:
                return
            if hold.hold_lsn is not None and frontier < hold.hold_lsn:
                return  # not there yet: apply on
            applied = self.applier.tx.applied.commit_lsn
            self._query(holds.ack, hold.step, frontier, applied)
            if hold.hold_lsn is not None:
                self.applier.counts["holds"] += 1
                faults.hit(FailPoint.AFTER_HOLD_ACK)
            log.info("holding for verify: applied everything before %s (last commit %s)",
                     frontier, applied)
            while self._hold is not None and self._hold.step == hold.step:
                if self.stopping():
                    raise StopRequested()
                self.stream.send_status_if_due()
                time.sleep(HELD_POLL)
                self._poll()

    # -- resync ------------------------------------------------------------------------------------------
    def _resync(self, tables: list[tuple[str, str]]) -> None:
        """Copy the tables marked by applier resync: beside the stream when it can, else in a new
        session before streaming (raises ``PublicationChanged``)."""
        self.applier.flush()  # nothing of this worker may be open while the snapshot is taken
        feed = self.applier.tx.feed
        # A recorded table's change history starts again with its copy, at a session's start.
        recorded = feed is not None and any(table in feed.tables for table in tables)
        copy = self.publications.resync(tables, beside_stream=not recorded and not self.early_open())
        if copy is None:
            return
        self.copy = copy
        copy.start()
        self._wait(copy.opened, copy)  # the tables emptied and the snapshot taken
        sync_lsn = copy.sync_lsn
        if sync_lsn is None:
            copy.check()  # it failed
            raise StopRequested()  # it was stopped
        faults.hit(FailPoint.RESYNC_COPYING)
        assert self.applier.sync_filter is not None
        self.applier.sync_filter.copying(copy.keys, sync_lsn, copy.copied)

    def _wait_for_copy(self) -> None:
        """A change to a table being copied, committed after its snapshot: wait for the copy."""
        copy = self.copy
        if copy is None:
            return
        log.info("waiting for the copy of %s: a change to it committed after its snapshot "
                 "comes next", copy.names)
        self._wait(copy.done, copy)
        copy.check()

    def _wait(self, event: threading.Event, copy: RunningCopy) -> None:
        """Until ``event`` (or the copy's end), keeping the replication connection alive."""
        while not event.wait(0.05) and not copy.done.is_set():
            if self.stopping():
                raise StopRequested()
            self.stream.send_status_if_due()
