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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import faults
from ..assembler import TransactionEnd, TransactionStart
from ..protocol import decode
from ..protocol.encoder import encode
from ..protocol.lsn import LSN
from ..protocol.messages import CommitPrepared, Message, Relation, RollbackPrepared, Truncate
from .divert import Divert
from .session import TargetSession
from .statements import Statement

if TYPE_CHECKING:
    from ..assembler import Change
    from .sink import TargetApplier

__all__ = ["TwoPhase", "resolve_mode", "target_gid", "MODES"]

log = logging.getLogger(__name__)

MODES = ("prepare", "defer")
GID_MAX_BYTES = 199  # PostgreSQL: GIDSIZE 200 including the terminating NUL
_LENGTH = struct.Struct(">I")
_CHUNK_BYTES = 1 << 20

_HEADER_INSERT = Statement(
    b"applier_2pc_header",
    "INSERT INTO applier.prepared_transactions (slot_name, xid, mode, source_gid, prepare_lsn, "
    "end_lsn, prepare_time, origin_name, origin_lsn, changes) VALUES ($1, $2::pg_catalog.int8, "
    "$3, $4, $5::pg_catalog.pg_lsn, $6::pg_catalog.pg_lsn, $7::pg_catalog.timestamptz, $8, "
    "$9::pg_catalog.pg_lsn, $10::pg_catalog.int8)", ())
_CHUNK_INSERT = Statement(
    b"applier_2pc_chunk",
    "INSERT INTO applier.prepared_changes (slot_name, xid, seq, data) "
    "VALUES ($1, $2::pg_catalog.int8, $3::pg_catalog.int4, $4::pg_catalog.bytea)", ())
_HANDLED = (
    "SELECT pg_catalog.count(*) FROM pg_catalog.pg_prepared_xacts WHERE gid = $1 UNION ALL "
    "SELECT pg_catalog.count(*) FROM applier.prepared_transactions "
    "WHERE slot_name = $2 AND xid = $3::pg_catalog.int8")
_IS_PREPARED = "SELECT 1 FROM pg_catalog.pg_prepared_xacts WHERE gid = $1"
_TAKE_HEADER = (
    "DELETE FROM applier.prepared_transactions WHERE slot_name = $1 AND xid = $2::pg_catalog.int8 "
    "RETURNING mode, prepare_lsn::pg_catalog.text, origin_name, origin_lsn::pg_catalog.text, "
    "changes")
_CHUNKS = (
    "SELECT seq, data FROM applier.prepared_changes WHERE slot_name = $1 "
    "AND xid = $2::pg_catalog.int8 AND seq >= $3::pg_catalog.int4 ORDER BY seq LIMIT 8")
_DROP_CHUNKS = "DELETE FROM applier.prepared_changes WHERE slot_name = $1 AND xid = $2::pg_catalog.int8"


def target_gid(slot: str, database_oid: int, xid: int) -> str:
    gid = f"applier_{database_oid}_{xid}_{slot}"
    if len(gid.encode()) > GID_MAX_BYTES:  # slot names have at most 63 bytes: cannot happen
        raise ValueError(f"prepared transaction GID {gid!r} is longer than {GID_MAX_BYTES} bytes")
    return gid


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


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _lsn(value: int | None) -> bytes | None:
    return None if value is None else str(LSN(value)).encode()


@dataclass(frozen=True)
class _Header:
    mode: str
    prepare_lsn: LSN
    origin_name: str | None
    origin_lsn: LSN | None
    changes: int


