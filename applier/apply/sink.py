"""TargetApplier: the TransactionSink that applies source transactions on the target.

One source transaction = one target transaction, ended by writing the progress row and COMMIT
in that same transaction, so data and position are durable together or not at all. A transaction
whose commit LSN is at or below the recorded position was applied before (redelivery after a
restart) and is skipped whole.

A transaction that is not simply applied (already applied, skipped on request or by origin,
prepared or deferred two-phase) has a *divert* (``divert.py``) chosen at its begin or Origin
message that receives its changes instead; the hot path pays one ``is not None`` test for it.
Two-phase transactions, conflicts, origins, logical messages and skip requests live in their own
modules and are reached through ``self.extensions``.

Plain transactions take the fast path when it is enabled (``BatchLimits``): their row changes go
to ``batch.Batch`` and several consecutive source transactions share one target transaction,
committed with the progress row of the last one once a limit is reached or the stream pauses.
Every batched statement must change an exact number of rows; any other outcome, or an error,
rolls the batch back and the stretch is redone on the careful, row-by-row path above (where
conflicts are detected, logged and resolved one by one). Diverted transactions always take the
careful path, after whatever the batch holds has been committed.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

from .. import faults
from ..progress.position import AppliedPosition
from ..protocol.lsn import LSN
from ..protocol.messages import (
    KIND_BINARY, KIND_UNCHANGED, CommitPrepared, Delete, Insert, Message, Origin, Relation,
    RollbackPrepared, Truncate, TupleData, Type, Update,
)
from ..assembler import Change, TransactionEnd, TransactionStart
from ..sync.state import SyncFilter
from .batch import Batch, Run, KeyRun
from .divert import Discard, Divert
from .extensions import Extensions, default_extensions
from .lane import Lane, lane_for
from .pipeline import Pipeline, PipelineError, RowCountMismatch
from .relations import (
    MissingTargetColumn, MissingTargetTable, RelationMapping, TargetTable, map_relation,
    qualified_name,
)
from .session import TargetError, TargetSession
from .skipping import Skipper
from .statements import NEW, Statement, delete_statement, insert_statement, truncate_sql, update_statement

__all__ = ["TargetApplier", "ApplyError", "BatchLimits", "TextValuesNeeded"]

log = logging.getLogger(__name__)

PROGRESS_SQL = (
    "INSERT INTO applier.progress (slot_name, commit_lsn, end_lsn, commit_time, applied_at) "
    "VALUES ($1, $2::pg_catalog.pg_lsn, $3::pg_catalog.pg_lsn, $4::pg_catalog.timestamptz, "
    "pg_catalog.now()) ON CONFLICT (slot_name) DO UPDATE SET commit_lsn = EXCLUDED.commit_lsn, "
    "end_lsn = EXCLUDED.end_lsn, commit_time = EXCLUDED.commit_time, applied_at = EXCLUDED.applied_at"
)


#: Rows of a batch are sent ahead of its commit in parts (``_bound_batch``): the target applies
#: one part while the next is decoded, and the commit waits for the last part only. A part is
#: due at this many updated or deleted rows: small enough that the last part is a short wait, and
#: that a multi-row UPDATE or DELETE joins its rows to the table by its key index.
PART_ROWS = 2000
#: ... or at as many inserted rows; but when the lane takes the changes of one open transaction (a
#: large one, or a streamed one), at this many, which go as one COPY. On PostgreSQL 18 here,
#: loading 1,000,000 rows in one transaction took the target 3.4-3.6 s of CPU as 500 COPYs of 2,000
#: rows, 2.5 s as COPYs of 5,000 and 2.1-2.5 s as COPYs of 10,000 to 50,000 rows. Between whole
#: transactions (many small ones) parts of 10,000 made the drain slower: the worker then read the
#: source in longer bursts, and the walsender spent more CPU.
INSERT_PART_ROWS = 10_000


class ApplyError(Exception):
    """Applying a transaction failed; nothing of it (or after it) is committed on the target.

    ``careful_until``: the fast path met something it does not resolve itself (a conflict, or an
    error that row-by-row application may avoid); redo everything up to this commit LSN on the
    careful path."""

    def __init__(self, message: str, *, transient: bool = False, commit_lsn: LSN | None = None,
                 xid: int | None = None, careful_until: LSN | None = None) -> None:
        super().__init__(message)
        self.transient = transient or careful_until is not None
        self.commit_lsn = commit_lsn
        self.xid = xid
        self.careful_until = careful_until
        #: Not a failure of a connection but a change of course (a careful redo, text values):
        #: the session restarts at once, with no backoff.
        self.restart_at_once = careful_until is not None


class TextValuesNeeded(ApplyError):
    """The stream sends binary values because ``--binary auto`` found no reason not to, and a
    relation's would not mean the same on the target (a type that differs, or that is not built
    in). Nothing of the open target transaction is committed; the session restarts with text
    values."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=True)
        self.restart_at_once = True


