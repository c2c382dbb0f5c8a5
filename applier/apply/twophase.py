"""Two-phase source transactions (protocol 3+, a slot created with two_phase).

The source sends a prepared transaction at PREPARE TRANSACTION (Begin Prepare ... Prepare, or a
streamed transaction ending in Stream Prepare), and later a Commit Prepared or Rollback Prepared
carrying only its xid and GID. Once the worker confirms a position past a prepare, the source
never sends that transaction's content again: at Commit Prepared it sends the commit alone
(PostgreSQL reorderbuffer.c: ReorderBufferFinishPrepared). So by the time a prepare is confirmed
its content must be durably on the target, in one of two forms.

Mode ``prepare`` (default when the target has ``max_prepared_transactions > 0``)
    The transaction is applied and ``PREPARE TRANSACTION``\\ d on the target under a GID derived
    from the slot, the target database and the source xid (``applier_<db oid>_<xid>_<slot>``;
    never the source's GID, which other consumers of the same source use too, PostgreSQL's
    ``pg_gid_<sub oid>_<xid>`` rule). A small transaction then records the position past the
    prepare. Commit Prepared / Rollback Prepared run ``COMMIT PREPARED`` / ``ROLLBACK PREPARED``
    on arrival, then record the position in a transaction of their own.
Mode ``defer`` (default otherwise)
    Nothing becomes visible: the transaction's messages are stored, re-encoded as pgoutput bytes
    (relations first), in ``applier.prepared_changes``, committed together with the position past
    the prepare. Commit Prepared replays them through the normal apply path and deletes them in
    the same target transaction as its position; Rollback Prepared deletes them.

Either way ``applier.prepared_transactions`` has a row per pending prepared transaction (in
prepare mode written inside the target's prepared transaction itself, so it becomes visible
exactly when that commits; it carries the transaction's origin, recorded in ``applier.origins``
at commit). Crash safety, case by case (the apply stage's rule "finish LSN at or below the
recorded position: already handled" covers everything once a position is recorded):

* killed after the target PREPARE, before its position: the source resends the prepare; its GID
  is found in ``pg_prepared_xacts`` and nothing is applied twice; the position is then recorded.
* killed after COMMIT/ROLLBACK PREPARED on the target, before its position: the source resends
  Commit/Rollback Prepared; the GID is gone, so it is handled as already finished, and the
  position recorded.
* killed in the middle of a (streamed) prepare: the open target transaction dies with the
  connection; the source resends the whole transaction.
* a Commit/Rollback Prepared whose transaction is on the target in neither form (it was skipped,
  came from a skipped origin, or was finished before a crash) only records the position.

With the change feed, the change rows of a transaction prepared on the target are written in it
with a pending commit LSN and take the COMMIT PREPARED's LSN in the transaction that records it
(a deferred one is applied at COMMIT PREPARED, so its rows have their LSN at once).

Empty prepared transactions and prepared transactions with (rolled back) savepoints need nothing
special: the source sends what the transaction contains at prepare time. A prepared transaction
pending on the target holds its row locks, exactly as it does on the source, and never the
progress row or an origin row, so later transactions commit past it.

Must never read the network stream or decide transaction boundaries; the apply stage calls it.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from .. import faults
from ..assembler import TransactionEnd, TransactionStart
from ..faults import FailPoint
from ..progress.records import Position, PreparedHeader, SkippedTransaction
from ..protocol import decode
from ..protocol.encoder import encode
from ..protocol.lsn import LSN
from ..protocol.messages import CommitPrepared, Message, Relation, RollbackPrepared, Truncate
from .ddl import DDL_INLINE, DDL_SEPARATELY
from .divert import Divert
from .origins import OriginTracker
from .plan import already_applied
from .relation_cache import RelationCache
from .skipping import SkipRequests
from .transaction import TargetTransaction

if TYPE_CHECKING:
    from ..assembler import Change

__all__ = ["MODES", "GID_MAX_BYTES", "PreparedHost", "TwoPhase", "is_target_gid", "resolve_mode",
           "target_gid"]

log = logging.getLogger(__name__)

MODES = ("prepare", "defer")
GID_MAX_BYTES = 199  # PostgreSQL: GIDSIZE 200 including the terminating NUL
_LENGTH = struct.Struct(">I")
_CHUNK_BYTES = 1 << 20


class PreparedHost(Protocol):
    """What two-phase handling needs of the apply stage (``dispatch.Applier``)."""

    @property
    def relations(self) -> RelationCache: ...

    def relation(self, msg: Relation) -> None: ...

    def change(self, msg: Change) -> None: ...

    def apply_change(self, msg: Change) -> None:
        """Apply a change of the open transaction as the careful path does, whatever divert it has."""


def target_gid(slot: str, database_oid: int, xid: int) -> str:
    gid = f"applier_{database_oid}_{xid}_{slot}"
    if len(gid.encode()) > GID_MAX_BYTES:  # slot names have at most 63 bytes: cannot happen
        raise ValueError(f"prepared transaction GID {gid!r} is longer than {GID_MAX_BYTES} bytes")
    return gid


def is_target_gid(gid: str, slot: str) -> bool:
    """``gid`` is one ``target_gid`` made for ``slot`` (of any database and xid)."""
    database_oid, _, rest = gid.removeprefix("applier_").partition("_")
    xid, _, named = rest.partition("_")
    return gid.startswith("applier_") and database_oid.isdigit() and xid.isdigit() and named == slot


def resolve_mode(requested: str, max_prepared_transactions: int) -> str:
    """``auto`` -> prepare when the target can hold prepared transactions, else defer."""
    if requested == "auto":
        return "prepare" if max_prepared_transactions > 0 else "defer"
    if requested == "prepare" and max_prepared_transactions <= 0:
        raise ValueError("--two-phase-mode prepare needs max_prepared_transactions > 0 on the "
                         "target (it is 0); raise it and restart the target, or use "
                         "--two-phase-mode defer")
    if requested not in MODES:
        raise ValueError(f"two-phase mode must be auto, prepare or defer, not {requested!r}")
    return requested


class TwoPhase:
    def __init__(self, tx: TargetTransaction, mode: str, database_oid: int, skips: SkipRequests,
                 origins: OriginTracker, chunk_bytes: int = _CHUNK_BYTES) -> None:
        if mode not in MODES:
            raise ValueError(mode)
        self.tx = tx
        self.mode = mode
        self.database_oid = database_oid
        self.skips = skips
        self.origins = origins
        self.chunk_bytes = chunk_bytes

    def gid(self, xid: int) -> str:
        return target_gid(self.tx.store.slot, self.database_oid, xid)

    # -- Begin Prepare ... Prepare --------------------------------------------------------------
    def begin(self, host: PreparedHost, txn: TransactionStart) -> Divert:
        """Decide where a prepared transaction's changes go; opens the target transaction."""
        tx = self.tx
        if tx.is_prepared(self.gid(txn.xid)) or tx.store.prepared_held(txn.xid):
            log.info("prepared transaction xid %d (prepare LSN %s) is already held on the target",
                     txn.xid, txn.commit_lsn)
            return _AlreadyPrepared(tx)
        tx.begin()
        if self.mode == "defer":
            return _Deferred(self, host, txn)
        # A schema change inside a transaction prepared on the target would hold the table's
        # ACCESS EXCLUSIVE lock until COMMIT PREPARED, while later source transactions that
        # touch the table wait for it: it is made on its own first (schema.DDL_SEPARATELY).
        tx.schema_changes = DDL_SEPARATELY
        if tx.feed is not None:
            tx.feed.defer()  # its change rows get their commit LSN at COMMIT PREPARED
        return _Preparing(self, host)

    def store_header(self, txn: TransactionEnd, mode: str, changes: int) -> None:
        origin = self.tx.origin
        self.tx.store.store_prepared(PreparedHeader(
            txn.xid, mode, txn.gid or "", txn.commit_lsn, txn.end_lsn, txn.commit_time,
            origin.name if origin else None,
            origin.origin_lsn if origin and origin.origin_lsn else None, changes))

    # -- Commit Prepared / Rollback Prepared ----------------------------------------------------
    def commit_prepared(self, host: PreparedHost, msg: CommitPrepared) -> None:
        tx = self.tx
        if already_applied(msg.commit_lsn, tx.applied.commit_lsn):
            log.info("commit prepared of xid %d at %s: already applied", msg.xid, msg.commit_lsn)
            return
        tx.start(TransactionStart(msg.xid, msg.commit_lsn, msg.commit_time, streamed=False,
                                  gid=msg.gid, end_lsn=msg.end_lsn))
        skips = self.skips
        skipping = skips.matches(msg.commit_lsn)
        header = self._end_prepared(msg.xid, commit=not skipping,
                                    fault=FailPoint.AFTER_COMMIT_PREPARED)
        moved = False
        if header is not None and header.mode == "defer":
            skipping = skipping or skips.matches(header.prepare_lsn)
            if not skipping:
                self._replay(host, msg.xid)
            tx.store.drop_prepared_chunks(msg.xid)
        elif header is not None and not skipping and tx.feed is not None:
            # Prepared on the target: its change rows committed just now, pending; they take
            # the commit's LSN in the transaction that records it (so exactly once).
            moved = tx.feed.fix_prepared(msg.xid, msg.commit_lsn, msg.commit_time)
        if not skipping and tx.feed is not None:
            recorded = tx.feed.commit_sql(msg.commit_lsn, msg.end_lsn, wrote=moved)
            if recorded is not None:
                tx.sql(recorded)
        if skipping:
            skips.record(SkippedTransaction("commit_prepared", msg.commit_lsn, msg.end_lsn, msg.xid,
                                            msg.gid, header.changes if header else 0, ()))
        else:
            if skips.passed_by(msg.commit_lsn):
                skips.drop_stale(msg.commit_lsn)
            if header is not None and header.origin_name:
                self.origins.record(header.origin_name, header.origin_lsn or LSN(0),
                                    msg.commit_lsn, msg.commit_time)
            if header is None:
                log.info("commit prepared of xid %d (GID %r): not held on the target (finished "
                         "before a restart, skipped, or from a skipped origin)", msg.xid, msg.gid)
        tx.commit(Position(msg.commit_lsn, msg.end_lsn, msg.commit_time))
        tx.counts["transactions"] += 1
        tx.start(None)

    def rollback_prepared(self, msg: RollbackPrepared) -> None:
        tx = self.tx
        if msg.rollback_end_lsn <= tx.applied.end_lsn:
            log.info("rollback prepared of xid %d ending at %s: already applied", msg.xid,
                     msg.rollback_end_lsn)
            return
        header = self._end_prepared(msg.xid, commit=False, fault=FailPoint.AFTER_ROLLBACK_PREPARED)
        if header is not None and header.mode == "defer":
            tx.store.drop_prepared_chunks(msg.xid)
        # A rollback has no commit LSN: the recorded commit LSN stays, the end LSN moves on.
        tx.commit(Position(tx.applied.commit_lsn, msg.rollback_end_lsn, msg.rollback_time))

    # -- helpers --------------------------------------------------------------------------------
    def _end_prepared(self, xid: int, *, commit: bool, fault: FailPoint) -> PreparedHeader | None:
        """Finish the target's prepared transaction (if it is still there: it is not when this
        already happened before a crash, or in defer mode), then open the target transaction that
        records the outcome, and take the transaction's header from the pending table."""
        tx = self.tx
        gid = self.gid(xid)
        if tx.is_prepared(gid):
            tx.finish_prepared(gid, commit)
            faults.hit(fault)
        tx.begin()
        return tx.store.take_prepared(xid)

    def _replay(self, host: PreparedHost, xid: int) -> None:
        """Apply a deferred transaction's stored messages inside the open target transaction.

        The stored Relation messages describe the tables as they were at prepare time; the
        session's own (possibly newer) descriptions are put back afterwards, because the source
        will not resend them."""
        saved: dict[int, Relation | None] = {}
        seq = 0
        while True:
            chunks = self.tx.store.prepared_chunks(xid, seq)
            if not chunks:
                break
            for number, data in chunks:
                seq = number + 1
                for raw in _records(data):
                    msg = decode(raw)
                    if type(msg) is Relation:
                        saved.setdefault(msg.relation_id, host.relations.get(msg.relation_id))
                        host.relation(msg)
                    else:
                        host.change(msg)  # type: ignore[arg-type]
        for relation_id, relation in saved.items():
            host.relations.restore(relation_id, relation)


