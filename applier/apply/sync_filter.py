"""Which tables' changes a source transaction must not apply: those already in their copy, and
those that must wait for a copy still running beside the stream.

Owns the rule (PostgreSQL's tablesync rule, ``should_apply_changes_for_rel``) that a change to a
table copied by ``applier sync`` from a snapshot whose consistent point is L is in the copy when
its transaction commits before L, and must be applied from L on; for a table the worker copies
while it streams (``applier resync``), a change from L on must also wait until that copy is
committed. Pure logic: no I/O, and no waiting (the apply stage waits when ``waits`` says so).
"""

from __future__ import annotations

import threading
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
        #: Tables being copied beside the stream: their sync LSN, and set once the copy committed.
        self._copying: dict[TableName, tuple[LSN, threading.Event]] = {}
        self.skipped: frozenset[TableName] = frozenset()
        #: Tables whose changes in this transaction must wait for their copy to commit.
        self.waiting: frozenset[TableName] = frozenset()
        #: Some change of this transaction may be skipped or have to wait (one test per change).
        self.filtering = False
        self._commit_lsn: LSN | None = None  # of the transaction being applied

    def copying(self, tables: list[TableName], sync_lsn: LSN, done: threading.Event) -> None:
        """Tables emptied and being copied, beside the stream, from a snapshot whose consistent
        point is ``sync_lsn``: their changes committed before it are skipped (the copy holds
        them), later ones wait until ``done`` is set (the copy committed)."""
        for table in tables:
            self._copying[table] = (sync_lsn, done)
        if self._commit_lsn is not None:
            self.begin(self._commit_lsn)

    def begin(self, commit_lsn: LSN) -> None:
        self._commit_lsn = commit_lsn
        if not self._lsns and not self._copying:
            return
        for table, (lsn, done) in list(self._copying.items()):
            if done.is_set():  # copied: an ordinary sync LSN from now on
                del self._copying[table]
                self._lsns[table] = lsn
        self.skipped = frozenset([t for t, lsn in self._lsns.items() if commit_lsn < lsn]
                                 + [t for t, (lsn, _) in self._copying.items() if commit_lsn < lsn])
        self.waiting = frozenset(t for t, (lsn, _) in self._copying.items() if commit_lsn >= lsn)
        self.filtering = bool(self.skipped or self.waiting)
        if not self.filtering and not self._copying:
            # Commit LSNs only grow: no later transaction can fall below any sync LSN either.
            self._lsns.clear()

    def refresh(self) -> None:
        """A copy may have committed meanwhile: decide again for the transaction being applied."""
        if self._commit_lsn is not None:
            self.begin(self._commit_lsn)

    @property
    def active(self) -> bool:
        """Some table's copy may still hold transactions to come, or is still running."""
        return bool(self._lsns or self._copying)

    def waits(self, msg: Change, relation: Callable[[int], Relation | None]) -> bool:
        """``msg`` changes a table whose copy must commit before it is applied."""
        if isinstance(msg, Message) or not self.waiting:
            return False
        ids = msg.relation_ids if isinstance(msg, Truncate) else (msg.relation_id,)
        for relation_id in ids:
            known = relation(relation_id)
            if known is not None and (known.namespace, known.name) in self.waiting:
                return True
        return False

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