@dataclass(frozen=True)
class BatchLimits:
    """When the fast path commits: whichever limit is reached first (and whenever the stream is
    idle). Rows and bytes also bound memory inside one large source transaction."""

    rows: int
    bytes: int
    seconds: float


#: Called after a target commit: the source end LSN it covers, and (with synchronous_commit off)
#: the target WAL position that must be flushed before the slot may be told.
OnCommit = Callable[[LSN, "LSN | None"], None]


class TargetApplier:
    """Implements ``assembler.TransactionSink`` over a ``TargetSession``."""

    def __init__(self, session: TargetSession, reflect: Callable[[str, str], TargetTable],
                 slot: str, applied: AppliedPosition, on_commit: OnCommit, *,
                 extensions: Extensions | None = None, limits: BatchLimits | None = None,
                 careful_until: LSN = LSN(0), track_target_lsn: bool = False,
                 sync_filter: SyncFilter | None = None, binary_check: bool = False) -> None:
        self.session = session
        self.reflect = reflect
        self.slot = slot
        self.applied = applied
        self.on_commit = on_commit
        self.extensions = extensions or default_extensions(session, slot)
        self.relations: dict[int, Relation] = {}
        self._mappings: dict[int, RelationMapping] = {}
        self._statements: dict[tuple[object, ...], Statement] = {}
        self._conflicts = self.extensions.conflicts
        self.conflicts: Counter[tuple[str, str]] = self._conflicts.counts
        self.applied_counts: Counter[str] = Counter()   # committed on the target
        self._pending_counts: Counter[str] = Counter()  # in the open target transaction
        self.limits = limits
        self.careful_until = careful_until
        self.track_target_lsn = track_target_lsn
        self.sync_filter = sync_filter
        # The stream's binary values were not asked for by the user (--binary auto): each
        # relation must be binary-safe (RelationMapping.binary_safe), else TextValuesNeeded.
        self.binary_check = binary_check
        # Fast-path updates carry the same origin guard as careful ones, so a row another origin
        # wrote shows up as a row-count difference and goes to the careful path's detection.
        self._batch = Batch(self._conflicts.written_by_us if self._conflicts.origin_id is not None
                            else None)
        self._batch_open = False          # a target transaction holds fast-path work
        self._batch_last: TransactionEnd | None = None
        self._batch_started = 0.0
        self._batch_statements: dict[tuple, bytes] = {}
        self._in_flight: Pipeline | None = None  # rows sent, results not read yet (_settle)
        self._sent_rows = 0               # rows of the open target transaction sent ahead
        self._batch_names = itertools.count(1)  # never reused: dropped shapes stay prepared
        self._fast = False                # the current source transaction uses the fast path
        self._current: TransactionStart | None = None
        self._divert: Divert | None = None
        self._progress_sql = self.extensions.progress_sql or PROGRESS_SQL
        self.current_origin: Origin | None = None
        #: Plain transactions of row changes, and the row changes of any fast-path transaction,
        #: taken straight from their payloads (None without the C accelerator).
        self.lane: Lane | None = lane_for(self)

    @property
    def current_xid(self) -> int | None:
        """Source xid of the transaction being applied, if any (log context and metrics)."""
        return self._current.xid if self._current is not None else None

    # -- schema ---------------------------------------------------------------------------------
    def relation(self, msg: Relation) -> None:
        # A new Relation message means the source schema may have changed: rebuild the mapping
        # (and re-read the target table) on next use.
        self.relations[msg.relation_id] = msg
        self._mappings.pop(msg.relation_id, None)
        self._statements = {k: v for k, v in self._statements.items() if k[1] != msg.relation_id}
        if self._batch:
            self._send_batch()  # queued rows were mapped with the old definition
        self._batch_statements = {k: v for k, v in self._batch_statements.items()
                                  if k[0][1] != msg.relation_id}
        self._batch.forget(msg.relation_id)
        if self._divert is not None:
            self._divert.relation(msg)

    def restore_relation(self, relation_id: int, relation: Relation | None) -> None:
        """Put back a relation description after replaying older ones (deferred two-phase)."""
        if relation is not None:
            self.relation(relation)
        else:
            self.relations.pop(relation_id, None)
            self._mappings.pop(relation_id, None)

    def type(self, msg: Type) -> None:
        # Values are cast by the target column's type, found by name; type OIDs are not needed.
        log.debug("source type %s.%s has OID %d", msg.namespace, msg.name, msg.type_oid)

    def _mapping(self, relation_id: int) -> RelationMapping:
        mapping = self._mappings.get(relation_id)
        if mapping is not None:
            return mapping
        relation = self.relations.get(relation_id)
        if relation is None:
            raise self._error(f"change for relation id {relation_id} before its Relation message "
                              "(protocol violation)")
        try:
            mapping = map_relation(relation, self.reflect(relation.namespace, relation.name))
        except (MissingTargetTable, MissingTargetColumn) as exc:
            raise self._error(str(exc)) from exc
        if self.binary_check and not mapping.binary_safe:
            raise TextValuesNeeded(
                f"the types of {mapping.table.sql_name} differ between source and target or are not "
                "built in, so its binary values would not mean the same there; restarting "
                "replication with text values (--binary auto)")
        self._mappings[relation_id] = mapping
        return mapping

    def check_binary_values(self, relation_id: int) -> None:
        """Raise TextValuesNeeded when this relation's binary values would not mean the same on
        the target (``binary_check``), for changes kept to be applied later (a deferred prepared
        transaction): a restart in text must not find them stored in binary. Anything else wrong
        with the relation is reported when they are applied, as without the check."""
        if self.binary_check and relation_id not in self._mappings:
            try:
                self._mapping(relation_id)
            except TextValuesNeeded:
                raise
            except ApplyError:
                pass

    # -- transactions ---------------------------------------------------------------------------
    def begin(self, txn: TransactionStart) -> None:
        self._current = txn
        self.current_origin = None
        self._fast = False
        if self.sync_filter is not None:
            self.sync_filter.begin(txn.commit_lsn)
        if txn.commit_lsn <= self.applied.commit_lsn:
            log.info("skipping transaction %d at %s: already applied (recorded position %s)",
                     txn.xid, txn.commit_lsn, self.applied.commit_lsn)
            self._divert = _ALREADY_APPLIED
            return
        skips = self.extensions.skips
        if skips.lsn is not None:
            if skips.matches(txn.commit_lsn):
                self.flush()  # commit order: the batch goes first
                self._divert = Skipper(self, txn)
                return
            if skips.passed_by(txn.commit_lsn):
                skips.drop_stale(txn.commit_lsn)
        if txn.gid is not None:
            self.flush()
            self._divert = self._two_phase("begin_prepare").begin(self, txn)
            return
        self._fast = self.limits is not None and txn.commit_lsn > self.careful_until
        if self._fast:
            if not self._batch_open:
                self._sql("BEGIN")
                self._batch_open = True
                self._batch_started = time.monotonic()
            return
        self.flush()  # commit order: whatever the fast path holds goes first
        self._sql("BEGIN")

    def origin(self, msg: Origin) -> None:
        self.current_origin = msg
        if msg.name in self.extensions.origins.skip:
            divert = self._divert
            if divert is None or divert.abandonable:
                if not self._fast:  # in a batch nothing of this transaction was recorded yet
                    self._sql("ROLLBACK")
                log.debug("dropping transaction %s from origin %r", self._current, msg.name)
                self._divert = _SKIPPED_ORIGIN
                self.applied_counts["skipped_origin"] += 1

    def commit(self, txn: TransactionEnd) -> None:
        self._current = None
        divert = self._divert
        if divert is not None:
            self._divert = None
            divert.commit(txn)
            return
        if self.current_origin is not None:
            self._origin_applied(txn)
        self._pending_counts["transactions"] += 1
        if self._fast:
            self._batch_last = txn
            limits = self.limits
            assert limits is not None
            if (self._sent_rows + self._batch.rows >= limits.rows
                    or self._batch.bytes >= limits.bytes or time.monotonic() - self._batch_started >= limits.seconds):
                self.flush()
            return
        self.finish(txn.commit_lsn, txn.end_lsn, txn.commit_time)

    def finish(self, commit_lsn: LSN, end_lsn: LSN, commit_time: datetime | None,
               fault: str = "before_feedback") -> None:
        """Record the position in the open target transaction, commit it, tell the source."""
        self._sql(self._progress_sql, [self.slot.encode(), str(commit_lsn).encode(),
                                       str(end_lsn).encode(),
                                       commit_time.isoformat().encode() if commit_time else None])
        self._sql("COMMIT")
        self._count_committed()
        target_lsn = None
        if self.track_target_lsn:
            target_lsn = LSN.parse(self.session.sql("SELECT pg_catalog.pg_current_wal_insert_lsn()")
                                   .get_value(0, 0).decode())
        self.applied = AppliedPosition(commit_lsn, end_lsn)
        faults.hit(fault)
        self.on_commit(end_lsn, target_lsn)

    @property
    def holds_uncommitted(self) -> bool:
        """Fast-path work is waiting for its commit (the worker flushes when the stream is idle)."""
        return self._batch_open

    def flush(self, durable: bool = False) -> None:
        """Commit the fast path's target transaction: its rows and the progress row naming the
        last source transaction in it in one pipeline round trip, then (every row count being as
        expected) COMMIT in a second.

        ``durable``: commit with synchronous_commit on even when the session runs with it off.
        The worker asks for it when the stream is idle: the source position can then be
        confirmed at once, instead of after the target's WAL writer has flushed (up to three
        wal_writer_delay later), and the one flush also covers every earlier asynchronous commit.
        """
        if not self._batch_open:
            return
        last = self._batch_last
        asynchronous = self.track_target_lsn and not durable
        target_lsn: list[LSN] = []
        try:
            self._settle()
            with Pipeline(self.session.pgconn) as pipeline:
                self._emit(pipeline)
                if last is not None:
                    pipeline.send(self._progress_sql, _progress_values(self.slot, last))
                if self.track_target_lsn and durable:
                    pipeline.send("SET LOCAL synchronous_commit = on")
                # Row counts are checked before COMMIT is even sent: a mismatch must roll back.
                pipeline.sync()
                pipeline.send("COMMIT")
                if asynchronous:
                    pipeline.send("SELECT pg_catalog.pg_current_wal_insert_lsn()",
                                  on_value=lambda v: target_lsn.append(LSN.parse(v.decode())))
                pipeline.sync()
        except (RowCountMismatch, PipelineError) as exc:
            raise self._fast_path_failed(exc, last) from exc
        finally:
            self._batch.clear()
            self._batch_open = False
            self._batch_last = None
            self._sent_rows = 0
        self._count_committed()
        if last is not None:
            self.applied = AppliedPosition(last.commit_lsn, last.end_lsn)
            faults.hit("before_feedback")
            self.on_commit(last.end_lsn, target_lsn[0] if target_lsn else None)

    def _count_committed(self) -> None:
        # Counted only once the target committed: a rolled-back batch is redone and would
        # otherwise be counted twice.
        self.applied_counts.update(self._pending_counts)
        self._pending_counts.clear()

    def _send_batch(self) -> None:
        """Send the rows recorded so far without committing (bounds memory in large transactions).

        Their results are not waited for: the target works through them while the next rows
        are decoded and recorded, and ``_settle`` reads them before the session is used again
        (the next send, the commit, or any other statement: the session calls it)."""
        self._settle()
        self._sent_rows += self._batch.rows
        pipeline = Pipeline(self.session.pgconn).open()
        try:
            self._emit(pipeline)
            pipeline.send_sync()
        except (RowCountMismatch, PipelineError) as exc:
            pipeline.abandon()
            raise self._fast_path_failed(exc, self._batch_last) from exc
        finally:
            self._batch.clear()
        self._in_flight = pipeline
        self.session.pending = self._settle

    def _settle(self) -> None:
        """Read the outcome of the rows sent by ``_send_batch``; a failure or a row count other
        than expected sends the stretch to the careful path, like a failure at commit."""
        pipeline = self._in_flight
        if pipeline is None:
            return
        self._in_flight = None
        self.session.pending = None
        try:
            pipeline.finish()
        except (RowCountMismatch, PipelineError) as exc:
            raise self._fast_path_failed(exc, self._batch_last) from exc

    def _emit(self, pipeline: Pipeline) -> None:
        for statement in self._batch.statements():
            if statement.copy_data is not None:
                log.debug("%s: %d rows", statement.sql, statement.expected_rows)
                pipeline.copy(statement.sql, statement.copy_data, statement.expected_rows)
                continue
            if statement.cache_key is None:
                pipeline.send(statement.sql, expected_rows=statement.expected_rows)
                continue
            name = self._batch_statements.get(statement.cache_key)
            if name is None:
                name = self._batch_statements[statement.cache_key] = f"applier_b{next(self._batch_names)}".encode()
                pipeline.prepare(name, statement.sql)
            pipeline.send_prepared(name, statement.sql, statement.values, statement.formats,
                                   statement.expected_rows)

    def _fast_path_failed(self, exc: Exception, last: TransactionEnd | None) -> ApplyError:
        """Roll back and ask for the stretch to be redone carefully, row by row."""
        transient_connection = isinstance(exc, PipelineError) and exc.transient
        try:
            if self.session.in_transaction:
                self.session.sql("ROLLBACK")
        except TargetError:
            transient_connection = True
        if transient_connection:
            return ApplyError(str(exc), transient=True)
        current = self._current
        until = max(lsn for lsn in (last.commit_lsn if last else LSN(0),
                                    current.commit_lsn if current else LSN(0)))
        log.info("fast apply met %s; redoing up to %s row by row", exc, until)
        return ApplyError(f"fast path: {exc}", careful_until=until)

    def _origin_applied(self, txn: TransactionEnd) -> None:
        origin = self.current_origin
        assert origin is not None
        try:
            self.extensions.origins.record_message(origin, txn.commit_lsn, txn.commit_time)
        except TargetError as exc:
            raise self._error(str(exc), transient=exc.transient) from exc

    def abort_open_transaction(self) -> None:
        """Roll back a transaction left open by an error, a lost source or a stop signal."""
        if self._in_flight is not None:
            self._in_flight.abandon()  # whatever it did is rolled back below
            self._in_flight = None
            self.session.pending = None
        self._current = None
        self._divert = None
        self._batch.clear()
        self._batch_open = False
        self._batch_last = None
        self._sent_rows = 0
        self._pending_counts.clear()
        if self.session.in_transaction:
            self.session.sql("ROLLBACK")

    def prepare(self, txn: TransactionEnd) -> None:
        self._current = None
        divert = self._divert
        self._divert = None
        if divert is None:  # cannot happen: every prepared transaction has a divert
            raise self._error(f"prepare of xid {txn.xid} without begin_prepare")
        divert.prepare(txn)

    def commit_prepared(self, msg: CommitPrepared) -> None:
        # COMMIT PREPARED cannot run inside a transaction block, and commit order puts the
        # transactions the fast path holds first.
        self.flush()
        self._two_phase("commit_prepared").commit_prepared(self, msg)

    def rollback_prepared(self, msg: RollbackPrepared) -> None:
        self.flush()
        self._two_phase("rollback_prepared").rollback_prepared(self, msg)

    def _two_phase(self, what: str):  # -> TwoPhase
        handler = self.extensions.two_phase
        if handler is None:
            raise self._error(f"unexpected {what}: two-phase decoding is not enabled for this "
                              "worker (protocol violation)")
        return handler

    def message(self, msg: Message) -> None:
        """A non-transactional logical message: delivered at once, on its own."""
        if self._current is None:
            self.flush()  # source transactions that committed before it are written before it
        try:
            self.extensions.messages.deliver(msg, msg.xid, None)
        except TargetError as exc:
            raise self._error(f"{exc} (delivering logical message at {msg.lsn})",
                              transient=exc.transient) from exc

    # -- changes --------------------------------------------------------------------------------
    def change(self, msg: Change) -> None:
        divert = self._divert
        if divert is not None:
            divert.change(msg)
            return
        if self.sync_filter is not None and self.sync_filter.skipped:
            kept = self._not_in_copy(msg)
            if kept is None:
                return
            msg = kept
        kind = type(msg)
        if kind is Insert:
            self._insert(msg)  # type: ignore[arg-type]
        elif kind is Update:
            self._update(msg)  # type: ignore[arg-type]
        elif kind is Delete:
            self._delete(msg)  # type: ignore[arg-type]
        elif kind is Truncate:
            self._truncate(msg)  # type: ignore[arg-type]
        elif kind is Message:
            self._message(msg)  # type: ignore[arg-type]

    def take_changes(self, payloads: list[bytes], start: int) -> int:
        """A replayed streamed transaction's row changes go through the lane where it takes them."""
        lane = self.lane
        return start if lane is None else lane.take(payloads, start, streamed=True)

    def _apply(self, msg: Change) -> None:
        """``change`` without the divert test, for a divert that applies (two-phase prepare)."""
        self._APPLY[type(msg)](self, msg)

    def _message(self, msg: Message) -> None:
        """A transactional logical message, inside its transaction's target transaction."""
        txn = self._current
        if self._fast and self._batch:
            self._send_batch()  # the rows before it are written before it, as on the source
        try:
            self.extensions.messages.deliver(msg, txn.xid if txn else msg.xid,
                                             txn.commit_lsn if txn else None)
        except TargetError as exc:
            raise self._error(f"{exc} (delivering logical message at {msg.lsn})",
                              transient=exc.transient) from exc

    def _insert(self, msg: Insert) -> None:
        mapping = self._mapping(msg.relation_id)
        new = msg.new_tuple
        self._pending_counts["insert"] += 1
        if self._fast:
            self._batch.insert(mapping, new)
            self._bound_batch()
            return
        present = tuple(i for i, k in enumerate(new.kinds) if k != KIND_UNCHANGED)
        key = ("I", msg.relation_id, present)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = insert_statement(mapping, present)
        result = self._execute(statement, new, None, mapping)
        if statement.conflict_key and _rowcount(result) == 0:
            # The key exists already (a row written on the target): under policy apply the
            # source's row wins, as an update by that key.
            if self._conflicts.insert_exists(self, mapping, new, statement.conflict_key):
                self._execute(self._update_statement(mapping, present, NEW, statement.conflict_key,
                                                     True), new, None, mapping)

    def _update(self, msg: Update) -> None:
        mapping = self._mapping(msg.relation_id)
        new = msg.new_tuple
        old = msg.old_tuple
        if old is not None and mapping.full_identity:
            key_source, key_positions = 1, tuple(i for i, k in enumerate(old.kinds) if k != KIND_UNCHANGED)
        elif old is not None:
            key_source, key_positions = 1, mapping.key_positions
        else:
            key_source, key_positions = NEW, mapping.key_positions
        if not key_positions:
            raise self._error(f"update on {self._name(mapping)} carries no replica identity; give "
                              "the source table a primary key or REPLICA IDENTITY")
        self._pending_counts["update"] += 1
        if self._fast:
            self._batch.update(mapping, new, old)
            self._bound_batch()
            return
        assigned = tuple(i for i, k in enumerate(new.kinds) if k != KIND_UNCHANGED)
        by_key = not mapping.full_identity
        statement = self._update_statement(mapping, assigned, key_source, key_positions, by_key)
        conflicts = self._conflicts
        if conflicts.origin_id is None:
            result = self._execute(statement, new, old, mapping)
        else:  # only rows this worker wrote: else update_origin_differs
            result = self._execute(conflicts.guard(statement), new, old, mapping)
        if _rowcount(result) == 0:
            conflicts.update_not_applied(self, mapping, new, old, key_source, key_positions, by_key,
                                         statement)

    def _delete(self, msg: Delete) -> None:
        mapping = self._mapping(msg.relation_id)
        old = msg.old_tuple
        self._pending_counts["delete"] += 1
        if self._fast:
            self._batch.delete(mapping, old)
            self._bound_batch()
            return
        if mapping.full_identity:
            positions = tuple(i for i, k in enumerate(old.kinds) if k != KIND_UNCHANGED)
        else:
            positions = mapping.key_positions
        key = ("D", msg.relation_id, positions)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = delete_statement(mapping, positions,
                                                                 not mapping.full_identity)
        result = self._execute(statement, None, old, mapping)
        if _rowcount(result) == 0:
            self._conflicts.delete_missing(self, mapping, old, positions, not mapping.full_identity)

    def _truncate(self, msg: Truncate) -> None:
        names = [self._mapping(relation_id).table.sql_name for relation_id in msg.relation_ids]
        if names:
            if self._fast:
                self._batch.statement(truncate_sql(names, msg.restart_identity))
            else:
                self._sql(truncate_sql(names, msg.restart_identity))
            self._pending_counts["truncate"] += 1

    def _bound_batch(self) -> None:
        limits = self.limits
        assert limits is not None
        batch = self._batch
        if (batch.rows - batch.inserts >= PART_ROWS or batch.inserts >= PART_ROWS
                or batch.rows >= limits.rows or batch.bytes >= limits.bytes):
            self._send_batch()  # a part ahead of the commit

    # -- the lane (lane.py) ----------------------------------------------------------------------
    @property
    def batch_runs(self) -> dict[int, Run | KeyRun]:
        """The batch's open runs by relation id (the lane writes into them; changed in place only)."""
        return self._batch.runs

    def lane_room(self, whole: bool) -> tuple[LSN, int, int, int, int] | None:
        """May the lane take payloads now, and how far: None, or (take only transactions
        committing after this LSN, updated or deleted rows and inserted rows until a part is
        due, rows and bytes until the batch is full). ``whole``: it would take whole transactions
        (the batch's target transaction must be open and nothing may decide otherwise about a
        transaction at its begin); else the changes of the open one, which must be on the fast
        path undiverted."""
        limits = self.limits
        if limits is None or (self.sync_filter is not None and self.sync_filter.active):
            return None
        if whole:
            if not self._batch_open or self._current is not None or self.extensions.skips.lsn is not None:
                return None
        elif not self._fast or self._divert is not None or self._current is None:
            return None
        batch = self._batch
        insert_part_rows = PART_ROWS if whole else INSERT_PART_ROWS
        return (max(self.applied.commit_lsn, self.careful_until),
                min(PART_ROWS, limits.rows) - (batch.rows - batch.inserts),
                min(insert_part_rows, limits.rows) - batch.inserts,
                limits.rows - self._sent_rows - batch.rows, limits.bytes - batch.bytes)

    def lane_run(self, relation_id: int, kind: str,
                 make_run: Callable[[int, tuple[int, ...]], Run | KeyRun]) -> bool:
        """Give the relation's changes of one kind ("I", "U" or "D") a run in the batch, made by
        ``make_run(columns, key positions)``, if its table can take them: a table independent of
        others (and for updates and deletes, one with a key: not REPLICA IDENTITY FULL or
        NOTHING). False: the ordinary path takes them (and reports what is wrong with the
        relation, if anything)."""
        if relation_id not in self.relations:
            return False
        try:
            mapping = self._mapping(relation_id)
        except ApplyError:
            return False
        if not mapping.table.independent:
            return False
        if kind != "I" and (not mapping.key_positions or mapping.full_identity):
            return False
        self._batch.open_run(mapping, make_run(len(mapping.target_columns), mapping.key_positions), kind)
        return True

    def lane_took(self, inserts: int, updates: int, deletes: int, value_bytes: int,
                  transactions: int, last: TransactionEnd | None) -> None:
        """Count what the lane took, as ``change`` and ``commit`` count the ordinary path's."""
        batch = self._batch
        batch.rows += inserts + updates + deletes
        batch.inserts += inserts
        batch.bytes += value_bytes
        counts = self._pending_counts
        counts["insert"] += inserts
        counts["update"] += updates
        counts["delete"] += deletes
        if transactions:
            counts["transactions"] += transactions
            self._batch_last = last
            self.current_origin = None

    def lane_due(self) -> None:
        """After the lane's last commit, no transaction open: commit the batch if its time is up."""
        limits = self.limits
        if limits is not None and self._batch_open and time.monotonic() - self._batch_started >= limits.seconds:
            self.flush()

    def send_part(self) -> None:
        """Send what the batch holds ahead of its commit (the lane's part is due, or a stream
        block of the transaction applied as it streams ended)."""
        if self._batch:
            self._send_batch()

    # -- savepoints (the transaction applied as it streams, streaming.py) -------------------------
    def savepoint(self, name: str) -> None:
        """A savepoint (``name`` quoted) in the open target transaction, in order with the
        changes around it: it is sent with them, and no change is folded across it."""
        self._batch.statement(f"SAVEPOINT {name}")

    def rollback_to_savepoint(self, name: str) -> None:
        """Undo every change since the savepoint ``name`` (quoted)."""
        if self._batch:
            self._send_batch()  # the savepoint itself may still be in the batch
        self._sql(f"ROLLBACK TO SAVEPOINT {name}")

    def settle(self) -> None:
        """Wait for the outcome of the rows sent ahead (a failure raises ``ApplyError``)."""
        self._settle()

    def _not_in_copy(self, msg: Insert | Update | Delete | Truncate | Message
                     ) -> Insert | Update | Delete | Truncate | Message | None:
        """``msg`` without the tables whose initial copy already holds this transaction."""
        assert self.sync_filter is not None
        if isinstance(msg, Message):
            return msg
        ids = msg.relation_ids if isinstance(msg, Truncate) else (msg.relation_id,)
        kept = tuple(i for i in ids if i not in self.relations
                     or not self.sync_filter.skips(self.relations[i].namespace, self.relations[i].name))
        if not kept:
            return None
        return msg if len(kept) == len(ids) else replace(msg, relation_ids=kept)  # type: ignore[type-var]


    # -- helpers --------------------------------------------------------------------------------
    def _update_statement(self, mapping: RelationMapping, assigned: tuple[int, ...], key_source: int,
                          key_positions: tuple[int, ...], by_key: bool) -> Statement:
        key = ("U", mapping.relation.relation_id, assigned, key_source, key_positions, by_key)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = update_statement(mapping, assigned, key_source,
                                                                 key_positions, by_key)
        return statement

    def _execute(self, statement: Statement, new: TupleData | None, old: TupleData | None,
                 mapping: RelationMapping):  # -> PGresult
        values: list[bytes | None] = []
        formats: list[int] = []
        for source, position in statement.params:
            row = new if source == NEW else old
            assert row is not None
            values.append(row.values[position])  # type: ignore[arg-type]
            formats.append(1 if row.kinds[position] == KIND_BINARY else 0)
        try:
            return self.session.run(statement, values, formats)
        except TargetError as exc:
            raise self._error(f"{exc} (table {self._name(mapping)})", transient=exc.transient) from exc

    def _sql(self, sql: str, values: list[bytes | None] | None = None):  # -> PGresult
        try:
            return self.session.sql(sql, values)
        except TargetError as exc:
            raise self._error(str(exc), transient=exc.transient) from exc

    def _run(self, statement: Statement, values: list[bytes | None],
             formats: list[int] | None = None):  # -> PGresult
        """A bookkeeping statement (prepared once per session), text parameters by default."""
        try:
            return self.session.run(statement, values, formats or [0] * len(values))
        except TargetError as exc:
            raise self._error(str(exc), transient=exc.transient) from exc

    def _query_binary(self, sql: str, values: list[bytes | None]):  # -> PGresult
        try:
            return self.session.execute(sql, values, binary_result=True)
        except TargetError as exc:
            raise self._error(str(exc), transient=exc.transient) from exc

    @staticmethod
    def _name(mapping: RelationMapping) -> str:
        return qualified_name(mapping.table.schema, mapping.table.name)

    def _error(self, message: str, transient: bool = False) -> ApplyError:
        txn = self._current
        if txn is not None and txn.gid is None:
            message = f"{message} [source transaction xid {txn.xid}, commit LSN {txn.commit_lsn}]"
        elif txn is not None:
            message = (f"{message} [source transaction xid {txn.xid}, GID {txn.gid!r}, finish "
                       f"LSN {txn.commit_lsn}]")
        return ApplyError(message, transient=transient, commit_lsn=txn.commit_lsn if txn else None,
                          xid=txn.xid if txn else None)


TargetApplier._APPLY = {  # type: ignore[attr-defined]
    Insert: TargetApplier._insert, Update: TargetApplier._update, Delete: TargetApplier._delete,
    Truncate: TargetApplier._truncate, Message: TargetApplier._message,
}

_ALREADY_APPLIED = Discard("already applied")
_SKIPPED_ORIGIN = Discard("from a skipped origin")


def _progress_values(slot: str, txn: TransactionEnd) -> list[bytes | None]:
    return [slot.encode(), str(txn.commit_lsn).encode(), str(txn.end_lsn).encode(),
            txn.commit_time.isoformat().encode()]


def _rowcount(result) -> int:  # noqa: ANN001 - a psycopg PGresult
    tuples = result.command_tuples
    return int(tuples) if tuples is not None else 0
