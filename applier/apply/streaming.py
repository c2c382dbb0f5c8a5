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
  write, so every change is tagged as before;
- the early session itself always runs with that ``lock_timeout``: what it may wait for without
  end includes a transaction the target holds prepared (a streamed prepared transaction the
  source sends again after a restart is applied here again until its Stream Prepare), and the
  worker waits for it.

The assembler keeps no copy of the row changes taken here (a streamed transaction is not
buffered twice). So giving up is quiet only until the first of them is taken (the assembler then
buffers the transaction as any other); after that, giving up (a conflict, a logical message, an
error, a Stream Prepare) rolls back and ends the replication session with a transient
``ApplyError``: the source sends the transaction again from its start, and it is then buffered
and applied at its commit (its xid is remembered as refused; after a conflict, as one to apply
row by row: ``Applier.careful_xids``, so it is sent twice, not three times). Must never commit anything but a
whole source transaction in its commit order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

from ..assembler import Change, TransactionEnd, TransactionStart, deliver
from ..errors import ApplyError, Cause, Directive, TargetError, TextValuesNeeded, decide
from ..protocol import LSN, Delete, Insert, Origin, Relation, Truncate, Type, Update
from ..quoting import ident
from .dispatch import Applier
from .plan import CARRIES, Route, plan
from .target import TargetSession

__all__ = ["StreamingApply", "LOCK_TIMEOUT"]

log = logging.getLogger(__name__)

#: lock_timeout of the early session, and of the main one while an early transaction is open
#: (see the module text).
LOCK_TIMEOUT = "5s"
#: The early transaction's commit LSN is not known before its Stream Commit.
_UNKNOWN_LSN = LSN(2**64 - 1)
_UNKNOWN_TIME = datetime.fromtimestamp(0, UTC)
#: The changes applied here (the others leave the transaction to be applied at its commit).
_APPLIED = (Insert, Update, Delete, Truncate)
_ORIGIN_RESET = "SELECT pg_catalog.pg_replication_origin_session_reset()"
_ORIGIN_SETUP = "SELECT pg_catalog.pg_replication_origin_session_setup($1)"


