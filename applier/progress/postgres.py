"""``ApplyStore`` on PostgreSQL: the bookkeeping the apply stage writes in its target transactions.

Owns the SQL of every ``applier.*`` read and write made from the apply session: the progress row
(folded with the replication origin's transaction set-up when the session is tagged), origins,
logical messages, conflicts, skip requests and skipped transactions, pending prepared
transactions and their stored changes, the initial copy's transactions and table states. Values
travel as text bytes (binary where a column is ``bytea``), statements that run per transaction
are prepared once per session. Must never open, commit or roll back a transaction: every call
runs in whatever transaction the session has open (the apply stage owns that).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..protocol.lsn import LSN
from .records import (
    AppliedPosition,
    ConflictRecord,
    MessageRecord,
    OriginRecord,
    Position,
    PreparedHeader,
    SchemaChange,
    SkippedTransaction,
    TableName,
)
from .store import Session, StoreStatement, Writer, sync_lsns

__all__ = ["PostgresApplyStore", "encode_lsn"]

#: ``applied_at`` is the clock when the progress row is written, the last statement before COMMIT
#: (``now()`` would be the target transaction's start, which a batch opens before the source
#: commits of the transactions it later takes).
_PROGRESS_UPSERT = (
    "ON CONFLICT (slot_name) DO UPDATE SET commit_lsn = EXCLUDED.commit_lsn, "
    "end_lsn = EXCLUDED.end_lsn, commit_time = EXCLUDED.commit_time, applied_at = EXCLUDED.applied_at")
_PROGRESS = StoreStatement(
    b"applier_progress",
    "INSERT INTO applier.progress (slot_name, commit_lsn, end_lsn, commit_time, applied_at) "
    "VALUES ($1, $2::pg_catalog.pg_lsn, $3::pg_catalog.pg_lsn, $4::pg_catalog.timestamptz, "
    "pg_catalog.clock_timestamp()) " + _PROGRESS_UPSERT)
#: The same upsert, plus pg_replication_origin_xact_setup(end LSN, commit time) in the same round
#: trip, when the session is tagged with a replication origin (``apply.origins``).
_PROGRESS_WITH_ORIGIN = StoreStatement(
    b"applier_progress_origin",
    "INSERT INTO applier.progress (slot_name, commit_lsn, end_lsn, commit_time, applied_at) "
    "SELECT $1, $2::pg_catalog.pg_lsn, $3::pg_catalog.pg_lsn, $4::pg_catalog.timestamptz, "
    "pg_catalog.clock_timestamp() FROM pg_catalog.pg_replication_origin_xact_setup("
    "$3::pg_catalog.pg_lsn, $4::pg_catalog.timestamptz) " + _PROGRESS_UPSERT)
_TEXT_4 = (0, 0, 0, 0)
_POSITION = "SELECT commit_lsn::text, end_lsn::text FROM applier.progress WHERE slot_name = $1"
_TOUCH = "UPDATE applier.progress SET applied_at = applied_at WHERE slot_name = $1"

_ORIGIN = StoreStatement(
    b"applier_origin_record",
    "INSERT INTO applier.origins AS o (slot_name, origin_name, origin_lsn, commit_lsn, "
    "commit_time, applied_at) VALUES ($1, $2, NULLIF($3::pg_catalog.pg_lsn, "
    "'0/0'::pg_catalog.pg_lsn), $4::pg_catalog.pg_lsn, $5::pg_catalog.timestamptz, "
    "pg_catalog.clock_timestamp()) ON CONFLICT (slot_name, origin_name) DO UPDATE SET "
    "origin_lsn = COALESCE(EXCLUDED.origin_lsn, o.origin_lsn), "
    "commit_lsn = EXCLUDED.commit_lsn, commit_time = EXCLUDED.commit_time, "
    "transactions = o.transactions + 1, applied_at = EXCLUDED.applied_at")
_MESSAGE = StoreStatement(
    b"applier_message_insert",
    "INSERT INTO applier.messages (slot_name, lsn, transactional, prefix, content, xid, commit_lsn) "
    "VALUES ($1, $2::pg_catalog.pg_lsn, $3::pg_catalog.bool, $4, $5::pg_catalog.bytea, "
    "$6::pg_catalog.int8, $7::pg_catalog.pg_lsn) ON CONFLICT (slot_name, lsn) DO NOTHING")
_MESSAGE_FORMATS = (0, 0, 0, 0, 1, 0, 0)
_CONFLICT = StoreStatement(
    b"applier_conflict_record",
    "INSERT INTO applier.conflicts (slot_name, conflict_type, resolution, table_schema, "
    "table_name, source_xid, source_lsn, key, local_row, remote_row, local_origin, "
    "local_commit_time) VALUES ($1, $2, $3, $4, $5, $6::pg_catalog.int8, $7::pg_catalog.pg_lsn, "
    "$8::pg_catalog.jsonb, $9::pg_catalog.jsonb, $10::pg_catalog.jsonb, $11, "
    "$12::pg_catalog.timestamptz)")

_SCHEMA_CHANGE = StoreStatement(
    b"applier_schema_change",
    "INSERT INTO applier.schema_changes (slot_name, source_lsn, table_schema, table_name, kind, "
    "statement) VALUES ($1, $2::pg_catalog.pg_lsn, $3, $4, $5, $6)")

_SOURCE_TYPES = ("SELECT column_name, type_oid::pg_catalog.int8, type_modifier FROM "
                 "applier.source_columns WHERE slot_name = $1 AND table_schema = $2 "
                 "AND table_name = $3")
_SOURCE_TYPES_FORGET = ("DELETE FROM applier.source_columns WHERE slot_name = $1 "
                        "AND table_schema = $2 AND table_name = $3")
_SOURCE_TYPE = ("INSERT INTO applier.source_columns (slot_name, table_schema, table_name, "
                "column_name, type_oid, type_modifier) VALUES ($1, $2, $3, $4, "
                "$5::pg_catalog.oid, $6::pg_catalog.int4)")

_SKIP_REQUEST = "SELECT lsn::text FROM applier.skip_requests WHERE slot_name = $1"
_SKIP_CLEAR = "DELETE FROM applier.skip_requests WHERE slot_name = $1 AND lsn = $2::pg_catalog.pg_lsn"
_SKIPPED = (
    "INSERT INTO applier.skipped_transactions (slot_name, finish_lsn, end_lsn, xid, source_gid, "
    "kind, changes, tables) VALUES ($1, $2::pg_catalog.pg_lsn, $3::pg_catalog.pg_lsn, "
    "$4::pg_catalog.int8, $5, $6, $7::pg_catalog.int8, $8::pg_catalog.text[])")

_PREPARED_HELD = ("SELECT 1 FROM applier.prepared_transactions "
                  "WHERE slot_name = $1 AND xid = $2::pg_catalog.int8")
_PREPARED_HEADER = StoreStatement(
    b"applier_2pc_header",
    "INSERT INTO applier.prepared_transactions (slot_name, xid, mode, source_gid, prepare_lsn, "
    "end_lsn, prepare_time, origin_name, origin_lsn, changes) VALUES ($1, $2::pg_catalog.int8, "
    "$3, $4, $5::pg_catalog.pg_lsn, $6::pg_catalog.pg_lsn, $7::pg_catalog.timestamptz, $8, "
    "$9::pg_catalog.pg_lsn, $10::pg_catalog.int8)")
_PREPARED_CHUNK = StoreStatement(
    b"applier_2pc_chunk",
    "INSERT INTO applier.prepared_changes (slot_name, xid, seq, data) "
    "VALUES ($1, $2::pg_catalog.int8, $3::pg_catalog.int4, $4::pg_catalog.bytea)")
_TAKE_PREPARED = (
    "DELETE FROM applier.prepared_transactions WHERE slot_name = $1 AND xid = $2::pg_catalog.int8 "
    "RETURNING mode, source_gid, prepare_lsn::pg_catalog.text, end_lsn::pg_catalog.text, "
    "prepare_time::pg_catalog.text, origin_name, origin_lsn::pg_catalog.text, changes")
_CHUNKS = (
    "SELECT seq, data FROM applier.prepared_changes WHERE slot_name = $1 "
    "AND xid = $2::pg_catalog.int8 AND seq >= $3::pg_catalog.int4 ORDER BY seq LIMIT 8")
_DROP_CHUNKS = "DELETE FROM applier.prepared_changes WHERE slot_name = $1 AND xid = $2::pg_catalog.int8"

_COPY_XIDS = "SELECT xid FROM applier.copy_transactions WHERE slot_name = $1"
_TABLE_STATES = ("SELECT schema_name, table_name, state, sync_lsn::text FROM applier.table_sync "
                 "WHERE slot_name = $1")


def encode_lsn(value: int | None) -> bytes | None:
    return None if value is None else str(LSN(value)).encode()


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _array(items: Sequence[str]) -> bytes:
    """A text[] literal: every element double-quoted, backslash and quote escaped."""
    return ("{" + ",".join('"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"'
                           for t in items) + "}").encode()


class PostgresApplyStore:
    """``ApplyStore`` over the apply session. ``origin_xact_setup``: the session is tagged with a
    replication origin whose position each progress write also sets."""

    def __init__(self, session: Session, slot: str, *, origin_xact_setup: bool = False) -> None:
        self.session = session
        self.slot = slot
        self._slot = slot.encode()
        self._progress = _PROGRESS_WITH_ORIGIN if origin_xact_setup else _PROGRESS

    # -- the position ---------------------------------------------------------------------------
    def read_position(self) -> AppliedPosition | None:
        result = self.session.sql(_POSITION, [self._slot])
        if result.ntuples == 0:
            return None
        return AppliedPosition(LSN.parse(_text(result.get_value(0, 0)) or "0/0"),
                               LSN.parse(_text(result.get_value(0, 1)) or "0/0"))

    def record_position(self, position: Position, via: Writer | None = None) -> None:
        commit_time = position.commit_time
        (via or self.session).run(self._progress, [
            self._slot, encode_lsn(position.commit_lsn), encode_lsn(position.end_lsn),
            commit_time.isoformat().encode() if commit_time else None], _TEXT_4)

    def touch_position(self) -> bool:
        return self.session.sql(_TOUCH, [self._slot]).command_tuples == 1

    # -- origins, messages, conflicts -------------------------------------------------------------
    def record_origin(self, origin: OriginRecord) -> None:
        self.session.run(_ORIGIN, [
            self._slot, origin.name.encode(), encode_lsn(origin.origin_lsn),
            encode_lsn(origin.commit_lsn),
            origin.commit_time.isoformat().encode() if origin.commit_time else None], (0,) * 5)

    def record_message(self, message: MessageRecord) -> None:
        self.session.run(_MESSAGE, [
            self._slot, encode_lsn(message.lsn), b"t" if message.transactional else b"f",
            message.prefix.encode(), message.content,
            None if message.xid is None else str(message.xid).encode(),
            encode_lsn(message.commit_lsn)], _MESSAGE_FORMATS)

    def record_conflict(self, conflict: ConflictRecord) -> None:
        def text(value: str | None) -> bytes | None:
            return None if value is None else value.encode()

        self.session.run(_CONFLICT, [
            self._slot, conflict.conflict_type.encode(), conflict.resolution.encode(),
            conflict.table_schema.encode(), conflict.table_name.encode(),
            None if conflict.source_xid is None else str(conflict.source_xid).encode(),
            encode_lsn(conflict.source_lsn), conflict.key.encode(), text(conflict.local_row),
            conflict.remote_row.encode(), text(conflict.local_origin),
            text(conflict.local_commit_time)], (0,) * 12)

    def record_schema_change(self, change: SchemaChange) -> None:
        self.session.run(_SCHEMA_CHANGE, [
            self._slot, encode_lsn(change.source_lsn), change.table_schema.encode(),
            change.table_name.encode(), change.kind.encode(), change.statement.encode()], (0,) * 6)

    def source_types(self, table: TableName) -> dict[str, tuple[int, int]]:
        result = self.session.sql(_SOURCE_TYPES, [self._slot, table[0].encode(), table[1].encode()])
        return {(_text(result.get_value(row, 0)) or ""): (int(_text(result.get_value(row, 1)) or 0),
                                                         int(_text(result.get_value(row, 2)) or -1))
                for row in range(result.ntuples)}

    def record_source_types(self, table: TableName, types: dict[str, tuple[int, int]]) -> None:
        key = [self._slot, table[0].encode(), table[1].encode()]
        self.session.sql(_SOURCE_TYPES_FORGET, key)
        for column, (type_oid, modifier) in types.items():
            self.session.sql(_SOURCE_TYPE, [*key, column.encode(), str(type_oid).encode(),
                                            str(modifier).encode()])

    # -- skip requests --------------------------------------------------------------------------
    def skip_request(self) -> LSN | None:
        result = self.session.sql(_SKIP_REQUEST, [self._slot])
        if result.ntuples == 0:
            return None
        return LSN.parse(_text(result.get_value(0, 0)) or "0/0")

    def drop_skip_request(self, lsn: LSN) -> None:
        self.session.sql(_SKIP_CLEAR, [self._slot, encode_lsn(lsn)])

    def record_skipped(self, skipped: SkippedTransaction, request: LSN) -> None:
        self.session.sql(_SKIPPED, [
            self._slot, encode_lsn(skipped.finish_lsn), encode_lsn(skipped.end_lsn),
            None if skipped.xid is None else str(skipped.xid).encode(),
            None if skipped.gid is None else skipped.gid.encode(), skipped.kind.encode(),
            str(skipped.changes).encode(), _array(sorted(skipped.tables))])
        self.drop_skip_request(request)

    # -- prepared transactions ------------------------------------------------------------------
    def prepared_held(self, xid: int) -> bool:
        return self.session.sql(_PREPARED_HELD, [self._slot, str(xid).encode()]).ntuples > 0

    def store_prepared(self, header: PreparedHeader) -> None:
        self.session.run(_PREPARED_HEADER, [
            self._slot, str(header.xid).encode(), header.mode.encode(), header.source_gid.encode(),
            encode_lsn(header.prepare_lsn), encode_lsn(header.end_lsn),
            header.prepare_time.isoformat().encode(),
            None if header.origin_name is None else header.origin_name.encode(),
            encode_lsn(header.origin_lsn) if header.origin_lsn else None,
            str(header.changes).encode()], (0,) * 10)

    def store_prepared_chunk(self, xid: int, seq: int, data: bytes) -> None:
        self.session.run(_PREPARED_CHUNK, [self._slot, str(xid).encode(), str(seq).encode(), data],
                         (0, 0, 0, 1))

    def take_prepared(self, xid: int) -> PreparedHeader | None:
        from datetime import datetime

        result = self.session.sql(_TAKE_PREPARED, [self._slot, str(xid).encode()])
        if result.ntuples == 0:
            return None
        row = [_text(result.get_value(0, i)) for i in range(8)]
        return PreparedHeader(
            xid=xid, mode=row[0] or "", source_gid=row[1] or "",
            prepare_lsn=LSN.parse(row[2] or "0/0"), end_lsn=LSN.parse(row[3] or "0/0"),
            prepare_time=datetime.fromisoformat(row[4] or "1970-01-01 00:00:00+00"),
            origin_name=row[5], origin_lsn=LSN.parse(row[6]) if row[6] else None,
            changes=int(row[7] or 0))

    def prepared_chunks(self, xid: int, from_seq: int) -> list[tuple[int, bytes]]:
        result = self.session.execute(_CHUNKS, [self._slot, str(xid).encode(),
                                                str(from_seq).encode()], binary_result=True)
        chunks = []
        for row in range(result.ntuples):
            seq, data = result.get_value(row, 0), result.get_value(row, 1)
            assert seq is not None and data is not None
            chunks.append((int.from_bytes(seq, "big", signed=True), data))
        return chunks

    def drop_prepared_chunks(self, xid: int) -> None:
        self.session.sql(_DROP_CHUNKS, [self._slot, str(xid).encode()])

    # -- the initial copy ---------------------------------------------------------------------------
    def copy_xids(self) -> tuple[int, ...]:
        result = self.session.sql(_COPY_XIDS, [self._slot])
        return tuple(int(_text(result.get_value(row, 0)) or 0) for row in range(result.ntuples))

    def table_sync_lsns(self) -> dict[TableName, LSN]:
        result = self.session.sql(_TABLE_STATES, [self._slot])
        rows = [[_text(result.get_value(row, i)) for i in range(4)] for row in range(result.ntuples)]
        return sync_lsns(self.slot, {(r[0] or "", r[1] or ""): (r[2] or "", r[3]) for r in rows})

