"""Which target table each source relation writes to, made to fit before it is used.

Owns handing out a relation's ``RelationMapping``: with ``--schema-changes follow`` the target
table is first altered to fit the source's Relation message (``schema_follow.SchemaFollower``), and a
table the change feed records has its change table aligned too; both changes belong to the open
target transaction, so the relations they touched are read again if it rolls back. Also keeps the
source's Type messages, which name the types of new columns. Must never apply a row change.
"""

from __future__ import annotations

from ..protocol.messages import Relation, Type
from .mapping import RelationMapping
from .relation_cache import RelationCache
from .schema_follow import ColumnSource, SchemaFollower, TypeCache
from .transaction import TargetTransaction

__all__ = ["TableMappings"]


class TableMappings:
    def __init__(self, tx: TargetTransaction, relations: RelationCache, *, follow_schema: bool,
                 source: ColumnSource | None = None) -> None:
        self.tx = tx
        self.relations = relations
        self.types = TypeCache()
        #: --schema-changes follow: target tables are made to fit the source's Relation messages
        #: (``source``: the source's catalog, for the rows a column added there already has).
        self.schema = SchemaFollower(tx, self.types, source) if follow_schema else None
        #: Relations whose target table (or change table) a change in the open target transaction
        #: altered: read again if it rolls back.
        self._altered: set[int] = set()
        tx.on_end.append(self._transaction_ended)

    def learn(self, msg: Relation) -> None:
        """A Relation message. A table the open transaction altered is known better here than by
        reading it on another connection, which does not see the change yet."""
        self.relations.learn(msg, keep_target=msg.relation_id in self._altered)

    def learn_type(self, msg: Type) -> None:
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