class StreamingApply:
    """Implements ``assembler.EarlyApply`` beside the main session's ``Applier``. ``open_second``
    connects the early session and builds its applier (``build.second_applier``)."""

    def __init__(self, main: Applier, open_second: Callable[[], Applier], refused: set[int]) -> None:
        assert main.fast is not None
        self.main = main
        self._open_second = open_second
        tag = main.handlers.origins.tag
        self._origin = tag.name.encode() if tag.name is not None else None
        #: Streamed xids not to apply early again (their early apply ended a session).
        self._refused = refused
        self._xid: int | None = None      # the transaction open here
        #: Changes of it were taken here that the assembler keeps no copy of.
        self._taken = False
        self._savepoints: list[int] = []  # subxids with a savepoint, oldest first
        #: Relation messages of the open transaction: the server counts them as sent once it
        #: commits, so the main session learns them then (the replay would deliver them).
        self._relations: list[Relation] = []
        self._writing = False             # this session (not the main one) may write now
        self._main_timeout = False        # the main session runs with LOCK_TIMEOUT
        # The early session is connected at the first streamed transaction.
        self._applier: Applier | None = None

    @property
    def applier(self) -> Applier:
        assert self._applier is not None
        return self._applier

    @property
    def applying(self) -> bool:
        """A streamed transaction is open in the early session."""
        return self._xid is not None

    @property
    def session(self) -> TargetSession | None:
        return None if self._applier is None else self._applier.tx.session

    def _start(self) -> bool:
        """Connect the early session (once); False if it cannot be."""
        if self._applier is not None:
            return not self._applier.tx.session.closed
        try:
            self._applier = self._open_second()
        except TargetError as exc:
            log.warning("streamed transactions are applied at their commit: cannot open a second "
                        "target session (%s)", exc)
            return False
        return True

    # -- EarlyApply ----------------------------------------------------------------------------
    def open(self, xid: int) -> bool:
        main = self.main
        facts = main.facts(None, streamed=True, early=True)
        route = plan(facts)
        reason = None
        if self._xid is not None:
            reason = f"streamed transaction {self._xid} is being applied as it streams"
        elif xid in self._refused:
            reason = "an earlier attempt to apply it as it streams had to give up"
        elif route is not Route.EARLY:
            reason = "; ".join(need.value for need in facts.needs - CARRIES[Route.EARLY])
        elif not self._start():
            reason = "no second target session"
        if reason is not None:
            log.info("streamed transaction %d is buffered and applied at its commit: %s", xid, reason)
            return False
        self._xid = xid
        if not self._take_over():
            return False
        try:
            self.applier.tx.applied = main.tx.applied
            self.applier.begin(TransactionStart(xid, _UNKNOWN_LSN, _UNKNOWN_TIME, streamed=True,
                                                gid=None, end_lsn=None))
        except (ApplyError, TargetError) as exc:
            self._give_up_after(exc)  # nothing taken yet: quietly
            return False
        log.debug("applying streamed transaction %d as it streams", xid)
        return True

    def changes(self, payloads: list[bytes], start: int, stop: int) -> bool:
        if self._xid is None or not self._take_over():
            return False
        return self._take(lambda: deliver(self.applier, payloads[start:stop]))

    def change(self, msg: Change | Origin) -> bool:
        if self._xid is None:
            return False
        if type(msg) not in _APPLIED:
            # An Origin (the transaction was itself replicated: origin filtering and tracking
            # decide at its begin) or a logical message (recorded with its commit LSN).
            self._give_up(f"it holds {msg.type_name} message")
            return False
        if not self._take_over():
            return False
        return self._take(lambda: self.applier.change(msg))  # type: ignore[arg-type]

    def schema(self, msg: Relation | Type) -> None:
        if self._xid is None:
            return
        if type(msg) is Type:
            self.applier.type(msg)
            return
        self._relations.append(msg)  # type: ignore[arg-type]
        # What the batch holds is sent before the definition changes: this session writes.
        if self._take_over():
            self._step(lambda: self.applier.relation(msg))  # type: ignore[arg-type]

    def subtransaction(self, subxid: int) -> None:
        if self._xid is None:
            return
        self._savepoints.append(subxid)
        self.applier.savepoint(_savepoint(subxid))

    def pause(self) -> None:
        if self._xid is not None and self._writing:
            self._step(self.applier.send_part)

    def abort(self, subxid: int) -> None:
        if self._xid is None:
            return
        if subxid == self._xid:
            self._give_up("it was aborted", quietly=True)
        elif subxid in self._savepoints and self._take_over():
            del self._savepoints[self._savepoints.index(subxid):]
            self._step(lambda: self.applier.rollback_to_savepoint(_savepoint(subxid)))

    def finish(self, start: TransactionStart, end: TransactionEnd) -> bool:
        if self._xid is None:
            return False
        main = self.main
        route = plan(main.facts(end.commit_lsn, streamed=True, early=True))
        if route is Route.ALREADY_APPLIED:
            # Sent again after a restart, though committed before it: discarded whole.
            log.info("skipping transaction %d at %s: already applied (recorded position %s)",
                     end.xid, end.commit_lsn, main.tx.applied.commit_lsn)
            self._learn_relations()
            self._give_up("it was applied already", quietly=True)
            return True
        if route is not Route.EARLY:
            self._give_up(f"its route at its commit is {route.name.lower().replace('_', ' ')}: "
                          f"{route.value}")
            return False
        if end.commit_lsn >= main.hold_before:
            main.hold(end.commit_lsn)  # a verify's position: it commits once the worker may go on
        if not self._take_over():
            return False
        applier = self.applier
        applier.tx.applied = main.tx.applied
        try:
            applier.commit(end)
            applier.flush()
        except ApplyError as exc:
            if decide(exc) is not Directive.REDO_CAREFUL:
                raise  # a lost connection: whether COMMIT happened is unknown; restart
            self._give_up_after(exc)
            return False
        self._learn_relations()
        main.tx.applied = applier.tx.applied
        main.counts.update(applier.counts)
        main.counts["streamed_early"] += 1
        applier.counts.clear()
        self._end()
        return True

    def cancel(self) -> None:
        if self._xid is not None:
            self._give_up("it is to be delivered whole (Stream Prepare)")

    # -- the worker ------------------------------------------------------------------------------
    def close(self) -> None:
        """The replication session ends: roll back, and never apply this transaction early again
        (its early apply may be why the session ended)."""
        if self._xid is not None:
            self._refused.add(self._xid)
        self._xid = None
        main_session = self.main.tx.session
        if main_session.pending == self._hand_back:
            main_session.pending = None
        if self._applier is None:
            return
        try:
            self.applier.abort_open_transaction()
        finally:
            self.applier.tx.session.close()

    def flushed_wal_lsn(self) -> LSN:
        """The target's flushed WAL position, asked in the session that may write now (so that
        asking moves nothing between the sessions)."""
        if self._writing:
            try:
                self.applier.settle()
                return self.applier.tx.session.flushed_wal_lsn()
            except (ApplyError, TargetError) as exc:
                self._give_up_after(exc)
        return self.main.tx.session.flushed_wal_lsn()

    # -- handing over the right to write ---------------------------------------------------------
    def _take_over(self) -> bool:
        """Make this session the one that writes: the main one commits what it holds first
        (its errors propagate). False: this session failed, and the transaction is given up."""
        if self._writing:
            return True
        main = self.main
        main.flush()
        main_session = main.tx.session
        if self._origin is not None:
            main_session.sql(_ORIGIN_RESET)
            try:
                self.applier.tx.session.sql(_ORIGIN_SETUP, [self._origin])
            except TargetError as exc:
                main_session.sql(_ORIGIN_SETUP, [self._origin])
                self._give_up_after(exc)
                return False
        self._writing = True
        main_session.pending = self._hand_back
        return True

    def _hand_back(self) -> None:
        """The main session is about to run a statement: this one finishes what it sent and
        gives back the right to write (and the origin)."""
        main_session = self.main.tx.session
        main_session.pending = None
        self._writing = False
        try:
            self.applier.settle()
        except (ApplyError, TargetError) as exc:
            self._give_up_after(exc)
        if self._origin is not None:
            try:
                self.applier.tx.session.sql(_ORIGIN_RESET)
            except TargetError as exc:  # a lost session's backend lets go of it as it ends
                log.debug("the early session could not let go of the origin: %s", exc)
            main_session.sql(_ORIGIN_SETUP, [self._origin])
        if self._xid is not None and not self._main_timeout:
            main_session.sql(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
            self._main_timeout = True

    def _end(self) -> None:
        """The open transaction is over (committed or rolled back)."""
        self._xid = None
        self._taken = False
        self._savepoints.clear()
        self._relations.clear()
        if self._main_timeout:
            self.main.flush()  # a SET in the main session's open transaction would roll back with it
            self.main.tx.session.sql("SET lock_timeout TO DEFAULT")
            self._main_timeout = False

    def _learn_relations(self) -> None:
        for relation in self._relations:
            self.main.relation(relation)

    def _take(self, step: Callable[[], None]) -> bool:
        """Apply changes the assembler then keeps no copy of: True, or False if given up on
        before any such change was taken (the assembler then buffers them)."""
        try:
            step()
        except (ApplyError, TargetError) as exc:
            self._failed(exc)
            return False
        self._taken = True
        return True

    def _step(self, step: Callable[[], None]) -> None:
        try:
            step()
        except (ApplyError, TargetError) as exc:
            self._failed(exc)

    def _failed(self, exc: ApplyError | TargetError) -> None:
        """A step failed: give the transaction up. Binary values the target cannot take need a
        session in text, which applies this transaction as it streams again: nothing is refused."""
        if isinstance(exc, TextValuesNeeded):
            self._give_up("", quietly=True)
            raise exc
        self._give_up_after(exc)

    def _give_up_after(self, exc: ApplyError | TargetError) -> None:
        """Give up after ``exc``; what the careful path resolves (a conflict) is then applied
        row by row at its commit at once, rather than batched, met again and redone."""
        if self._taken and self._xid is not None and decide(exc) is Directive.REDO_CAREFUL:
            self.main.careful_xids.add(self._xid)
        self._give_up(str(exc))

    def _give_up(self, reason: str, quietly: bool = False) -> None:
        """Roll the early transaction back. Once it holds changes the assembler kept no copy of,
        only the source has them: the session must restart (unless ``quietly``: the transaction
        is not wanted at all), and this transaction is then applied at its commit."""
        xid, taken = self._xid, self._taken
        try:
            self.applier.abort_open_transaction()
        except TargetError as exc:
            log.debug("rolling back the early session failed: %s", exc)
        self._end()
        if taken and not quietly:
            assert xid is not None
            self._refused.add(xid)
            raise ApplyError(f"streamed transaction {xid} cannot be applied as it streams: {reason}; "
                             "restarting replication, so that the source sends it again, to be "
                             "applied at its commit", cause=Cause.SEND_AGAIN)
        if not quietly:
            log.info("streamed transaction %s is applied at its commit instead of as it streams: %s",
                     xid, reason)


def _savepoint(subxid: int) -> str:
    return ident(f"applier_sub_{subxid}")
