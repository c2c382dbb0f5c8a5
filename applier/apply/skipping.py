"""Skipping one poison source transaction, crash-safely (``applier skip``, ``run --skip-lsn``).

A request names the *finish LSN* of a source transaction: its commit LSN, or for a prepared
transaction its prepare LSN (or, deferred until COMMIT PREPARED, that commit LSN) — the LSN the
worker's error message prints. It is stored in ``applier.skip_requests`` on the target, so it
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

from sqlalchemy import Engine, text

from ..protocol.lsn import LSN
from .divert import Divert
from .session import TargetSession

if TYPE_CHECKING:
    from ..assembler import Change, TransactionEnd, TransactionStart
    from .sink import TargetApplier

__all__ = ["SkipRequests", "Skipper", "read_skip_request", "request_skip"]

log = logging.getLogger(__name__)

_RECORD = ("INSERT INTO applier.skipped_transactions (slot_name, finish_lsn, end_lsn, xid, "
           "source_gid, kind, changes, tables) VALUES ($1, $2::pg_catalog.pg_lsn, "
           "$3::pg_catalog.pg_lsn, $4::pg_catalog.int8, $5, $6, $7::pg_catalog.int8, "
           "$8::pg_catalog.text[])")
_CLEAR = "DELETE FROM applier.skip_requests WHERE slot_name = $1 AND lsn = $2::pg_catalog.pg_lsn"


def read_skip_request(session: TargetSession, slot: str) -> LSN | None:
    result = session.sql("SELECT lsn::text FROM applier.skip_requests WHERE slot_name = $1",
                         [slot.encode()])
    if result.ntuples == 0:
        return None
    return LSN.parse(result.get_value(0, 0).decode())


def request_skip(engine: Engine, slot: str, lsn: LSN) -> str:
    """Store a skip request; returns what will happen, for the operator."""
    with engine.begin() as conn:
        position = conn.execute(text("SELECT commit_lsn::text FROM applier.progress "
                                     "WHERE slot_name = :slot"), {"slot": slot}).scalar()
        if position is not None and lsn <= LSN.parse(position):
            raise ValueError(f"slot {slot!r} has already applied everything up to commit LSN "
                             f"{position}; a transaction finishing at {lsn} is behind it and "
                             "cannot be skipped any more")
        previous = conn.execute(text("SELECT lsn::text FROM applier.skip_requests "
                                     "WHERE slot_name = :slot"), {"slot": slot}).scalar()
        conn.execute(text("INSERT INTO applier.skip_requests (slot_name, lsn) VALUES "
                          "(:slot, CAST(:lsn AS pg_lsn)) ON CONFLICT (slot_name) DO UPDATE SET "
                          "lsn = EXCLUDED.lsn, requested_at = now()"), {"slot": slot, "lsn": str(lsn)})
    replaced = f" (replacing the request for {previous})" if previous and previous != str(lsn) else ""
    return (f"slot {slot!r}: the source transaction finishing at {lsn} will be skipped the next "
            f"time a worker reaches it{replaced}")


class SkipRequests:
    """The request in force for this slot (at most one), as read at session start."""

    def __init__(self, session: TargetSession, slot: str, lsn: LSN | None) -> None:
        self.session = session
        self.slot = slot
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
                    "finish LSN printed by the error?)", self.slot, self.lsn, LSN(finish_lsn),
                    self.lsn)
        self.session.sql(_CLEAR, [self.slot.encode(), str(self.lsn).encode()])
        self.lsn = None

    def record(self, *, kind: str, finish_lsn: int, end_lsn: int | None, xid: int | None,
               gid: str | None, changes: int, tables: list[str]) -> None:
        """Inside the open target transaction: what was skipped, and the request is done."""
        assert self.lsn is not None
        array = "{" + ",".join('"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"'
                               for t in sorted(tables)) + "}"
        self.session.sql(_RECORD, [
            self.slot.encode(), str(LSN(finish_lsn)).encode(),
            None if end_lsn is None else str(LSN(end_lsn)).encode(),
            None if xid is None else str(xid).encode(), None if gid is None else gid.encode(),
            kind.encode(), str(changes).encode(), array.encode()])
        self.session.sql(_CLEAR, [self.slot.encode(), str(self.lsn).encode()])
        log.warning("skipped source transaction xid %s finishing at %s (%s): %d change(s) to %s "
                    "not applied, as requested; recorded in applier.skipped_transactions",
                    xid, LSN(finish_lsn), kind, changes, ", ".join(sorted(tables)) or "no table")
        self.lsn = None


class Skipper(Divert):
    """Receives the skipped transaction: counts its changes, then records the skip."""

    what = "skipped on request"

    def __init__(self, applier: TargetApplier, txn: TransactionStart) -> None:
        self.applier = applier
        self.txn = txn
        self.changes = 0
        self.tables: set[str] = set()

    def change(self, msg: Change) -> None:
        self.changes += 1
        relation_ids = getattr(msg, "relation_ids", None) or (
            (msg.relation_id,) if hasattr(msg, "relation_id") else ())
        for relation_id in relation_ids:
            relation = self.applier.relations.get(relation_id)
            if relation is not None:
                self.tables.add(f"{relation.namespace}.{relation.name}")

    def commit(self, txn: TransactionEnd) -> None:
        self._finish(txn, "stream_commit" if txn.streamed else "commit")

    def prepare(self, txn: TransactionEnd) -> None:
        self._finish(txn, "stream_prepare" if txn.streamed else "prepare")

    def _finish(self, txn: TransactionEnd, kind: str) -> None:
        applier = self.applier
        applier._sql("BEGIN")
        applier.extensions.skips.record(kind=kind, finish_lsn=txn.commit_lsn, end_lsn=txn.end_lsn,
                                        xid=txn.xid, gid=txn.gid, changes=self.changes,
                                        tables=sorted(self.tables))
        applier.finish(txn.commit_lsn, txn.end_lsn, txn.commit_time, fault="after_skip")

