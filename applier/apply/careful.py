"""The careful path: one statement per row change, every conflict detected and resolved.

Owns applying an Insert, Update, Delete or Truncate on its own, with a cached prepared statement
per row shape (``statements``), and handing every statement that changed no row to the conflict
handler (``conflicts``), which detects, records and resolves the conflict under its policy. A
change of a table the change feed records runs as one statement that also writes its change row
(``feed.FeedWriter.wrap``), so the row count stays the data statement's. Used
for every transaction the fast path does not take: diverted ones (two-phase), those after a fast
path failure up to ``careful_until``, and all of them without ``BatchLimits``. Must never begin or
end a transaction (``transaction.TargetTransaction`` does).
"""

from __future__ import annotations

from collections.abc import Sequence

from psycopg import pq

from ..protocol.messages import KIND_UNCHANGED, Delete, Insert, Truncate, TupleData, Update
from .conflicts import ConflictHandler
from .feed.meta import Meta, text_meta
from .mapping import RelationMapping
from .relation_cache import RelationCache
from .statements import (
    NEW,
    Statement,
    delete_statement,
    identity_assigned,
    identity_sql,
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

    def _feed(self, statement: Statement, mapping: RelationMapping, meta: Meta | None,
              op: str) -> Statement:
        if meta is None:
            return statement
        feed = self.tx.feed
        assert feed is not None
        return feed.wrap(statement, mapping, op)

    def insert(self, mapping: RelationMapping, msg: Insert, meta: Meta | None = None) -> None:
        new = msg.new_tuple
        present = tuple(i for i, k in enumerate(new.kinds) if k != KIND_UNCHANGED)
        key = ("I", msg.relation_id, present)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = insert_statement(mapping, present)
        values = text_meta(meta) if meta is not None else ()
        result = self.tx.execute_row(self._feed(statement, mapping, meta, "I"), new, None, mapping,
                                     values)
        if statement.conflict_key and _rowcount(result) == 0:
            # The key exists already (a row written on the target): under policy apply the
            # source's row wins, as an update by that key.
            if self.conflicts.insert_exists(mapping, new, statement.conflict_key):
                self._update_row(mapping, present, NEW, statement.conflict_key, True, new, None,
                                 meta, "I", values, guarded=False)

    def update(self, mapping: RelationMapping, msg: Update, key_source: int,
               key_positions: tuple[int, ...], meta: Meta | None = None,
               moved: tuple[int, ...] | None = None, moved_meta: Meta | None = None) -> None:
        """``moved``: the update moves its row to another key; the old row's positions to record
        as the delete of that key, under ``moved_meta``."""
        new, old = msg.new_tuple, msg.old_tuple
        assigned = tuple(i for i, k in enumerate(new.kinds) if k != KIND_UNCHANGED)
        by_key = not mapping.full_identity
        values = text_meta(meta) if meta is not None else ()
        # Only rows this worker wrote, when update_origin_differs is detected.
        result, statement = self._update_row(mapping, assigned, key_source, key_positions, by_key,
                                             new, old, meta, "U", values,
                                             guarded=self.conflicts.origin_id is not None)
        if _rowcount(result) == 0:
            self.conflicts.update_not_applied(mapping, new, old, key_source, key_positions, by_key,
                                              self._feed(statement, mapping, meta, "U"), values)
        elif moved is not None and moved_meta is not None and self.tx.feed is not None:
            assert old is not None
            self.tx.feed.moved(mapping, old, moved, moved_meta)

    def _update_row(self, mapping: RelationMapping, assigned: tuple[int, ...], key_source: int,
                    key_positions: tuple[int, ...], by_key: bool, new: TupleData,
                    old: TupleData | None, meta: Meta | None, op: str,
                    values: Sequence[bytes | None], guarded: bool,
                    ) -> tuple[pq.abc.PGresult, Statement]:
        """Run the update of ``assigned`` (``guarded``: only of a row this worker wrote); its
        result and its statement without the guard."""
        statement = self.update_statement(mapping, assigned, key_source, key_positions, by_key)
        run = self.conflicts.guard(statement) if guarded else statement
        result = self.tx.execute_row(self._feed(run, mapping, meta, op), new, old, mapping, values)
        identity = identity_assigned(mapping, assigned)
        if _rowcount(result) == 0 and identity:
            # The row may be there with another value in a GENERATED ALWAYS identity column,
            # which no UPDATE may set (statements.assignments): set it with the column made BY
            # DEFAULT for that statement, in this transaction only, as PostgreSQL's subscriber
            # writes the source's value whatever the column's kind.
            setting = self.update_statement(mapping, assigned, key_source, key_positions, by_key,
                                            set_identity=True)
            run = self.conflicts.guard(setting) if guarded else setting
            for text in identity_sql(mapping, identity, always=False):
                self.tx.sql(text)
            result = self.tx.execute_row(self._feed(run, mapping, meta, op), new, old, mapping,
                                         values)
            for text in identity_sql(mapping, identity, always=True):
                self.tx.sql(text)
        return result, statement

    def delete(self, mapping: RelationMapping, msg: Delete, meta: Meta | None = None) -> None:
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
        result = self.tx.execute_row(self._feed(statement, mapping, meta, "D"), None, old, mapping,
                                     text_meta(meta) if meta is not None else ())
        if _rowcount(result) == 0:
            self.conflicts.delete_missing(mapping, old, positions, not mapping.full_identity)

    def truncate(self, msg: Truncate, tables: list[tuple[str, str]],
                 markers: Sequence[str] = ()) -> None:
        """TRUNCATE, then the change feed's marker rows of the recorded tables among them."""
        self.tx.sql(truncate_sql(tables, msg.restart_identity))
        for marker in markers:
            self.tx.sql(marker)

    def update_statement(self, mapping: RelationMapping, assigned: tuple[int, ...],
                         key_source: int, key_positions: tuple[int, ...], by_key: bool,
                         set_identity: bool = False) -> Statement:
        key = ("U", mapping.relation.relation_id, assigned, key_source, key_positions, by_key,
               set_identity)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = update_statement(mapping, assigned, key_source,
                                                                 key_positions, by_key, set_identity)
        return statement


def _rowcount(result: pq.abc.PGresult) -> int:
    tuples = result.command_tuples
    return int(tuples) if tuples is not None else 0
