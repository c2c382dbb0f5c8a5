"""TargetApplier: the TransactionSink that applies source transactions on the target.

One source transaction = one target transaction, ended by writing the progress row and COMMIT
in that same transaction, so data and position are durable together or not at all. A transaction
whose commit LSN is at or below the recorded position was applied before (redelivery after a
restart) and is skipped whole.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..protocol.lsn import LSN
from ..protocol.messages import (
    KIND_BINARY, KIND_UNCHANGED, CommitPrepared, Delete, Insert, Message, Origin, Relation,
    RollbackPrepared, Truncate, TupleData, Type, Update,
)
from ..assembler import TransactionEnd, TransactionStart
from .batch import Batch
from .pipeline import Pipeline, PipelineError, RowCountMismatch
from .relations import (
    MissingTargetColumn, MissingTargetTable, RelationMapping, TargetTable, map_relation,
    qualified_name,
)
from .session import TargetError, TargetSession
from .statements import NEW, Statement, delete_statement, insert_statement, truncate_sql, update_statement
from ..sync.state import SyncFilter

__all__ = ["TargetApplier", "ApplyError", "AppliedPosition", "BatchLimits"]

log = logging.getLogger(__name__)

PROGRESS_SQL = (
    "INSERT INTO applier.progress (slot_name, commit_lsn, end_lsn, commit_time, applied_at) "
    "VALUES ($1, $2::pg_catalog.pg_lsn, $3::pg_catalog.pg_lsn, $4::pg_catalog.timestamptz, "
    "pg_catalog.now()) ON CONFLICT (slot_name) DO UPDATE SET commit_lsn = EXCLUDED.commit_lsn, "
    "end_lsn = EXCLUDED.end_lsn, commit_time = EXCLUDED.commit_time, applied_at = EXCLUDED.applied_at"
)


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


@dataclass
class AppliedPosition:
    """The last source transaction durably applied on the target."""

    commit_lsn: LSN
    end_lsn: LSN


class TargetApplier:
    """Implements ``assembler.TransactionSink`` over a ``TargetSession``."""

    def __init__(self, session: TargetSession, reflect: Callable[[str, str], TargetTable],
                 slot: str, applied: AppliedPosition, on_commit: OnCommit, *,
                 limits: BatchLimits | None = None, careful_until: LSN = LSN(0),
                 track_target_lsn: bool = False, sync_filter: SyncFilter | None = None) -> None:
        self.session = session
        self.reflect = reflect
        self.slot = slot
        self.applied = applied
        self.on_commit = on_commit
        self.limits = limits
        self.careful_until = careful_until
        self.track_target_lsn = track_target_lsn
        self._batch = Batch()
        self._batch_open = False          # a target transaction holds fast-path work
        self._batch_last: TransactionEnd | None = None
        self._batch_started = 0.0
        self._batch_statements: dict[tuple, bytes] = {}
        self._batch_names = itertools.count(1)  # never reused: dropped shapes stay prepared
        self._fast = False                # the current source transaction uses the fast path
        self.relations: dict[int, Relation] = {}
        self._mappings: dict[int, RelationMapping] = {}
        self._statements: dict[tuple[object, ...], Statement] = {}
        self.conflicts: Counter[tuple[str, str]] = Counter()
        self.applied_counts: Counter[str] = Counter()   # committed on the target
        self._pending_counts: Counter[str] = Counter()  # in the open target transaction
        self._current: TransactionStart | None = None
        self._skipping = False
        self.current_origin: Origin | None = None
        # applier sync: changes to a table already in its copy (committed before its sync LSN).
        self.sync_filter = sync_filter

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
        self._mappings[relation_id] = mapping
        return mapping

    # -- transactions ---------------------------------------------------------------------------
    def begin(self, txn: TransactionStart) -> None:
        self._current = txn
        self.current_origin = None
        if self.sync_filter is not None:
            self.sync_filter.begin(txn.commit_lsn)
        self._skipping = txn.commit_lsn <= self.applied.commit_lsn
        if self._skipping:
            log.info("skipping transaction %d at %s: already applied (recorded position %s)",
                     txn.xid, txn.commit_lsn, self.applied.commit_lsn)
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

    def commit(self, txn: TransactionEnd) -> None:
        self._current = None
        if self._skipping:
            self._skipping = False
            return
        self._pending_counts["transactions"] += 1
        if self._fast:
            self._batch_last = txn
            limits = self.limits
            assert limits is not None
            if (self._batch.rows >= limits.rows or self._batch.bytes >= limits.bytes
                    or time.monotonic() - self._batch_started >= limits.seconds):
                self.flush()
            return
        self._sql(PROGRESS_SQL, _progress_values(self.slot, txn))
        self._sql("COMMIT")
        self._count_committed()
        target_lsn = None
        if self.track_target_lsn:
            target_lsn = LSN.parse(self.session.sql("SELECT pg_catalog.pg_current_wal_insert_lsn()")
                                   .get_value(0, 0).decode())
        self.applied = AppliedPosition(txn.commit_lsn, txn.end_lsn)
        self.on_commit(txn.end_lsn, target_lsn)

    @property
    def holds_uncommitted(self) -> bool:
        """Fast-path work is waiting for its commit (the worker flushes when the stream is idle)."""
        return self._batch_open

    def flush(self) -> None:
        """Commit the fast path's target transaction: its rows and the progress row naming the
        last source transaction in it in one pipeline round trip, then (every row count being as
        expected) COMMIT in a second."""
        if not self._batch_open:
            return
        last = self._batch_last
        target_lsn: list[LSN] = []
        try:
            with Pipeline(self.session.pgconn) as pipeline:
                self._emit(pipeline)
                if last is not None:
                    pipeline.send(PROGRESS_SQL, _progress_values(self.slot, last))
                # Row counts are checked before COMMIT is even sent: a mismatch must roll back.
                pipeline.sync()
                pipeline.send("COMMIT")
                if self.track_target_lsn:
                    pipeline.send("SELECT pg_catalog.pg_current_wal_insert_lsn()",
                                  on_value=lambda v: target_lsn.append(LSN.parse(v.decode())))
                pipeline.sync()
        except (RowCountMismatch, PipelineError) as exc:
            raise self._fast_path_failed(exc, last) from exc
        finally:
            self._batch.clear()
            self._batch_open = False
            self._batch_last = None
        self._count_committed()
        if last is not None:
            self.applied = AppliedPosition(last.commit_lsn, last.end_lsn)
            self.on_commit(last.end_lsn, target_lsn[0] if target_lsn else None)

    def _count_committed(self) -> None:
        # Counted only once the target committed: a rolled-back batch is redone and would
        # otherwise be counted twice.
        self.applied_counts.update(self._pending_counts)
        self._pending_counts.clear()

    def _send_batch(self) -> None:
        """Send the rows recorded so far without committing (bounds memory in large transactions)."""
        try:
            with Pipeline(self.session.pgconn) as pipeline:
                self._emit(pipeline)
                pipeline.sync()
        except (RowCountMismatch, PipelineError) as exc:
            raise self._fast_path_failed(exc, self._batch_last) from exc
        finally:
            self._batch.clear()

    def _emit(self, pipeline: Pipeline) -> None:
        for statement in self._batch.statements():
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

    def abort_open_transaction(self) -> None:
        """Roll back a transaction left open by an error, a lost source or a stop signal."""
        self._current = None
        self._skipping = False
        self._batch.clear()
        self._batch_open = False
        self._batch_last = None
        self._pending_counts.clear()
        if self.session.in_transaction:
            self.session.sql("ROLLBACK")

    def prepare(self, txn: TransactionEnd) -> None:
        raise self._error("two-phase transactions are not applied by this worker version; run "
                          "with --no-two-phase (they then arrive at COMMIT PREPARED)")

    def commit_prepared(self, msg: CommitPrepared) -> None:
        raise self._error("unexpected COMMIT PREPARED: two-phase decoding is not enabled")

    def rollback_prepared(self, msg: RollbackPrepared) -> None:
        raise self._error("unexpected ROLLBACK PREPARED: two-phase decoding is not enabled")

    def message(self, msg: Message) -> None:
        log.info("logical message prefix=%r lsn=%s (%d bytes)", msg.prefix, msg.lsn, len(msg.content))

    # -- changes --------------------------------------------------------------------------------
    def change(self, msg: Insert | Update | Delete | Truncate | Message) -> None:
        if self._skipping:
            return
        if self.sync_filter is not None and self.sync_filter.skipped:
            msg = self._not_in_copy(msg)
            if msg is None:
                return
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
            self.message(msg)  # type: ignore[arg-type]

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
            # The key exists already (redelivery, or a row written on the target): the source's
            # row wins, as an update by that key.
            self._conflict(mapping, "insert_exists")
            self._execute(self._update_statement(mapping, present, NEW, statement.conflict_key, True),
                          new, None, mapping)

    def _update(self, msg: Update) -> None:
        mapping = self._mapping(msg.relation_id)
        new = msg.new_tuple
        assigned = tuple(i for i, k in enumerate(new.kinds) if k != KIND_UNCHANGED)
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
        statement = self._update_statement(mapping, assigned, key_source, key_positions,
                                           not mapping.full_identity)
        result = self._execute(statement, new, old, mapping)
        if _rowcount(result) == 0:
            self._conflict(mapping, "update_missing")

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
            self._conflict(mapping, "delete_missing")

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
        if self._batch.rows >= limits.rows or self._batch.bytes >= limits.bytes:
            self._send_batch()

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

    def _sql(self, sql: str, values: list[bytes | None] | None = None) -> None:
        try:
            self.session.sql(sql, values)
        except TargetError as exc:
            raise self._error(str(exc), transient=exc.transient) from exc

    def _conflict(self, mapping: RelationMapping, kind: str) -> None:
        self.conflicts[(self._name(mapping), kind)] += 1
        log.debug("conflict %s on %s", kind, self._name(mapping))

    @staticmethod
    def _name(mapping: RelationMapping) -> str:
        return qualified_name(mapping.table.schema, mapping.table.name)

    def _error(self, message: str, transient: bool = False) -> ApplyError:
        txn = self._current
        if txn is not None:
            message = f"{message} [source transaction xid {txn.xid}, commit LSN {txn.commit_lsn}]"
        return ApplyError(message, transient=transient, commit_lsn=txn.commit_lsn if txn else None,
                          xid=txn.xid if txn else None)


def _progress_values(slot: str, txn: TransactionEnd) -> list[bytes | None]:
    return [slot.encode(), str(txn.commit_lsn).encode(), str(txn.end_lsn).encode(),
            txn.commit_time.isoformat().encode()]


def _rowcount(result) -> int:  # noqa: ANN001 - a psycopg PGresult
    tuples = result.command_tuples
    return int(tuples) if tuples is not None else 0
