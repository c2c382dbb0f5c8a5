"""The relations the stream described, and their mappings onto target tables, cached.

Owns the Relation messages seen in this session (by relation id, and the one before the latest
of each, so a schema change can be told from a difference that was always there), the target
table of each as read from the target (or as a schema change in the open target transaction made
it), and the ``RelationMapping`` of each onto its table, built the first time a change needs it
and dropped whenever a new Relation message describes that relation again. With
``binary_check`` (``--binary auto``) a relation whose binary values would not mean the same on
the target raises ``TextValuesNeeded`` before any of its values is used. The mapping of a table
the change feed records carries its change table. Must never run a statement on the apply
session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..errors import Cause, TextValuesNeeded
from ..progress.feed import ChangeTable
from ..protocol.messages import Relation
from .mapping import MappingError, RelationMapping, TargetTable, map_relation

__all__ = ["RelationCache", "UnknownRelation"]


class UnknownRelation(MappingError):
    """A change names a relation id no Relation message described (a protocol violation)."""

    kind = Cause.PROTOCOL


class RelationCache:
    def __init__(self, reflect: Callable[[str, str], TargetTable], *, binary_check: bool = False,
                 feeds: dict[tuple[str, str], ChangeTable] | None = None) -> None:
        self._reflect = reflect
        #: The change tables of the tables whose changes the change feed records.
        self.feeds = feeds or {}
        #: The stream's binary values were not asked for by the user (--binary auto): each
        #: relation must be binary-safe (``RelationMapping.binary_safe``), else TextValuesNeeded.
        self.binary_check = binary_check
        self._relations: dict[int, Relation] = {}
        self._previous: dict[int, Relation] = {}
        self._tables: dict[int, TargetTable] = {}
        self._mappings: dict[int, RelationMapping] = {}
        #: Everything else built from a relation's description or target table (statements, key
        #: getters, prepared SQL), dropped with it: see ``on_forget``.
        self._dependents: list[Callable[[int], None]] = []

    def on_forget(self, drop: Callable[[int], None]) -> None:
        """Call ``drop(relation_id)`` whenever the relation's description or target table
        changes (a Relation message, a schema change, the rollback of one): each structure built
        per relation registers here, so that none outlives what it was built from."""
        self._dependents.append(drop)

    def _dropped(self, relation_id: int) -> None:
        self._mappings.pop(relation_id, None)
        for drop in self._dependents:
            drop(relation_id)

    def __contains__(self, relation_id: int) -> bool:
        return relation_id in self._relations

    def get(self, relation_id: int) -> Relation | None:
        return self._relations.get(relation_id)

    def previous(self, relation_id: int) -> Relation | None:
        """The relation's description before the latest one, in this session."""
        return self._previous.get(relation_id)

    def learn(self, msg: Relation, *, keep_target: bool = False) -> None:
        """A Relation message: the mapping is rebuilt (and the target table read again, unless
        ``keep_target``: a schema change not committed yet made it) on next use."""
        old = self._relations.get(msg.relation_id)
        if old is not None and old != msg:
            self._previous[msg.relation_id] = old
        self._relations[msg.relation_id] = msg
        if not keep_target:
            self._tables.pop(msg.relation_id, None)
        self._dropped(msg.relation_id)

    def forget(self, relation_id: int) -> None:
        """Drop what was derived for the relation: it is read and built again on next use."""
        self._tables.pop(relation_id, None)
        self._dropped(relation_id)

    def forget_all(self, relation_ids: Iterable[int]) -> None:
        for relation_id in relation_ids:
            self.forget(relation_id)

    def restore(self, relation_id: int, relation: Relation | None) -> None:
        """Put back a relation's description after replaying older ones (deferred two-phase)."""
        if relation is not None:
            self.learn(relation)
        else:
            self._relations.pop(relation_id, None)
            self.forget(relation_id)

    def table_name(self, relation_id: int) -> str | None:
        """``schema_follow.table`` of a known relation (as skip records name tables)."""
        relation = self._relations.get(relation_id)
        return None if relation is None else f"{relation.namespace}.{relation.name}"

    def cached(self, relation_id: int) -> RelationMapping | None:
        """The relation's mapping if it is built already (the hot path's lookup)."""
        return self._mappings.get(relation_id)

    def relation(self, relation_id: int) -> Relation:
        relation = self._relations.get(relation_id)
        if relation is None:
            raise UnknownRelation(f"change for relation id {relation_id} before its Relation "
                                  "message (protocol violation)")
        return relation

    def target(self, relation_id: int) -> TargetTable:
        """The relation's target table (``MissingTargetTable`` when there is none)."""
        table = self._tables.get(relation_id)
        if table is None:
            relation = self.relation(relation_id)
            table = self._tables[relation_id] = self._reflect(relation.namespace, relation.name)
        return table

    def set_target(self, relation_id: int, table: TargetTable) -> None:
        """The relation's target table as a schema change made it (not committed yet)."""
        self._tables[relation_id] = table
        self._dropped(relation_id)

    def mapping(self, relation_id: int) -> RelationMapping:
        """The relation's mapping onto its target table; ``MappingError`` when there is none."""
        mapping = self._mappings.get(relation_id)
        if mapping is not None:
            return mapping
        table = self.target(relation_id)
        mapping = map_relation(self.relation(relation_id), table,
                               self.feeds.get((table.schema, table.name)) if self.feeds else None)
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
                self.mapping(relation_id)
            except MappingError:
                pass
