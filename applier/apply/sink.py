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
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from datetime import datetime

from .. import faults
from ..protocol.lsn import LSN
from ..protocol.messages import (
    KIND_BINARY, KIND_UNCHANGED, CommitPrepared, Delete, Insert, Message, Origin, Relation,
    RollbackPrepared, Truncate, TupleData, Type, Update,
)
from ..assembler import Change, TransactionEnd, TransactionStart
from .divert import Discard, Divert
from .extensions import Extensions, default_extensions
from .relations import (
    MissingTargetColumn, MissingTargetTable, RelationMapping, TargetTable, map_relation,
    qualified_name,
)
from .session import TargetError, TargetSession
from .skipping import Skipper
from .statements import NEW, Statement, delete_statement, insert_statement, truncate_sql, update_statement

__all__ = ["TargetApplier", "ApplyError", "AppliedPosition"]

log = logging.getLogger(__name__)

PROGRESS_SQL = (
    "INSERT INTO applier.progress (slot_name, commit_lsn, end_lsn, commit_time, applied_at) "
    "VALUES ($1, $2::pg_catalog.pg_lsn, $3::pg_catalog.pg_lsn, $4::pg_catalog.timestamptz, "
    "pg_catalog.now()) ON CONFLICT (slot_name) DO UPDATE SET commit_lsn = EXCLUDED.commit_lsn, "
    "end_lsn = EXCLUDED.end_lsn, commit_time = EXCLUDED.commit_time, applied_at = EXCLUDED.applied_at"
)


class ApplyError(Exception):
    """Applying a transaction failed; nothing of it (or after it) is committed on the target."""

    def __init__(self, message: str, *, transient: bool = False, commit_lsn: LSN | None = None,
                 xid: int | None = None) -> None:
        super().__init__(message)
        self.transient = transient
        self.commit_lsn = commit_lsn
        self.xid = xid


@dataclass
class AppliedPosition:
    """The last source transaction durably applied on the target."""

    commit_lsn: LSN
    end_lsn: LSN


