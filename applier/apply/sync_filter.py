"""Which tables' changes a source transaction must not apply: those already in their copy.

Owns the rule (PostgreSQL's tablesync rule, ``should_apply_changes_for_rel``) that a change to a
table copied by ``applier sync`` from a snapshot whose consistent point is L is in the copy when
its transaction commits before L, and must be applied from L on. Pure logic: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..progress.records import TableName
from ..protocol.lsn import LSN

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