class TwoPhase:
    def __init__(self, session: TargetSession, slot: str, mode: str, database_oid: int,
                 chunk_bytes: int = _CHUNK_BYTES) -> None:
        if mode not in MODES:
            raise ValueError(mode)
        self.session = session
        self.slot = slot
        self.mode = mode
        self.database_oid = database_oid
        self.chunk_bytes = chunk_bytes

    def gid(self, xid: int) -> str:
        return target_gid(self.slot, self.database_oid, xid)

    # -- Begin Prepare ... Prepare --------------------------------------------------------------
    def begin(self, applier: TargetApplier, txn: TransactionStart) -> Divert:
        """Decide where a prepared transaction's changes go; opens the target transaction."""
        result = applier._sql(_HANDLED, [self.gid(txn.xid).encode(), self.slot.encode(),
                                         str(txn.xid).encode()])
        if any(int(result.get_value(row, 0)) for row in range(result.ntuples)):
            log.info("prepared transaction xid %d (prepare LSN %s) is already held on the target",
                     txn.xid, txn.commit_lsn)
            return _AlreadyPrepared(self, applier)
        applier._sql("BEGIN")
        if self.mode == "defer":
            return _Deferred(self, applier, txn)
        return _Preparing(self, applier)

    def _write_header(self, applier: TargetApplier, txn: TransactionEnd, mode: str,
                      changes: int) -> None:
        origin = applier.current_origin
        applier._run(_HEADER_INSERT, [
            self.slot.encode(), str(txn.xid).encode(), mode.encode(), (txn.gid or "").encode(),
            _lsn(txn.commit_lsn), _lsn(txn.end_lsn), txn.commit_time.isoformat().encode(),
            origin.name.encode() if origin else None,
            _lsn(origin.origin_lsn) if origin and origin.origin_lsn else None,
            str(changes).encode()])

    # -- Commit Prepared / Rollback Prepared ----------------------------------------------------
    def commit_prepared(self, applier: TargetApplier, msg: CommitPrepared) -> None:
        if msg.commit_lsn <= applier.applied.commit_lsn:
            log.info("commit prepared of xid %d at %s: already applied", msg.xid, msg.commit_lsn)
            return
        applier._current = TransactionStart(msg.xid, msg.commit_lsn, msg.commit_time,
                                            streamed=False, gid=msg.gid, end_lsn=msg.end_lsn)
        skips = applier.extensions.skips
        skipping = skips.matches(msg.commit_lsn)
        header = self._end_prepared(applier, msg.xid, "ROLLBACK" if skipping else "COMMIT",
                                    "after_commit_prepared")
        if header is not None and header.mode == "defer":
            skipping = skipping or skips.matches(header.prepare_lsn)
            if not skipping:
                self._replay(applier, msg.xid)
            applier._sql(_DROP_CHUNKS, [self.slot.encode(), str(msg.xid).encode()])
        if skipping:
            skips.record(kind="commit_prepared", finish_lsn=msg.commit_lsn, end_lsn=msg.end_lsn,
                         xid=msg.xid, gid=msg.gid, changes=header.changes if header else 0,
                         tables=[])
        else:
            if skips.passed_by(msg.commit_lsn):
                skips.drop_stale(msg.commit_lsn)
            if header is not None and header.origin_name:
                applier.extensions.origins.record(header.origin_name, header.origin_lsn or LSN(0),
                                                  msg.commit_lsn, msg.commit_time)
            if header is None:
                log.info("commit prepared of xid %d (GID %r): not held on the target (finished "
                         "before a restart, skipped, or from a skipped origin)", msg.xid, msg.gid)
        applier.finish(msg.commit_lsn, msg.end_lsn, msg.commit_time)
        applier.applied_counts["transactions"] += 1
        applier._current = None

    def rollback_prepared(self, applier: TargetApplier, msg: RollbackPrepared) -> None:
        if msg.rollback_end_lsn <= applier.applied.end_lsn:
            log.info("rollback prepared of xid %d ending at %s: already applied", msg.xid,
                     msg.rollback_end_lsn)
            return
        header = self._end_prepared(applier, msg.xid, "ROLLBACK", "after_rollback_prepared")
        if header is not None and header.mode == "defer":
            applier._sql(_DROP_CHUNKS, [self.slot.encode(), str(msg.xid).encode()])
        # A rollback has no commit LSN: the recorded commit LSN stays, the end LSN moves on.
        applier.finish(applier.applied.commit_lsn, msg.rollback_end_lsn, msg.rollback_time)

    # -- helpers --------------------------------------------------------------------------------
    def _end_prepared(self, applier: TargetApplier, xid: int, verb: str, fault: str) -> _Header | None:
        """Finish the target's prepared transaction (if it is still there: it is not when this
        already happened before a crash, or in defer mode), then open the target transaction that
        records the outcome, and take the transaction's header from the pending table."""
        gid = self.gid(xid)
        if self._is_prepared(applier, gid):
            applier._sql(f"{verb} PREPARED {_literal(gid)}")
            faults.hit(fault)
        applier._sql("BEGIN")
        return self._take_header(applier, xid)

    def _is_prepared(self, applier: TargetApplier, gid: str) -> bool:
        return applier._sql(_IS_PREPARED, [gid.encode()]).ntuples > 0

    def _take_header(self, applier: TargetApplier, xid: int) -> _Header | None:
        result = applier._sql(_TAKE_HEADER, [self.slot.encode(), str(xid).encode()])
        if result.ntuples == 0:
            return None
        values = [result.get_value(0, i) for i in range(5)]
        text = [v.decode() if v is not None else None for v in values]
        return _Header(text[0] or "", LSN.parse(text[1] or "0/0"), text[2],
                       LSN.parse(text[3]) if text[3] else None, int(text[4] or 0))

    def _replay(self, applier: TargetApplier, xid: int) -> None:
        """Apply a deferred transaction's stored messages inside the open target transaction.

        The stored Relation messages describe the tables as they were at prepare time; the
        session's own (possibly newer) descriptions are put back afterwards, because the source
        will not resend them."""
        saved: dict[int, Relation | None] = {}
        seq = 0
        while True:
            result = applier._query_binary(_CHUNKS, [self.slot.encode(), str(xid).encode(),
                                                     str(seq).encode()])
            if result.ntuples == 0:
                break
            for row in range(result.ntuples):
                seq = int.from_bytes(result.get_value(row, 0), "big", signed=True) + 1
                for raw in _records(result.get_value(row, 1)):
                    msg = decode(raw)
                    if type(msg) is Relation:
                        saved.setdefault(msg.relation_id, applier.relations.get(msg.relation_id))
                        applier.relation(msg)  # type: ignore[arg-type]
                    else:
                        applier.change(msg)  # type: ignore[arg-type]
        for relation_id, relation in saved.items():
            applier.restore_relation(relation_id, relation)