class TargetApplier:
    """Implements ``assembler.TransactionSink`` over a ``TargetSession``."""

    def __init__(self, session: TargetSession, reflect: Callable[[str, str], TargetTable],
                 slot: str, applied: AppliedPosition, on_commit: Callable[[LSN], None],
                 extensions: Extensions | None = None) -> None:
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
        self.applied_counts: Counter[str] = Counter()
        self._current: TransactionStart | None = None
        self._divert: Divert | None = None
        self._progress_sql = self.extensions.progress_sql or PROGRESS_SQL
        self.current_origin: Origin | None = None

    # -- schema ---------------------------------------------------------------------------------
    def relation(self, msg: Relation) -> None:
        # A new Relation message means the source schema may have changed: rebuild the mapping
        # (and re-read the target table) on next use.
        self.relations[msg.relation_id] = msg
        self._mappings.pop(msg.relation_id, None)
        self._statements = {k: v for k, v in self._statements.items() if k[1] != msg.relation_id}
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
        self._mappings[relation_id] = mapping
        return mapping

    # -- transactions ---------------------------------------------------------------------------
    def begin(self, txn: TransactionStart) -> None:
        self._current = txn
        self.current_origin = None
        if txn.commit_lsn <= self.applied.commit_lsn:
            log.info("skipping transaction %d at %s: already applied (recorded position %s)",
                     txn.xid, txn.commit_lsn, self.applied.commit_lsn)
            self._divert = _ALREADY_APPLIED
            return
        skips = self.extensions.skips
        if skips.lsn is not None:
            if skips.matches(txn.commit_lsn):
                self._divert = Skipper(self, txn)
                return
            if skips.passed_by(txn.commit_lsn):
                skips.drop_stale(txn.commit_lsn)
        if txn.gid is not None:
            self._divert = self._two_phase("begin_prepare").begin(self, txn)
            return
        self._sql("BEGIN")

    def origin(self, msg: Origin) -> None:
        self.current_origin = msg
        if msg.name in self.extensions.origins.skip:
            divert = self._divert
            if divert is None or divert.abandonable:
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
        self.finish(txn.commit_lsn, txn.end_lsn, txn.commit_time)
        self.applied_counts["transactions"] += 1

    def finish(self, commit_lsn: LSN, end_lsn: LSN, commit_time: datetime | None,
               fault: str = "before_feedback") -> None:
        """Record the position in the open target transaction, commit it, tell the source."""
        self._sql(self._progress_sql, [self.slot.encode(), str(commit_lsn).encode(),
                                       str(end_lsn).encode(),
                                       commit_time.isoformat().encode() if commit_time else None])
        self._sql("COMMIT")
        self.applied = AppliedPosition(commit_lsn, end_lsn)
        faults.hit(fault)
        self.on_commit(end_lsn)

    def _origin_applied(self, txn: TransactionEnd) -> None:
        origin = self.current_origin
        assert origin is not None
        try:
            self.extensions.origins.record_message(origin, txn.commit_lsn, txn.commit_time)
        except TargetError as exc:
            raise self._error(str(exc), transient=exc.transient) from exc

    def abort_open_transaction(self) -> None:
        """Roll back a transaction left open by an error, a lost source or a stop signal."""
        self._current = None
        self._divert = None
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
        self._two_phase("commit_prepared").commit_prepared(self, msg)

    def rollback_prepared(self, msg: RollbackPrepared) -> None:
        self._two_phase("rollback_prepared").rollback_prepared(self, msg)

    def _two_phase(self, what: str):  # -> TwoPhase
        handler = self.extensions.two_phase
        if handler is None:
            raise self._error(f"unexpected {what}: two-phase decoding is not enabled for this "
                              "worker (protocol violation)")
        return handler

    def message(self, msg: Message) -> None:
        """A non-transactional logical message: delivered at once, on its own."""
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

    def _apply(self, msg: Change) -> None:
        """``change`` without the divert test, for a divert that applies (two-phase prepare)."""
        self._APPLY[type(msg)](self, msg)

    def _message(self, msg: Message) -> None:
        """A transactional logical message, inside its transaction's target transaction."""
        txn = self._current
        try:
            self.extensions.messages.deliver(msg, txn.xid if txn else msg.xid,
                                             txn.commit_lsn if txn else None)
        except TargetError as exc:
            raise self._error(f"{exc} (delivering logical message at {msg.lsn})",
                              transient=exc.transient) from exc

    def _insert(self, msg: Insert) -> None:
        mapping = self._mapping(msg.relation_id)
        new = msg.new_tuple
        present = tuple(i for i, k in enumerate(new.kinds) if k != KIND_UNCHANGED)
        key = ("I", msg.relation_id, present)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = insert_statement(mapping, present)
        result = self._execute(statement, new, None, mapping)
        self.applied_counts["insert"] += 1
        if statement.conflict_key and _rowcount(result) == 0:
            # The key exists already (a row written on the target): under policy apply the
            # source's row wins, as an update by that key.
            if self._conflicts.insert_exists(self, mapping, new, statement.conflict_key):
                self._execute(self._update_statement(mapping, present, NEW, statement.conflict_key,
                                                     True), new, None, mapping)

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
        by_key = not mapping.full_identity
        statement = self._update_statement(mapping, assigned, key_source, key_positions, by_key)
        conflicts = self._conflicts
        if conflicts.origin_id is None:
            result = self._execute(statement, new, old, mapping)
        else:  # only rows this worker wrote: else update_origin_differs
            result = self._execute(conflicts.guard(statement), new, old, mapping)
        self.applied_counts["update"] += 1
        if _rowcount(result) == 0:
            conflicts.update_not_applied(self, mapping, new, old, key_source, key_positions, by_key,
                                         statement)

    def _delete(self, msg: Delete) -> None:
        mapping = self._mapping(msg.relation_id)
        old = msg.old_tuple
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
        self.applied_counts["delete"] += 1
        if _rowcount(result) == 0:
            self._conflicts.delete_missing(self, mapping, old, positions, not mapping.full_identity)

    def _truncate(self, msg: Truncate) -> None:
        names = [self._mapping(relation_id).table.sql_name for relation_id in msg.relation_ids]
        if names:
            self._sql(truncate_sql(names, msg.restart_identity))
            self.applied_counts["truncate"] += 1

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


def _rowcount(result) -> int:  # noqa: ANN001 - a psycopg PGresult
    tuples = result.command_tuples
    return int(tuples) if tuples is not None else 0
