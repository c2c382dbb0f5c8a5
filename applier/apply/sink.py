"""TargetApplier: the TransactionSink that applies source transactions on the target.

One source transaction = one target transaction, ended by writing the progress row and COMMIT
in that same transaction, so data and position are durable together or not at all. A transaction
whose commit LSN is at or below the recorded position was applied before (redelivery after a
restart) and is skipped whole.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..protocol.lsn import LSN
from ..protocol.messages import (
    KIND_BINARY, KIND_UNCHANGED, CommitPrepared, Delete, Insert, Message, Origin, Relation,
    RollbackPrepared, Truncate, TupleData, Type, Update,
)
from ..assembler import TransactionEnd, TransactionStart
from .relations import (
    MissingTargetColumn, MissingTargetTable, RelationMapping, TargetTable, map_relation,
    qualified_name,
)
from .session import TargetError, TargetSession
from .statements import NEW, Statement, delete_statement, insert_statement, truncate_sql, update_statement
from ..sync.state import SyncFilter

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
                 sync_filter: SyncFilter | None = None) -> None:
        self.session = session
        self.reflect = reflect
        self.slot = slot
        self.applied = applied
        self.on_commit = on_commit
        self.relations: dict[int, Relation] = {}
        self._mappings: dict[int, RelationMapping] = {}
        self._statements: dict[tuple[object, ...], Statement] = {}
        self.conflicts: Counter[tuple[str, str]] = Counter()
        self.applied_counts: Counter[str] = Counter()
        self._current: TransactionStart | None = None
        self._skipping = False
        self.current_origin: Origin | None = None
        # applier sync: changes to a table already in its copy (committed before its sync LSN).
        self.sync_filter = sync_filter

    # -- schema ---------------------------------------------------------------------------------
    def relation(self, msg: Relation) -> None:
        # A new Relation message means the source schema may have changed: rebuild the mapping
        # (and re-read the target table) on next use.
        self.relations[msg.relation_id] = msg
        self._mappings.pop(msg.relation_id, None)
        self._statements = {k: v for k, v in self._statements.items() if k[1] != msg.relation_id}

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
        self._sql("BEGIN")

    def origin(self, msg: Origin) -> None:
        self.current_origin = msg

    def commit(self, txn: TransactionEnd) -> None:
        self._current = None
        if self._skipping:
            self._skipping = False
            return
        self._sql(PROGRESS_SQL, [self.slot.encode(), str(txn.commit_lsn).encode(),
                                 str(txn.end_lsn).encode(), txn.commit_time.isoformat().encode()])
        self._sql("COMMIT")
        self.applied = AppliedPosition(txn.commit_lsn, txn.end_lsn)
        self.applied_counts["transactions"] += 1
        self.on_commit(txn.end_lsn)

    def abort_open_transaction(self) -> None:
        """Roll back a transaction left open by an error, a lost source or a stop signal."""
        self._current = None
        self._skipping = False
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
        present = tuple(i for i, k in enumerate(new.kinds) if k != KIND_UNCHANGED)
        key = ("I", msg.relation_id, present)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = insert_statement(mapping, present)
        result = self._execute(statement, new, None, mapping)
        self.applied_counts["insert"] += 1
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
        statement = self._update_statement(mapping, assigned, key_source, key_positions,
                                           not mapping.full_identity)
        result = self._execute(statement, new, old, mapping)
        self.applied_counts["update"] += 1
        if _rowcount(result) == 0:
            self._conflict(mapping, "update_missing")

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
            self._conflict(mapping, "delete_missing")

    def _truncate(self, msg: Truncate) -> None:
        names = [self._mapping(relation_id).table.sql_name for relation_id in msg.relation_ids]
        if names:
            self._sql(truncate_sql(names, msg.restart_identity))
            self.applied_counts["truncate"] += 1

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


def _rowcount(result) -> int:  # noqa: ANN001 - a psycopg PGresult
    tuples = result.command_tuples
    return int(tuples) if tuples is not None else 0