def _records(data: bytes) -> Iterator[bytes]:
    pos, end = 0, len(data)
    while pos < end:
        length = _LENGTH.unpack_from(data, pos)[0]
        pos += _LENGTH.size
        yield data[pos:pos + length]
        pos += length


def _protocol_violation(host: PreparedHost, tx: TargetTransaction, txn: TransactionEnd) -> Exception:
    return tx.error(f"commit of xid {txn.xid}, which began as a prepared transaction (protocol "
                    "violation)")


class _Preparing(Divert):
    """Mode prepare: applies the changes as they come, then PREPAREs the target transaction."""

    what = "prepared on the target"
    abandonable = True

    def __init__(self, two_phase: TwoPhase, host: PreparedHost) -> None:
        self.two_phase = two_phase
        self.host = host
        self.changes = 0

    def change(self, msg: Change) -> None:
        self.changes += 1
        self.host.apply_change(msg)
        faults.hit(FailPoint.TWO_PHASE_CHANGE)

    def prepare(self, txn: TransactionEnd) -> None:
        two_phase = self.two_phase
        tx = two_phase.tx
        gid = two_phase.gid(txn.xid)
        two_phase.store_header(txn, "prepare", self.changes)
        tx.prepare(gid)
        faults.hit(FailPoint.AFTER_PREPARE)
        log.info("prepared %ssource transaction xid %d (GID %r, prepare LSN %s, %d changes) as "
                 "%r on the target", "streamed " if txn.streamed else "", txn.xid, txn.gid,
                 txn.commit_lsn, self.changes, gid)
        tx.schema_changes = DDL_INLINE
        tx.begin()
        tx.commit(Position(txn.commit_lsn, txn.end_lsn, txn.commit_time))

    def commit(self, txn: TransactionEnd) -> None:
        raise _protocol_violation(self.host, self.two_phase.tx, txn)


