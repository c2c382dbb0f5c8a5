"""Which tables' changes a source transaction must not apply: those already in their copy.

Owns the rule (PostgreSQL's tablesync rule, ``should_apply_changes_for_rel``) that a change to a
table copied by ``applier sync`` from a snapshot whose consistent point is L is in the copy when
its transaction commits before L, and must be applied from L on. Pure logic: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from ..assembler import Change
from ..progress.records import TableName
from ..protocol.lsn import LSN
from ..protocol.messages import Message, Relation, Truncate

__all__ = ["SyncFilter"]


class SyncFilter:
    """Which tables' changes the current source transaction must not apply.

    A table copied from a snapshot whose consistent point is L holds every transaction whose
    commit record starts before L, and none from L on (a slot decodes exactly the transactions
    committing at or after its consistent point). So a change to that table is skipped when the
    transaction's commit LSN is < L and applied when it is >= L: PostgreSQL's tablesync rule
    (should_apply_changes_for_rel). Once the stream is past every L the filter switches off.
    """

    def __init__(self, sync_lsns: Mapping[TableName, LSN]) -> None:
        self._lsns = dict(sync_lsns)
        self.skipped: frozenset[TableName] = frozenset()
        self._commit_lsn: LSN | None = None  # of the transaction being applied

    def add(self, table: TableName, sync_lsn: LSN) -> None:
        """A table copied while the stream runs (added to a publication): the transaction being
        applied, and every later one, is filtered for it too."""
        self._lsns[table] = sync_lsn
        if self._commit_lsn is not None:
            self.begin(self._commit_lsn)

    def begin(self, commit_lsn: LSN) -> None:
        self._commit_lsn = commit_lsn
        if not self._lsns:
            return
        self.skipped = frozenset(t for t, lsn in self._lsns.items() if commit_lsn < lsn)
        if not self.skipped:
            # Commit LSNs only grow: no later transaction can fall below any sync LSN either.
            self._lsns.clear()

    @property
    def active(self) -> bool:
        """Some table's copy may still hold transactions to come."""
        return bool(self._lsns)

    def skips(self, schema: str, table: str) -> bool:
        return (schema, table) in self.skipped

    def kept(self, msg: Change, relation: Callable[[int], Relation | None]) -> Change | None:
        """``msg`` without the tables whose copy already holds this transaction (None: nothing
        of it is left). ``relation``: the Relation message of a relation id, if known."""
        if isinstance(msg, Message):
            return msg
        ids = msg.relation_ids if isinstance(msg, Truncate) else (msg.relation_id,)
        kept = []
        for relation_id in ids:
            known = relation(relation_id)
            if known is None or not self.skips(known.namespace, known.name):
                kept.append(relation_id)
        if not kept:
            return None
        if len(kept) == len(ids):
            return msg
        assert isinstance(msg, Truncate)
        return replace(msg, relation_ids=tuple(kept))