def _records(data: bytes) -> Iterator[bytes]:
    pos, end = 0, len(data)
    while pos < end:
        length = _LENGTH.unpack_from(data, pos)[0]
        pos += _LENGTH.size
        yield data[pos:pos + length]
        pos += length


class _Preparing(Divert):
    """Mode prepare: applies the changes as they come, then PREPAREs the target transaction."""

    what = "prepared on the target"
    abandonable = True

    def __init__(self, two_phase: TwoPhase, applier: TargetApplier) -> None:
        self.two_phase = two_phase
        self.applier = applier
        self.changes = 0

    def change(self, msg: Change) -> None:
        self.changes += 1
        self.applier._apply(msg)
        faults.hit("two_phase_change")

    def prepare(self, txn: TransactionEnd) -> None:
        applier = self.applier
        gid = self.two_phase.gid(txn.xid)
        self.two_phase._write_header(applier, txn, "prepare", self.changes)
        applier._sql(f"PREPARE TRANSACTION {_literal(gid)}")
        faults.hit("after_prepare")
        log.info("prepared %ssource transaction xid %d (GID %r, prepare LSN %s, %d changes) as "
                 "%r on the target", "streamed " if txn.streamed else "", txn.xid, txn.gid,
                 txn.commit_lsn, self.changes, gid)
        applier._sql("BEGIN")
        applier.finish(txn.commit_lsn, txn.end_lsn, txn.commit_time)

    def commit(self, txn: TransactionEnd) -> None:
        raise self.applier._error(f"commit of xid {txn.xid}, which began as a prepared "
                                  "transaction (protocol violation)")


class _AlreadyPrepared(Divert):
    """The prepare was applied before a restart: record the position past it only."""

    what = "already prepared"

    def __init__(self, two_phase: TwoPhase, applier: TargetApplier) -> None:
        self.applier = applier

    def prepare(self, txn: TransactionEnd) -> None:
        self.applier._sql("BEGIN")
        self.applier.finish(txn.commit_lsn, txn.end_lsn, txn.commit_time)


class _Deferred(Divert):
    """Mode defer: stores the transaction's messages on the target until Commit Prepared."""

    what = "deferred until COMMIT PREPARED"
    abandonable = True

    def __init__(self, two_phase: TwoPhase, applier: TargetApplier, txn: TransactionStart) -> None:
        self.two_phase = two_phase
        self.applier = applier
        self.xid = txn.xid
        self.buffer = bytearray()
        self.seq = 0
        self.changes = 0
        self.described: set[int] = set()  # relations whose Relation message is stored already

    def relation(self, msg: Relation) -> None:
        self.described.discard(msg.relation_id)  # store the new description before next use

    def change(self, msg: Change) -> None:
        kind = type(msg)
        if kind is Truncate:
            relation_ids: tuple[int, ...] = msg.relation_ids  # type: ignore[union-attr]
        elif kind is Message:
            relation_ids = ()
        else:
            relation_ids = (msg.relation_id,)  # type: ignore[union-attr]
        for relation_id in relation_ids:
            if relation_id not in self.described:
                relation = self.applier.relations.get(relation_id)
                if relation is None:
                    raise self.applier._error(f"change for relation id {relation_id} before its "
                                              "Relation message (protocol violation)")
                self.applier.check_binary_values(relation_id)
                self._append(encode(relation))
                self.described.add(relation_id)
        self._append(encode(msg))
        self.changes += 1
        faults.hit("two_phase_change")

    def _append(self, raw: bytes) -> None:
        self.buffer += _LENGTH.pack(len(raw))
        self.buffer += raw
        if len(self.buffer) >= self.two_phase.chunk_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.buffer:
            return
        self.applier._run(_CHUNK_INSERT, [self.two_phase.slot.encode(), str(self.xid).encode(),
                                          str(self.seq).encode(), bytes(self.buffer)],
                          [0, 0, 0, 1])
        self.seq += 1
        self.buffer.clear()

    def prepare(self, txn: TransactionEnd) -> None:
        self._flush()
        self.two_phase._write_header(self.applier, txn, "defer", self.changes)
        log.info("deferred %ssource transaction xid %d (GID %r, prepare LSN %s, %d changes) "
                 "until COMMIT PREPARED", "streamed " if txn.streamed else "", txn.xid, txn.gid,
                 txn.commit_lsn, self.changes)
        self.applier.finish(txn.commit_lsn, txn.end_lsn, txn.commit_time)

    def commit(self, txn: TransactionEnd) -> None:
        raise self.applier._error(f"commit of xid {txn.xid}, which began as a prepared "
                                  "transaction (protocol violation)")