class _AlreadyPrepared(Divert):
    """The prepare was applied before a restart: record the position past it only."""

    what = "already prepared"

    def __init__(self, tx: TargetTransaction) -> None:
        self.tx = tx

    def prepare(self, txn: TransactionEnd) -> None:
        self.tx.begin()
        self.tx.commit(Position(txn.commit_lsn, txn.end_lsn, txn.commit_time))


class _Deferred(Divert):
    """Mode defer: stores the transaction's messages on the target until Commit Prepared."""

    what = "deferred until COMMIT PREPARED"
    abandonable = True

    def __init__(self, two_phase: TwoPhase, host: PreparedHost, txn: TransactionStart) -> None:
        self.two_phase = two_phase
        self.host = host
        self.xid = txn.xid
        self.buffer = bytearray()
        self.seq = 0
        self.changes = 0
        self.described: set[int] = set()  # relations whose Relation message is stored already

    def relation(self, msg: Relation) -> None:
        self.described.discard(msg.relation_id)  # store the new description before next use

    def change(self, msg: Change) -> None:
        if isinstance(msg, Truncate):
            relation_ids: tuple[int, ...] = msg.relation_ids
        elif isinstance(msg, Message):
            relation_ids = ()
        else:
            relation_ids = (msg.relation_id,)
        relations = self.host.relations
        for relation_id in relation_ids:
            if relation_id not in self.described:
                relation = relations.get(relation_id)
                if relation is None:
                    raise self.two_phase.tx.error(f"change for relation id {relation_id} before its "
                                                  "Relation message (protocol violation)")
                relations.check_binary_values(relation_id)
                self._append(encode(relation))
                self.described.add(relation_id)
        self._append(encode(msg))
        self.changes += 1
        faults.hit(FailPoint.TWO_PHASE_CHANGE)

    def _append(self, raw: bytes) -> None:
        self.buffer += _LENGTH.pack(len(raw))
        self.buffer += raw
        if len(self.buffer) >= self.two_phase.chunk_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.buffer:
            return
        self.two_phase.tx.store.store_prepared_chunk(self.xid, self.seq, bytes(self.buffer))
        self.seq += 1
        self.buffer.clear()

    def prepare(self, txn: TransactionEnd) -> None:
        self._flush()
        self.two_phase.store_header(txn, "defer", self.changes)
        log.info("deferred %ssource transaction xid %d (GID %r, prepare LSN %s, %d changes) "
                 "until COMMIT PREPARED", "streamed " if txn.streamed else "", txn.xid, txn.gid,
                 txn.commit_lsn, self.changes)
        self.two_phase.tx.commit(Position(txn.commit_lsn, txn.end_lsn, txn.commit_time))

    def commit(self, txn: TransactionEnd) -> None:
        raise _protocol_violation(self.host, self.two_phase.tx, txn)
