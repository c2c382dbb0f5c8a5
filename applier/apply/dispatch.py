"""The apply stage's entry point: whole source transactions in, target transactions out.

``Applier`` implements ``assembler.TransactionSink``. Owns the one decision made for each source
transaction at its begin (PostgreSQL's worker.c decides the same way): already applied (skipped
whole), skipped on request, prepared (two-phase), or applied; and if applied, on the fast path
(several source transactions share one target transaction, ``fastpath``) or the careful path
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
from dataclasses import replace

from ..assembler import Change, TransactionEnd, TransactionStart
from ..errors import ApplyError, Cause, Directive, TargetError, decide
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
from .batch import KeyRun, Run
from .careful import CarefulPath, update_key
from .divert import Discard, Divert
from .fastpath import BatchLimits, FastPath, LaneRoom
from .feed import moved_key
from .handlers import Handlers
from .lane import Lane, lane_for
from .mapping import MappingError, RelationMapping
from .relations import RelationCache
from .schema import SchemaFollower, TypeCache
from .skipping import Skipper
from .statements import truncate_sql
from .sync_filter import SyncFilter
from .transaction import TargetTransaction
from .twophase import TwoPhase

__all__ = ["Applier"]

log = logging.getLogger(__name__)

_ALREADY_APPLIED = Discard("already applied")
_SKIPPED_ORIGIN = Discard("from a skipped origin")


class Applier:
    def __init__(self, tx: TargetTransaction, relations: RelationCache, handlers: Handlers, *,
                 limits: BatchLimits | None = None, careful_until: LSN = LSN(0),
                 sync_filter: SyncFilter | None = None, follow_schema: bool = False,
                 on_relation: Callable[[Relation], None] | None = None) -> None:
        self.tx = tx
        self.relations = relations
        self.handlers = handlers
        #: --schema-changes follow: target tables are made to fit the source's Relation messages.
        self.types = TypeCache()
        self.schema = SchemaFollower(tx, self.types) if follow_schema else None
        #: Relations whose target table a schema change in the open target transaction altered:
        #: read again if it rolls back.
        self._altered: set[int] = set()
        self._schema_changes = tx.schema_changes  # how this session makes them, outside 2PC
        #: Told of every Relation message first: it may end the session (a table added to a
        #: publication is copied before streaming on).
        self.on_relation = on_relation
        tx.on_end.append(self._transaction_ended)
        self.careful = CarefulPath(tx, relations, handlers.conflicts)
        conflicts = handlers.conflicts
        self.fast = None if limits is None else FastPath(
            tx, limits, conflicts.written_by_us if conflicts.origin_id is not None else None)
        #: Everything up to this source commit LSN goes through the careful path (the fast path
        #: met a conflict or an error there).
        self.careful_until = careful_until
        self.sync_filter = sync_filter
        self._fast = False               # the current source transaction is on the fast path
        self._divert: Divert | None = None
        self._apply: dict[type, Callable[[Change], None]] = {
            Insert: self._insert, Update: self._update, Delete: self._delete,  # type: ignore[dict-item]
            Truncate: self._truncate, Message: self._message,  # type: ignore[dict-item]
        }
        #: Plain transactions of row changes, and the row changes of any fast-path transaction,
        #: taken straight from their payloads (None without the C accelerator or the fast path).
        self.lane: Lane | None = lane_for(self) if self.fast is not None else None

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
    def holds_uncommitted(self) -> bool:
        """Fast-path work is waiting for its commit (the worker flushes when the stream is idle)."""
        return self.fast is not None and self.fast.open

    def wait_left(self) -> float:
        """Seconds the fast path's batch may still wait for more at a pause (``FastPath.wait_left``)."""
        return self.fast.wait_left() if self.fast is not None else 0.0

    def flush(self, durable: bool = False) -> None:
        """Commit what the fast path holds (see ``FastPath.commit``)."""
        if self.fast is not None:
            self.fast.commit(durable)

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
            # A table a schema change in the open transaction altered is known better here than
            # by reading it on another connection, which does not see the change yet.
            self.relations.learn(msg, keep_target=msg.relation_id in self._altered)
            self.careful.forget(msg.relation_id)
            if self.fast is not None:
                self.fast.relation_changed(msg.relation_id)  # queued rows used the old definition
            if self._divert is not None:
                self._divert.relation(msg)
        except (TargetError, MappingError) as exc:
            raise self._failure(exc) from exc

    def type(self, msg: Type) -> None:
        # Values are cast by the target column's type, found by name; a new column of a type that
        # is not built in is typed by this name (--schema-changes follow).
        self.types.learn(msg)

    def mapping(self, relation_id: int) -> RelationMapping:
        """The relation's mapping onto its target table, made to fit first when the source's
        schema is followed."""
        relations = self.relations
        mapping = relations.cached(relation_id)
        if mapping is not None:
            return mapping
        if self.schema is not None:
            table = relations.target(relation_id)
            aligned = self.schema.align(relations.relation(relation_id), table,
                                        relations.previous(relation_id))
            if aligned is not table:
                relations.set_target(relation_id, aligned)
                self._altered.add(relation_id)
        mapping = relations.mapping(relation_id)
        feed = self.tx.feed
        if mapping.feed is not None and feed is not None:
            # Forgotten if the transaction rolls back: the change table's columns would too.
            self._altered.add(relation_id)
            feed.align(mapping)
        return mapping

    def _transaction_ended(self, committed: bool) -> None:
        if not committed:
            self.relations.forget_all(self._altered)  # the schema change rolled back with it
        self._altered.clear()

    # -- transactions -------------------------------------------------------------------------------
    def begin(self, txn: TransactionStart) -> None:
        try:
            self._begin(txn)
        except (TargetError, MappingError) as exc:
            raise self._failure(exc) from exc

    def _begin(self, txn: TransactionStart) -> None:
        tx = self.tx
        tx.start(txn)
        self._fast = False
        if self.sync_filter is not None:
            self.sync_filter.begin(txn.commit_lsn)
        if txn.commit_lsn <= tx.applied.commit_lsn:
            log.info("skipping transaction %d at %s: already applied (recorded position %s)",
                     txn.xid, txn.commit_lsn, tx.applied.commit_lsn)
            self._divert = _ALREADY_APPLIED
            return
        skips = self.handlers.skips
        if skips.lsn is not None:
            if skips.matches(txn.commit_lsn):
                self.flush()  # commit order: the batch goes first
                self._divert = Skipper(tx, self.relations, skips)
                return
            if skips.passed_by(txn.commit_lsn):
                skips.drop_stale(txn.commit_lsn)
        if txn.gid is not None:
            self.flush()
            self._divert = self._two_phase("begin_prepare").begin(self, txn)
            return
        fast = self.fast
        self._fast = fast is not None and txn.commit_lsn > self.careful_until
        if self._fast:
            assert fast is not None
            fast.begin()
            return
        self.flush()  # commit order: whatever the fast path holds goes first
        tx.begin()

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
        feed = tx.feed
        if feed is not None:
            # Rows written before the commit was known (applied as it streamed) move to it.
            for fix in feed.fix_pending(txn.commit_lsn, txn.commit_time):
                if self._fast:
                    assert self.fast is not None
                    self.fast.statement(fix)
                else:
                    tx.sql(fix)
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
        if sync_filter is not None and sync_filter.skipped:
            kept = self._not_in_copy(msg)
            if kept is None:
                return
            msg = kept
        self._apply[type(msg)](msg)

    def take_changes(self, payloads: list[bytes], start: int) -> int:
        """A replayed streamed transaction's row changes go through the lane where it takes them."""
        lane = self.lane
        return start if lane is None else lane.take(payloads, start, streamed=True)

    def _insert(self, msg: Insert) -> None:
        mapping = self.mapping(msg.relation_id)
        self.tx.pending["insert"] += 1
        meta = None if mapping.feed is None else self.tx.feed.meta(mapping.feed)  # type: ignore[union-attr]
        if self._fast:
            self.fast.insert(mapping, msg.new_tuple, meta)  # type: ignore[union-attr]
        else:
            self.careful.insert(mapping, msg, meta)

    def _update(self, msg: Update) -> None:
        mapping = self.mapping(msg.relation_id)
        key_source, key_positions = update_key(mapping, msg)
        if not key_positions:
            raise self.tx.error(f"update on {mapping.table.sql_name} carries no replica identity; "
                                "give the source table a primary key or REPLICA IDENTITY",
                                cause=Cause.NEEDS_OPERATOR)
        self.tx.pending["update"] += 1
        if mapping.feed is not None:
            self._update_recorded(mapping, msg, key_source, key_positions)
        elif self._fast:
            self.fast.update(mapping, msg.new_tuple, msg.old_tuple)  # type: ignore[union-attr]
        else:
            self.careful.update(mapping, msg, key_source, key_positions)

    def _update_recorded(self, mapping: RelationMapping, msg: Update, key_source: int,
                         key_positions: tuple[int, ...]) -> None:
        """An update of a table the change feed records (an update that moves its row to
        another key is also recorded as the delete of the old key, just before it)."""
        feed, change_table = self.tx.feed, mapping.feed
        assert feed is not None and change_table is not None
        moved = moved_key(mapping, msg.new_tuple, msg.old_tuple)
        moved_meta = feed.meta(change_table) if moved is not None else None
        meta = feed.meta(change_table)
        if self._fast:
            assert self.fast is not None
            self.fast.update(mapping, msg.new_tuple, msg.old_tuple, meta,
                             None if moved is None or moved_meta is None else (moved, moved_meta))
        else:
            self.careful.update(mapping, msg, key_source, key_positions, meta, moved, moved_meta)

    def _delete(self, msg: Delete) -> None:
        mapping = self.mapping(msg.relation_id)
        self.tx.pending["delete"] += 1
        meta = None if mapping.feed is None else self.tx.feed.meta(mapping.feed)  # type: ignore[union-attr]
        if self._fast:
            self.fast.delete(mapping, msg.old_tuple, meta)  # type: ignore[union-attr]
        else:
            self.careful.delete(mapping, msg, meta)

    def _truncate(self, msg: Truncate) -> None:
        mappings = [self.mapping(relation_id) for relation_id in msg.relation_ids]
        tables = [(mapping.table.schema, mapping.table.name) for mapping in mappings]
        if not tables:
            return
        feed = self.tx.feed
        markers = feed.truncated(mappings) if feed is not None else []
        if self._fast:
            assert self.fast is not None
            self.fast.statement(truncate_sql(tables, msg.restart_identity))
            for marker in markers:
                self.fast.statement(marker)
        else:
            self.careful.truncate(msg, tables, markers)
        self.tx.pending["truncate"] += 1

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

    def _not_in_copy(self, msg: Change) -> Change | None:
        """``msg`` without the tables whose initial copy already holds this transaction."""
        sync_filter = self.sync_filter
        assert sync_filter is not None
        if isinstance(msg, Message):
            return msg
        ids = msg.relation_ids if isinstance(msg, Truncate) else (msg.relation_id,)
        kept = []
        for relation_id in ids:
            relation = self.relations.get(relation_id)
            if relation is None or not sync_filter.skips(relation.namespace, relation.name):
                kept.append(relation_id)
        if not kept:
            return None
        if len(kept) == len(ids):
            return msg
        assert isinstance(msg, Truncate)
        return replace(msg, relation_ids=tuple(kept))

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
        if decide(exc) is not Directive.STOP or fast is None or not fast.open or fast.last is None:
            return exc
        current = self.tx.current
        until = LSN(max(fast.last.commit_lsn, current.commit_lsn if current else 0))
        log.info("%s; committing the source transactions before it first, row by row", exc)
        self.abort_open_transaction()
        return ApplyError(str(exc), cause=Cause.FAST_PATH_MISMATCH, careful_until=until)

    # -- the lane (lane.LaneHost) ----------------------------------------------------------------------
    @property
    def batch_runs(self) -> dict[int, Run | KeyRun]:
        assert self.fast is not None
        return self.fast.batch.runs

    def lane_room(self, whole: bool) -> LaneRoom | None:
        fast = self.fast
        if fast is None or (self.sync_filter is not None and self.sync_filter.active):
            return None
        if whole:
            if self.tx.current is not None or self.handlers.skips.lsn is not None:
                return None
        elif not self._fast or self._divert is not None or self.tx.current is None:
            return None
        return fast.room(whole, LSN(max(self.tx.applied.commit_lsn, self.careful_until)))

    def lane_run(self, relation_id: int, kind: str,
                 make_run: Callable[[int, tuple[int, ...]], Run | KeyRun]) -> bool:
        """A run for a table independent of others (and for updates and deletes, one with a key:
        not REPLICA IDENTITY FULL or NOTHING). False: the ordinary path takes the change (and
        reports what is wrong with the relation, if anything)."""
        if relation_id not in self.relations:
            return False
        try:
            mapping = self.mapping(relation_id)
        except MappingError:
            return False
        if not mapping.table.independent or mapping.feed is not None:
            return False  # the change feed's rows are written on the ordinary path
        if kind != "I" and (not mapping.key_positions or mapping.full_identity):
            return False
        assert self.fast is not None
        self.fast.open_run(mapping, make_run(len(mapping.target_columns), mapping.key_positions), kind)
        return True

    def lane_took(self, inserts: int, updates: int, deletes: int, value_bytes: int,
                  transactions: int, last: TransactionEnd | None) -> None:
        assert self.fast is not None
        self.fast.took(inserts, updates, deletes, value_bytes, transactions, last)

    def lane_due(self) -> None:
        assert self.fast is not None
        self.fast.due()

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

