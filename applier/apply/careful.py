"""The careful path: one statement per row change, every conflict detected and resolved.

Owns applying an Insert, Update, Delete or Truncate on its own, with a cached prepared statement
per row shape (``statements``), and handing every statement that changed no row to the conflict
handler (``conflicts``), which detects, records and resolves the conflict under its policy. Used
for every transaction the fast path does not take: diverted ones (two-phase), those after a fast
path failure up to ``careful_until``, and all of them without ``BatchLimits``. Must never begin or
end a transaction (``transaction.TargetTransaction`` does).
"""

from __future__ import annotations

from psycopg import pq

from ..protocol.messages import KIND_UNCHANGED, Delete, Insert, Truncate, Update
from .conflicts import ConflictHandler
from .mapping import RelationMapping
from .relations import RelationCache
from .statements import (
    NEW,
    Statement,
    delete_statement,
    insert_statement,
    truncate_sql,
    update_statement,
)
from .transaction import TargetTransaction

__all__ = ["CarefulPath", "update_key"]


def update_key(mapping: RelationMapping, msg: Update) -> tuple[int, tuple[int, ...]]:
    """How an update locates its row: (NEW or OLD, source positions of the columns matched)."""
    old = msg.old_tuple
    if old is not None and mapping.full_identity:
        return 1, tuple(i for i, k in enumerate(old.kinds) if k != KIND_UNCHANGED)
    if old is not None:
        return 1, mapping.key_positions
    return NEW, mapping.key_positions


class CarefulPath:
    def __init__(self, tx: TargetTransaction, relations: RelationCache,
                 conflicts: ConflictHandler) -> None:
        self.tx = tx
        self.relations = relations
        self.conflicts = conflicts
        self._statements: dict[tuple[object, ...], Statement] = {}

    def forget(self, relation_id: int) -> None:
        """A relation's definition changed: its statements are built again on next use."""
        self._statements = {k: v for k, v in self._statements.items() if k[1] != relation_id}

    def insert(self, mapping: RelationMapping, msg: Insert) -> None:
        new = msg.new_tuple
        present = tuple(i for i, k in enumerate(new.kinds) if k != KIND_UNCHANGED)
        key = ("I", msg.relation_id, present)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = insert_statement(mapping, present)
        result = self.tx.execute_row(statement, new, None, mapping)
        if statement.conflict_key and _rowcount(result) == 0:
            # The key exists already (a row written on the target): under policy apply the
            # source's row wins, as an update by that key.
            if self.conflicts.insert_exists(mapping, new, statement.conflict_key):
                self.tx.execute_row(self.update_statement(mapping, present, NEW, statement.conflict_key,
                                                   True), new, None, mapping)

    def update(self, mapping: RelationMapping, msg: Update, key_source: int,
               key_positions: tuple[int, ...]) -> None:
        new, old = msg.new_tuple, msg.old_tuple
        assigned = tuple(i for i, k in enumerate(new.kinds) if k != KIND_UNCHANGED)
        by_key = not mapping.full_identity
        statement = self.update_statement(mapping, assigned, key_source, key_positions, by_key)
        conflicts = self.conflicts
        if conflicts.origin_id is None:
            result = self.tx.execute_row(statement, new, old, mapping)
        else:  # only rows this worker wrote: else update_origin_differs
            result = self.tx.execute_row(conflicts.guard(statement), new, old, mapping)
        if _rowcount(result) == 0:
            conflicts.update_not_applied(mapping, new, old, key_source, key_positions, by_key,
                                         statement)

    def delete(self, mapping: RelationMapping, msg: Delete) -> None:
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
        result = self.tx.execute_row(statement, None, old, mapping)
        if _rowcount(result) == 0:
            self.conflicts.delete_missing(mapping, old, positions, not mapping.full_identity)

    def truncate(self, msg: Truncate, tables: list[tuple[str, str]]) -> None:
        self.tx.sql(truncate_sql(tables, msg.restart_identity))

    def update_statement(self, mapping: RelationMapping, assigned: tuple[int, ...],
                         key_source: int, key_positions: tuple[int, ...], by_key: bool) -> Statement:
        key = ("U", mapping.relation.relation_id, assigned, key_source, key_positions, by_key)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = update_statement(mapping, assigned, key_source,
                                                                 key_positions, by_key)
        return statement


def _rowcount(result: pq.abc.PGresult) -> int:
    tuples = result.command_tuples
    return int(tuples) if tuples is not None else 0
