"""Applying a streamed transaction while it streams, in a second target session.

Owns the early session: a second connection to the target in which one streamed (large,
in-progress) source transaction at a time is applied as its stream blocks arrive, with a
savepoint where each of its subtransactions begins (rolled back to on that subtransaction's
abort), and committed with its progress row at its Stream Commit, after everything the main
session holds (commit order). PostgreSQL's parallel apply workers (applyparallelworker.c) are
the model; the gain is the same: the target applies the transaction while the source is still
decoding and sending it, instead of all of it after its commit.

The two sessions never run statements at the same time, and which one may write is handed over
explicitly:
- the early session takes over only after the main one committed what it held, so the early
  session never waits for a lock of the main one while the worker waits for it;
- the main one takes over (at its next statement, through the session's ``pending`` hook) only
  after the early session's outstanding statements are done; it may still wait for a lock the
  early session's open transaction holds (a target-only trigger or constraint can make it so),
  and the worker, being single-threaded, would then wait forever. So while an early transaction
  is open the main session runs with a ``lock_timeout``: such a wait ends in an error, the
  session restarts, and that transaction is applied at its commit instead;
- the worker's replication origin (which one session at a time may hold) moves with the right to
  write, so every change is tagged as before.

Must never commit anything but a whole source transaction in its commit order, and never raise
for a failure of its own: it gives up on the transaction instead (rolls it back), and the
assembler, which buffered the transaction all the same, delivers it at its end to the main
session. Errors of the main session (committing what it holds) do propagate.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from datetime import datetime, timezone

from ..assembler import Change, TransactionEnd, TransactionStart, deliver
from ..protocol import LSN, Delete, Insert, Origin, Relation, Type, Update
from .conflicts import ConflictHandler
from .extensions import Extensions
from .messages import MessageSink
from .origins import OriginTag, OriginTracker
from .relations import TargetTable, quote_ident
from .session import TargetError, TargetSession
from .sink import ApplyError, BatchLimits, TargetApplier
from .skipping import SkipRequests

__all__ = ["StreamingApply", "MAIN_LOCK_TIMEOUT"]

log = logging.getLogger(__name__)

#: lock_timeout of the main session while an early transaction is open (see the module text).
MAIN_LOCK_TIMEOUT = "5s"
#: The early transaction's commit LSN is not known before its Stream Commit.
_UNKNOWN_LSN = LSN(2**64 - 1)
_UNKNOWN_TIME = datetime.fromtimestamp(0, timezone.utc)
_ROW_CHANGES = (Insert, Update, Delete)
_ORIGIN_RESET = "SELECT pg_catalog.pg_replication_origin_session_reset()"
_ORIGIN_SETUP = "SELECT pg_catalog.pg_replication_origin_session_setup($1)"


class StreamingApply:
    """Implements ``assembler.EarlyApply`` beside the main session's ``TargetApplier``."""

    def __init__(self, main: TargetApplier, connect: Callable[[], TargetSession],
                 reflect: Callable[[str, str], TargetTable], refused: set[int]) -> None:
        assert main.limits is not None
        self.main = main
        self._connect = connect
        self._reflect = reflect
        tag = main.extensions.origins.tag
        self._origin = tag.name.encode() if tag.name is not None else None
        #: Streamed xids not to apply early again (their early apply ended a session).
        self._refused = refused
        self._xid: int | None = None      # the transaction open here
        self._failed = False              # given up on: it is applied at its end instead
        self._savepoints: list[int] = []  # subxids with a savepoint, oldest first
        #: Relation messages of the open transaction: the server counts them as sent once it
        #: commits, so the main session learns them then (the replay would deliver them).
        self._relations: list[Relation] = []
        self._writing = False             # this session (not the main one) may write now
        self._main_timeout = False        # the main session runs with MAIN_LOCK_TIMEOUT
        # The early session is connected at the first streamed transaction.
        self.session: TargetSession | None = None
        self._applier: TargetApplier | None = None

    @property
    def applier(self) -> TargetApplier:
        assert self._applier is not None
        return self._applier

    def _start(self) -> bool:
        """Connect the early session (once); False if it cannot be."""
        if self.session is not None:
            return not self.session.conn.closed and not self.session.conn.broken
        try:
            session = self.session = self._connect()
        except TargetError as exc:
            log.warning("streamed transactions are applied at their commit: cannot open a second "
                        "target session (%s)", exc)
            return False
        main = self.main
        assert main.limits is not None
        extensions = main.extensions
        conflicts = extensions.conflicts
        self._applier = TargetApplier(
            session, self._reflect, main.slot, main.applied, main.on_commit,
            extensions=Extensions(
                ConflictHandler(session, main.slot, origin_id=conflicts.origin_id,
                                copy_xids=conflicts.copy_xids),
                MessageSink(session, main.slot), OriginTracker(session, main.slot, OriginTag(None)),
                SkipRequests(session, main.slot, None), progress_sql=extensions.progress_sql),
            # Parts go ahead as on the main session; only the Stream Commit commits.
            limits=BatchLimits(sys.maxsize, main.limits.bytes, math.inf),
            track_target_lsn=main.track_target_lsn)
        return True

    # -- EarlyApply ----------------------------------------------------------------------------
    def open(self, xid: int) -> bool:
        main = self.main
        if (self._xid is not None or xid in self._refused
                or (main.sync_filter is not None and main.sync_filter.active)
                or main.extensions.skips.lsn is not None or not self._start()):
            return False
        self._xid = xid
        self._failed = False
        self._take_over()
        if not self._failed:
            try:
                self.applier.applied = main.applied
                self.applier.begin(TransactionStart(xid, _UNKNOWN_LSN, _UNKNOWN_TIME, streamed=True,
                                                    gid=None, end_lsn=None))
            except (ApplyError, TargetError) as exc:
                self._give_up(str(exc))
        if self._failed:
            self._end()
            return False
        log.debug("applying streamed transaction %d as it streams", xid)
        return True

    def changes(self, payloads: list[bytes], start: int, stop: int) -> None:
        if self._failed:
            return
        self._take_over()
        self._apply(lambda: deliver(self.applier, payloads[start:stop]))

    def record(self, msg: Change | Relation | Type | Origin) -> None:
        if self._failed:
            return
        kind = type(msg)
        if kind is Type:
            self.applier.type(msg)  # type: ignore[arg-type]
        elif kind is Relation:
            self._relations.append(msg)  # type: ignore[arg-type]
            self._take_over()  # what the batch holds is sent before the definition changes
            self._apply(lambda: self.applier.relation(msg))  # type: ignore[arg-type]
        elif kind in _ROW_CHANGES:
            self._take_over()
            self._apply(lambda: self.applier.change(msg))  # type: ignore[arg-type]
        else:
            # An Origin (the transaction was itself replicated: origin filtering and tracking
            # decide at its begin), TRUNCATE or a logical message: left to the main session.
            self._give_up(f"it holds a {msg.type_name} message")

    def subtransaction(self, subxid: int) -> None:
        if self._failed:
            return
        self._savepoints.append(subxid)
        self.applier.savepoint(_savepoint(subxid))

    def pause(self) -> None:
        if self._failed or not self._writing:
            return
        self._apply(self.applier.send_part)

    def abort(self, subxid: int) -> None:
        if self._failed or subxid not in self._savepoints:
            return
        self._take_over()
        del self._savepoints[self._savepoints.index(subxid):]
        self._apply(lambda: self.applier.rollback_to_savepoint(_savepoint(subxid)))

    def finish(self, start: TransactionStart, end: TransactionEnd) -> bool:
        main = self.main
        if not self._failed:
            if (end.commit_lsn <= main.applied.commit_lsn or end.commit_lsn <= main.careful_until
                    or main.extensions.skips.lsn is not None):
                # Already applied, to be redone carefully, or perhaps to be skipped: the main
                # session's begin decides, as for any other transaction.
                self._give_up("its commit is not simply applied")
            else:
                self._take_over()
        if not self._failed:
            applier = self.applier
            applier.applied = main.applied
            try:
                applier.commit(end)
                applier.flush()
            except ApplyError as exc:
                if exc.careful_until is None:
                    raise  # a lost connection: whether COMMIT happened is unknown; restart
                self._give_up(str(exc))
        applied = not self._failed
        if applied:
            for relation in self._relations:
                main.relation(relation)
            main.applied = self.applier.applied
            main.applied_counts.update(self.applier.applied_counts)
            main.applied_counts["streamed_early"] += 1
            self.applier.applied_counts.clear()
        self._end()
        return applied

    def cancel(self) -> None:
        if self._xid is None:
            return
        if not self._failed:
            self._give_up("it was aborted or prepared")
        self._end()

    # -- the worker ------------------------------------------------------------------------------
    def close(self) -> None:
        """The replication session ends: roll back, and never apply this transaction early again
        (its early apply may be why the session ended)."""
        if self._xid is not None:
            self._refused.add(self._xid)
        self._xid = None
        if self.main.session.pending == self._hand_back:
            self.main.session.pending = None
        if self.session is None:
            return
        try:
            self.applier.abort_open_transaction()
        finally:
            self.session.close()

    def flushed_wal_lsn(self) -> str:
        """The target's flushed WAL position, asked in the session that may write now (so that
        asking moves nothing between the sessions)."""
        if self._writing and not self._failed:
            try:
                self.applier.settle()
                return self.applier.session.flushed_wal_lsn()
            except (ApplyError, TargetError) as exc:
                self._give_up(str(exc))
        return self.main.session.flushed_wal_lsn()

    # -- handing over the right to write ---------------------------------------------------------
    def _take_over(self) -> None:
        """Make this session the one that writes: the main one commits what it holds first."""
        if self._writing or self._failed:
            return
        main = self.main
        main.flush()
        if self._origin is not None:
            main.session.sql(_ORIGIN_RESET)
            try:
                self.applier.session.sql(_ORIGIN_SETUP, [self._origin])
            except TargetError as exc:
                self._give_up(str(exc))
                main.session.sql(_ORIGIN_SETUP, [self._origin])
                return
        self._writing = True
        main.session.pending = self._hand_back

    def _hand_back(self) -> None:
        """The main session is about to run a statement: this one finishes what it sent and
        gives back the right to write (and the origin)."""
        main_session = self.main.session
        main_session.pending = None
        self._writing = False
        if not self._failed:
            try:
                self.applier.settle()
                if self._origin is not None:
                    self.applier.session.sql(_ORIGIN_RESET)
            except (ApplyError, TargetError) as exc:
                self._give_up(str(exc))
        elif self._origin is not None:
            try:
                self.applier.session.sql(_ORIGIN_RESET)
            except TargetError:
                pass  # a lost early session holds no origin once its backend is gone
        if self._origin is not None:
            main_session.sql(_ORIGIN_SETUP, [self._origin])
        if self._xid is not None and not self._failed and not self._main_timeout:
            main_session.sql(f"SET lock_timeout = '{MAIN_LOCK_TIMEOUT}'")
            self._main_timeout = True

    def _end(self) -> None:
        """The open transaction is over (committed or given up)."""
        self._xid = None
        self._savepoints.clear()
        self._relations.clear()
        if self._main_timeout:
            self.main.flush()  # a SET in the main session's open transaction would roll back with it
            self.main.session.sql("SET lock_timeout TO DEFAULT")
            self._main_timeout = False

    def _apply(self, step: Callable[[], None]) -> None:
        try:
            step()
        except (ApplyError, TargetError) as exc:
            self._give_up(str(exc))

    def _give_up(self, reason: str) -> None:
        """Roll the early transaction back: the assembler delivers it at its end instead."""
        log.info("streamed transaction %s is applied at its commit instead of as it streams: %s",
                 self._xid, reason)
        self._failed = True
        self._savepoints.clear()
        try:
            self.applier.abort_open_transaction()
        except TargetError as exc:
            log.debug("rolling back the early session failed: %s", exc)


def _savepoint(subxid: int) -> str:
    return quote_ident(f"applier_sub_{subxid}")
