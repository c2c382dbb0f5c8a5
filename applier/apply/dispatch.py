"""The apply stage's entry point: whole source transactions in, target transactions out.

``Applier`` implements ``assembler.TransactionSink``. Owns the one decision made for each source
transaction at its begin (PostgreSQL's worker.c decides the same way): already applied (skipped
whole), skipped on request, prepared (two-phase), or applied; and if applied, on the fast path
(several source transactions share one target transaction, ``fast.path``) or the careful path
(one statement per row, conflicts resolved, ``careful``). A transaction not simply applied has a
*divert* (``divert.py``) that receives its changes instead; the hot path pays one ``is not
None`` test for it. Changes are dispatched by message type. Every failure inside a transaction
leaves here as an ``ApplyError`` naming that transaction (the error context is set once, at its
begin, by the transaction owner). Must never read the stream or decide transaction boundaries:
the assembler calls it, one whole transaction at a time.

A failure that stops the worker while the fast path holds earlier source transactions does not
roll those back for good: the batch is redone row by row up to the failing transaction, so that
everything before it is committed when the worker stops (invariant 5).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from ..assembler import Change, TransactionEnd, TransactionStart
from ..errors import ApplyError, Cause, Directive, TargetError, decide_in_batch
from ..progress.records import Position
from ..protocol.lsn import LSN
from ..protocol.messages import (
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    Relation,
    RollbackPrepared,
    Truncate,
    Type,
    Update,
)
from .careful import CarefulPath
from .divert import Discard, Divert
from .fast.lane import Lane, lane_for
from .fast.path import BatchLimits, FastPath
from .fast.seat import LaneSeat
from .fitted_mappings import TableMappings
from .handlers import Handlers
from .mapping import MappingError
from .plan import Facts, Need, Route, plan
from .relation_cache import RelationCache
from .row_changes import RowChanges
from .schema_follow import ColumnSource
from .skipping import Skipper
from .sync_filter import SyncFilter
from .transaction import TargetTransaction
from .twophase import TwoPhase

__all__ = ["NO_HOLD", "Applier"]

log = logging.getLogger(__name__)

#: ``Applier.hold_before`` when no hold is asked for: past every LSN (the early session's unknown
#: commit LSN, 2**64 - 1, included).
NO_HOLD = LSN(2**64)

_ALREADY_APPLIED = Discard("already applied")
_NO_NEEDS: frozenset[Need] = frozenset()
_SKIPPED_ORIGIN = Discard("from a skipped origin")


class Applier:
    def __init__(self, tx: TargetTransaction, relations: RelationCache, handlers: Handlers, *,
                 limits: BatchLimits | None = None, careful_until: LSN = LSN(0),
                 careful_xids: set[int] | None = None,
                 sync_filter: SyncFilter | None = None, follow_schema: bool = False,
                 source: ColumnSource | None = None,
                 on_relation: Callable[[Relation], None] | None = None) -> None:
        self.tx = tx
        self.relations = relations
        self.handlers = handlers
        self.mappings = TableMappings(tx, relations, follow_schema=follow_schema, source=source)
        #: A relation's mapping onto its target table (``TableMappings.mapping``), per row change.
        self.mapping = self.mappings.mapping
        self._schema_changes = tx.schema_changes  # how this session makes them, outside 2PC
        #: Told of every Relation message first: it may end the session (a table added to a
        #: publication is copied before streaming on).
        self.on_relation = on_relation
        self.careful = CarefulPath(tx, relations, handlers.conflicts)
        conflicts = handlers.conflicts
        self.fast = None if limits is None else FastPath(
            tx, limits, conflicts.written_by_us if conflicts.origin_id is not None else None)
        # Every structure built per relation is dropped where the relation's description is.
        for dependent in (self.careful, conflicts, self.fast, tx.feed):
            if dependent is not None:
                relations.on_forget(dependent.forget)
        #: Everything up to this source commit LSN goes through the careful path (the fast path
        #: met a conflict or an error there).
        self.careful_until = careful_until
        #: What is fed now was received before and is fed again (``worker.redo``).
        self.redoing = False
        #: Streamed transactions (xids) whose early apply met what the careful path resolves (a
        #: conflict): at their commit, row by row at once, rather than batched and redone.
        self.careful_xids = careful_xids if careful_xids is not None else set()
        self.sync_filter = sync_filter
        #: ``on_hold`` waits before the first source transaction committing at or after this
        #: (a verify's position; LSN(0): the next one; NO_HOLD: none); ``on_copy_wait`` until a
        #: copy running beside the stream moved on, when a change to its table must wait.
        self.hold_before = NO_HOLD
        self.on_hold: Callable[[LSN], None] | None = None
        self.on_copy_wait: Callable[[], None] | None = None
        #: Each row change of the open transaction, to the fast or the careful path.
        self.rows = RowChanges(tx, self.mapping, self.careful, self.fast)
        self._divert: Divert | None = None
        self._apply: dict[type, Callable[[Change], None]] = {
            Insert: self.rows.insert, Update: self.rows.update,  # type: ignore[dict-item]
            Delete: self.rows.delete, Truncate: self.rows.truncate,  # type: ignore[dict-item]
            Message: self._message,  # type: ignore[dict-item]
        }
        #: Plain transactions of row changes, and the row changes of any fast-path transaction,
        #: taken straight from their payloads (None without the C accelerator or the fast path).
        self.lane: Lane | None = None if self.fast is None else lane_for(LaneSeat(self, self.fast))

    @property
    def _fast(self) -> bool:
        """The open source transaction is on the fast path."""
        return self.rows.on_fast

    @_fast.setter
    def _fast(self, on_fast: bool) -> None:
        self.rows.on_fast = on_fast

    # -- what the worker reads ----------------------------------------------------------------------
    @property
    def counts(self) -> Counter[str]:
        """What was applied and committed: transactions, and rows by kind."""
        return self.tx.counts

    @property
    def conflicts(self) -> Counter[tuple[str, str]]:
        """Conflicts by (table, type)."""
        return self.handlers.conflicts.counts

    @property
    def on_fast_path(self) -> bool:
        """The open source transaction is on the fast path, and nothing diverts its changes."""
        return self._fast and self._divert is None

    @property
    def hold_pending(self) -> bool:
        return self.hold_before != NO_HOLD

    @property
    def holds_uncommitted(self) -> bool:
        """Fast-path work is waiting for its commit (the worker flushes when the stream is idle)."""
        return self.fast is not None and self.fast.open

    def wait_left(self) -> float:
        """Seconds the fast path's batch may still wait for more at a pause (``FastPath.wait_left``)."""
        return self.fast.wait_left() if self.fast is not None else 0.0

    def flush(self) -> None:
        """Commit what the fast path holds (see ``FastPath.commit``)."""
        if self.fast is not None:
            self.fast.commit()

    def hold(self, lsn: LSN) -> None:
        """A source transaction at ``lsn`` >= ``hold_before`` is next: commit, then wait."""
        self.flush()
        assert self.on_hold is not None
        self.on_hold(lsn)

    def abort_open_transaction(self) -> None:
        """Roll back a transaction left open by an error, a lost source or a stop signal."""
        if self.fast is not None:
            self.fast.abandon()
        self.tx.start(None)
        self._divert = None
        self.tx.schema_changes = self._schema_changes
        self.tx.rollback()

    # -- schema ---------------------------------------------------------------------------------
    def relation(self, msg: Relation) -> None:
        if self.on_relation is not None:
            self.on_relation(msg)
        try:
            self.send_part()  # rows queued under the old definition go first
            self.mappings.learn(msg)  # drops everything built from it (RelationCache.on_forget)
            if self._divert is not None:
                self._divert.relation(msg)
        except (TargetError, MappingError) as exc:
            raise self._failure(exc) from exc

    def type(self, msg: Type) -> None:
        self.mappings.learn_type(msg)

    # -- transactions -------------------------------------------------------------------------------
    def begin(self, txn: TransactionStart) -> None:
        try:
            self._begin(txn)
        except (TargetError, MappingError) as exc:
            raise self._failure(exc) from exc

    def _begin(self, txn: TransactionStart) -> None:
        tx = self.tx
        tx.start(txn)
        if txn.xid in self.careful_xids:
            self.careful_xids.discard(txn.xid)
            self.careful_until = LSN(max(self.careful_until, txn.commit_lsn))
        self._fast = False
        if self.sync_filter is not None:
            self.sync_filter.begin(txn.commit_lsn)
        route = plan(self.facts(txn.commit_lsn, prepared=txn.gid is not None))
        if route is Route.ALREADY_APPLIED:
            # Expected for each one of a stretch fed again in-session (``redoing``); news after a
            # restart.
            log.log(logging.DEBUG if self.redoing else logging.INFO,
                    "skipping transaction %d at %s: already applied (recorded position %s)",
                    txn.xid, txn.commit_lsn, tx.applied.commit_lsn)
            self._divert = _ALREADY_APPLIED
            return
        if txn.commit_lsn >= self.hold_before:
            self.hold(txn.commit_lsn)
        skips = self.handlers.skips
        if route is Route.SKIPPED:
            self.flush()  # commit order: the batch goes first
            self._divert = Skipper(tx, self.relations, skips)
            return
        if skips.passed_by(txn.commit_lsn):
            skips.drop_stale(txn.commit_lsn)
        if route is Route.PREPARED:
            self.flush()
            self._divert = self._two_phase("begin_prepare").begin(self, txn)
            return
        self._fast = route in (Route.LANE, Route.FAST)
        if self._fast:
            assert self.fast is not None
            self.fast.begin()
            return
        self.flush()  # commit order: whatever the fast path holds goes first
        tx.begin()

    def facts(self, commit_lsn: LSN | None, *, prepared: bool = False,
              streamed: bool = False, early: bool = False) -> Facts:
        """What ``plan.plan`` decides a transaction's route from, as this stage stands now."""
        skips = self.handlers.skips
        copying = self.sync_filter is not None and self.sync_filter.active
        needs = _NO_NEEDS
        if copying or self.hold_pending or skips.lsn is not None:  # seldom: a set only then
            needs = frozenset(need for need, needed in (
                (Need.COPY_BESIDE, copying), (Need.HOLD, self.hold_pending),
                (Need.SKIP_PENDING, skips.lsn is not None)) if needed)
        return Facts(commit_lsn, self.tx.applied.commit_lsn, self.careful_until, needs, prepared,
                     commit_lsn is not None and skips.lsn is not None and skips.matches(commit_lsn),
                     streamed, self.fast is not None, self.lane is not None, early)

    def origin(self, msg: Origin) -> None:
        tx = self.tx
        tx.origin = msg
        if msg.name in self.handlers.origins.skip:
            divert = self._divert
            if divert is None or divert.abandonable:
                if not self._fast:  # in a batch nothing of this transaction was recorded yet
                    try:
                        tx.rollback()
                    except TargetError as exc:
                        raise self._failure(exc) from exc
                log.debug("dropping transaction %s from origin %r", tx.current, msg.name)
                self._divert = _SKIPPED_ORIGIN
                tx.counts["skipped_origin"] += 1

    def commit(self, txn: TransactionEnd) -> None:
        try:
            self._commit(txn)
        except (TargetError, MappingError) as exc:
            raise self._failure(exc) from exc

    def _commit(self, txn: TransactionEnd) -> None:
        tx = self.tx
        divert = self._divert
        if divert is not None:
            self._divert = None
            tx.start(None)
            divert.commit(txn)
            return
        origin = tx.origin
        if origin is not None:
            self.handlers.origins.record(origin.name, origin.origin_lsn, txn.commit_lsn,
                                         txn.commit_time)
        tx.pending["transactions"] += 1
        if tx.feed is not None:
            tx.feed.commit(txn, self.fast if self._fast else None)
        tx.start(None)
        if self._fast:
            assert self.fast is not None
            self.fast.ended(txn)
            return
        tx.commit(Position(txn.commit_lsn, txn.end_lsn, txn.commit_time))

    def prepare(self, txn: TransactionEnd) -> None:
        divert = self._divert
        self._divert = None
        try:
            if divert is None:  # cannot happen: every prepared transaction has a divert
                raise self.tx.error(f"prepare of xid {txn.xid} without begin_prepare",
                                    cause=Cause.PROTOCOL)
            divert.prepare(txn)
        except (TargetError, MappingError) as exc:
            raise self._failure(exc) from exc
        finally:
            self.tx.start(None)

    def commit_prepared(self, msg: CommitPrepared) -> None:
        # COMMIT PREPARED cannot run inside a transaction block, and commit order puts the
        # transactions the fast path holds first. A deferred transaction's changes are then
        # replayed on the careful path, in the target transaction that records its commit.
        self.flush()
        self._fast = False
        if msg.commit_lsn >= self.hold_before:
            self.hold(msg.commit_lsn)
        try:
            self._two_phase("commit_prepared").commit_prepared(self, msg)
        except (TargetError, MappingError) as exc:
            raise self._failure(exc) from exc

    def rollback_prepared(self, msg: RollbackPrepared) -> None:
        self.flush()
        try:
            self._two_phase("rollback_prepared").rollback_prepared(msg)
        except (TargetError, MappingError) as exc:
            raise self._failure(exc) from exc

    def _two_phase(self, what: str) -> TwoPhase:
        handler = self.handlers.two_phase
        if handler is None:
            raise self.tx.error(f"unexpected {what}: two-phase decoding is not enabled for this "
                                "worker (protocol violation)", cause=Cause.PROTOCOL)
        return handler

    def message(self, msg: Message) -> None:
        """A non-transactional logical message: delivered at once, on its own."""
        if self.tx.current is None:
            self.flush()  # source transactions that committed before it are written before it
        try:
            self.handlers.messages.deliver(msg, msg.xid, None)
        except TargetError as exc:
            raise self._failure(exc, f" (delivering logical message at {msg.lsn})") from exc

    # -- changes --------------------------------------------------------------------------------
    def change(self, msg: Change) -> None:
        divert = self._divert
        try:
            if divert is not None:
                divert.change(msg)
                return
            self.apply_change(msg)
        except (TargetError, MappingError) as exc:
            raise self._failure(exc) from exc
        except ApplyError as exc:
            raise self._stop_after_batch(exc) from exc

    def apply_change(self, msg: Change) -> None:
        """Apply one change of the open transaction, whatever divert it has (a prepared
        transaction's divert applies its changes this way)."""
        sync_filter = self.sync_filter
        if sync_filter is not None and sync_filter.filtering:
            while sync_filter.waits(msg, self.relations.get):
                assert self.on_copy_wait is not None
                self.on_copy_wait()
                sync_filter.refresh()
            kept = sync_filter.kept(msg, self.relations.get)
            if kept is None:
                return
            msg = kept
        self._apply[type(msg)](msg)

    def take_changes(self, payloads: list[bytes], start: int) -> int:
        """A replayed streamed transaction's row changes go through the lane where it takes them."""
        lane = self.lane
        return start if lane is None else lane.take(payloads, start, streamed=True)

    def _message(self, msg: Message) -> None:
        """A transactional logical message, inside its transaction's target transaction."""
        txn = self.tx.current
        if self._fast:
            assert self.fast is not None
            self.fast.send_part()  # the rows before it are written before it, as on the source
        try:
            self.handlers.messages.deliver(msg, txn.xid if txn else msg.xid,
                                           txn.commit_lsn if txn else None)
        except TargetError as exc:
            raise self._failure(exc, f" (delivering logical message at {msg.lsn})") from exc

    # -- failures -----------------------------------------------------------------------------------
    def _failure(self, exc: TargetError | MappingError, what: str = "") -> ApplyError:
        """``exc`` as an ``ApplyError`` naming the transaction being applied."""
        if isinstance(exc, ApplyError):
            return self._stop_after_batch(exc)
        if isinstance(exc, MappingError):
            return self._stop_after_batch(self.tx.error(f"{exc}{what}", cause=exc.cause))
        return self._stop_after_batch(self.tx.failed(exc, what))

    def _stop_after_batch(self, exc: ApplyError) -> ApplyError:
        """A failure that stops the worker, met while the fast path holds earlier source
        transactions: redo the batch row by row up to the failing one instead, so that those are
        committed before the worker stops on it."""
        fast = self.fast
        if (fast is None or not fast.open or fast.last is None or exc.careful_until is not None
                or decide_in_batch(exc) is not Directive.REDO_CAREFUL):
            return exc
        current = self.tx.current
        until = LSN(max(fast.last.commit_lsn, current.commit_lsn if current else 0))
        log.info("%s; committing the source transactions before it first, row by row", exc)
        self.abort_open_transaction()
        return ApplyError(str(exc), cause=Cause.FAST_PATH_MISMATCH, careful_until=until)

    def send_part(self) -> None:
        """Send what the batch holds ahead of its commit (the lane's part is due, or a stream
        block of the transaction applied as it streams ended)."""
        if self.fast is not None:
            self.fast.send_part()

    # -- savepoints (a transaction applied as it streams, streaming.py) -------------------------------
    def savepoint(self, name: str) -> None:
        """A savepoint (``name`` quoted) in order with the changes around it."""
        assert self.fast is not None
        self.fast.savepoint(name)

    def rollback_to_savepoint(self, name: str) -> None:
        assert self.fast is not None
        try:
            self.fast.rollback_to_savepoint(name)
        except TargetError as exc:
            raise self._failure(exc) from exc

    def settle(self) -> None:
        """Wait for the outcome of the rows sent ahead (a failure raises ``ApplyError``)."""
        if self.fast is not None:
            self.fast.settle()

