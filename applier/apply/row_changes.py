"""One row change of the open source transaction, to the fast path or the careful path.

Owns how each kind of row change (insert, update, delete, truncate) reaches the target once
the plan has put its transaction on the fast path (``on_fast``) or the careful path, with the
change feed's meta beside each row the feed records. Must never decide a transaction's route
(``plan``), filter changes (``dispatch.Applier.apply_change``) or turn an error into a
decision (``errors``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import Cause
from ..protocol.messages import Delete, Insert, Truncate, Update
from .careful import CarefulPath, update_key
from .fast.path import FastPath
from .feed.writer import moved_key
from .mapping import RelationMapping
from .statements import truncate_sql
from .transaction import TargetTransaction

__all__ = ["RowChanges"]


class RowChanges:
    def __init__(self, tx: TargetTransaction, mapping: Callable[[int], RelationMapping],
                 careful: CarefulPath, fast: FastPath | None) -> None:
        self.tx = tx
        self.mapping = mapping
        self.careful = careful
        self.fast = fast
        #: The open source transaction is on the fast path (set at its begin).
        self.on_fast = False

    def insert(self, msg: Insert) -> None:
        mapping = self.mapping(msg.relation_id)
        self.tx.pending["insert"] += 1
        meta = None if mapping.feed is None else self.tx.feed.meta(mapping.feed)  # type: ignore[union-attr]
        if self.on_fast:
            self.fast.insert(mapping, msg.new_tuple, meta)  # type: ignore[union-attr]
        else:
            self.careful.insert(mapping, msg, meta)

    def update(self, msg: Update) -> None:
        mapping = self.mapping(msg.relation_id)
        key_source, key_positions = update_key(mapping, msg)
        if not key_positions:
            raise self.tx.error(f"update on {mapping.table.sql_name} carries no replica identity; "
                                "give the source table a primary key or REPLICA IDENTITY",
                                cause=Cause.NEEDS_OPERATOR)
        self.tx.pending["update"] += 1
        if mapping.feed is not None:
            self._update_recorded(mapping, msg, key_source, key_positions)
        elif self.on_fast:
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
        if self.on_fast:
            assert self.fast is not None
            self.fast.update(mapping, msg.new_tuple, msg.old_tuple, meta,
                             None if moved is None or moved_meta is None else (moved, moved_meta))
        else:
            self.careful.update(mapping, msg, key_source, key_positions, meta, moved, moved_meta)

    def delete(self, msg: Delete) -> None:
        mapping = self.mapping(msg.relation_id)
        self.tx.pending["delete"] += 1
        meta = None if mapping.feed is None else self.tx.feed.meta(mapping.feed)  # type: ignore[union-attr]
        if self.on_fast:
            self.fast.delete(mapping, msg.old_tuple, meta)  # type: ignore[union-attr]
        else:
            self.careful.delete(mapping, msg, meta)

    def truncate(self, msg: Truncate) -> None:
        mappings = [self.mapping(relation_id) for relation_id in msg.relation_ids]
        tables = [(mapping.table.schema, mapping.table.name) for mapping in mappings]
        if not tables:
            return
        feed = self.tx.feed
        markers = feed.truncated(mappings) if feed is not None else []
        if self.on_fast:
            assert self.fast is not None
            self.fast.statement(truncate_sql(tables, msg.restart_identity))
            for marker in markers:
                self.fast.statement(marker)
        else:
            self.careful.truncate(msg, tables, markers)
        self.tx.pending["truncate"] += 1
