"""Skipping one poison source transaction, crash-safely (``applier skip``, ``run --skip-lsn``).

A request names the *finish LSN* of a source transaction: its commit LSN, or for a prepared
transaction its prepare LSN (or, deferred until COMMIT PREPARED, that commit LSN) — the LSN the
worker's error message prints. It is stored in ``applier.skip_requests`` on the target (by
``applier skip``, through ``progress.bookkeeping``), so it
survives restarts and needs no running worker. When that transaction arrives, none of its
changes are applied, and one target transaction records it in
``applier.skipped_transactions`` (LSNs, xid, GID, how many changes and which tables), deletes the
request and records the position past it: a crash before that commit finds the request still
there and skips the redelivered transaction again; a crash after it finds the position past it.
This is PostgreSQL's ``ALTER SUBSCRIPTION ... SKIP`` (worker.c: maybe_start_skipping_changes,
clear_subscription_skip_lsn). A request the stream has passed without meeting its LSN is
dropped with a warning, since it can never match.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..faults import FailPoint
from ..progress.records import Position, SkippedTransaction
from ..progress.store import ApplyStore
from ..protocol.lsn import LSN
from ..protocol.messages import Truncate
from .divert import Divert

if TYPE_CHECKING:
    from ..assembler import Change, TransactionEnd
    from .relation_cache import RelationCache
    from .transaction import TargetTransaction

__all__ = ["SkipRequests", "Skipper", "describe_request"]

log = logging.getLogger(__name__)


def describe_request(slot: str, lsn: LSN, previous: LSN | None) -> str:
    """What a stored skip request will do, for the operator."""
    replaced = f" (replacing the request for {previous})" if previous and previous != lsn else ""
    return (f"slot {slot!r}: the source transaction finishing at {lsn} will be skipped the next "
            f"time a worker reaches it{replaced}")


class SkipRequests:
    """The request in force for this slot (at most one), as read at session start."""

    def __init__(self, store: ApplyStore, lsn: LSN | None) -> None:
        self.store = store
        self.lsn = lsn

    def matches(self, *finish_lsns: int) -> bool:
        return self.lsn is not None and self.lsn in finish_lsns

    def passed_by(self, finish_lsn: int) -> bool:
        return self.lsn is not None and self.lsn < finish_lsn

    def drop_stale(self, finish_lsn: int) -> None:
        """The stream reached a transaction finishing after the requested LSN without meeting
        it: the request can never match. In or outside a target transaction."""
        assert self.lsn is not None
        log.warning("skip request for slot %r at LSN %s dropped: the next source transaction "
                    "finishes at %s, after it, so no transaction finishes at %s (was it the "
                    "finish LSN printed by the error?)", self.store.slot, self.lsn, LSN(finish_lsn),
                    self.lsn)
        self.store.drop_skip_request(self.lsn)
        self.lsn = None

    def record(self, skipped: SkippedTransaction) -> None:
        """Inside the open target transaction: what was skipped, and the request is done."""
        assert self.lsn is not None
        self.store.record_skipped(skipped, self.lsn)
        log.warning("skipped source transaction xid %s finishing at %s (%s): %d change(s) to %s "
                    "not applied, as requested; recorded in applier.skipped_transactions",
                    skipped.xid, skipped.finish_lsn, skipped.kind, skipped.changes,
                    ", ".join(skipped.tables) or "no table")
        self.lsn = None


class Skipper(Divert):
    """Receives the skipped transaction: counts its changes, then records the skip."""

    what = "skipped on request"

    def __init__(self, tx: TargetTransaction, relations: RelationCache, skips: SkipRequests) -> None:
        self.tx = tx
        self.relations = relations
        self.skips = skips
        self.changes = 0
        self.tables: set[str] = set()

    def change(self, msg: Change) -> None:
        self.changes += 1
        relation_ids = msg.relation_ids if isinstance(msg, Truncate) else (
            (msg.relation_id,) if hasattr(msg, "relation_id") else ())
        for relation_id in relation_ids:
            name = self.relations.table_name(relation_id)
            if name is not None:
                self.tables.add(name)

    def commit(self, txn: TransactionEnd) -> None:
        self._finish(txn, "stream_commit" if txn.streamed else "commit")

    def prepare(self, txn: TransactionEnd) -> None:
        self._finish(txn, "stream_prepare" if txn.streamed else "prepare")

    def _finish(self, txn: TransactionEnd, kind: str) -> None:
        self.tx.begin()
        self.skips.record(SkippedTransaction(kind, txn.commit_lsn, txn.end_lsn, txn.xid, txn.gid,
                                             self.changes, tuple(sorted(self.tables))))
        self.tx.commit(Position(txn.commit_lsn, txn.end_lsn, txn.commit_time), FailPoint.AFTER_SKIP)
