"""Minimal pgoutput encoder and a recording sink for the assembler tests.

Only what tests/unit/test_assembler.py needs; the bytes follow the protocol documentation so
that ``applier.protocol.decode`` accepts them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from applier.assembler import Assembler, TransactionEnd, TransactionStart
from applier.protocol import decode, to_pg_timestamp

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
T0_WIRE = to_pg_timestamp(T0)


def _xid(xid: int | None) -> bytes:
    return b"" if xid is None else struct.pack(">I", xid)


def _cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def _tuple(*values: bytes | None) -> bytes:
    out = struct.pack(">H", len(values))
    for value in values:
        out += b"n" if value is None else b"t" + struct.pack(">i", len(value)) + value
    return out


def begin(xid: int, final_lsn: int) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, T0_WIRE, xid)


def commit(commit_lsn: int, end_lsn: int) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, commit_lsn, end_lsn, T0_WIRE)


def origin(name: str, lsn: int = 0) -> bytes:
    return b"O" + struct.pack(">Q", lsn) + _cstr(name)


def relation(relation_id: int, name: str, xid: int | None = None) -> bytes:
    return (b"R" + _xid(xid) + struct.pack(">I", relation_id) + _cstr("public") + _cstr(name)
            + b"d" + struct.pack(">H", 1) + b"\x01" + _cstr("id") + struct.pack(">Ii", 23, -1))


def type_(type_oid: int, name: str, xid: int | None = None) -> bytes:
    return b"Y" + _xid(xid) + struct.pack(">I", type_oid) + _cstr("public") + _cstr(name)


def insert(relation_id: int, value: bytes, xid: int | None = None) -> bytes:
    return b"I" + _xid(xid) + struct.pack(">I", relation_id) + b"N" + _tuple(value)


def update(relation_id: int, value: bytes, xid: int | None = None) -> bytes:
    return b"U" + _xid(xid) + struct.pack(">I", relation_id) + b"N" + _tuple(value)


def delete(relation_id: int, value: bytes, xid: int | None = None) -> bytes:
    return b"D" + _xid(xid) + struct.pack(">I", relation_id) + b"K" + _tuple(value)


def truncate(*relation_ids: int, xid: int | None = None) -> bytes:
    return (b"T" + _xid(xid) + struct.pack(">IB", len(relation_ids), 0)
            + b"".join(struct.pack(">I", r) for r in relation_ids))


def message(content: bytes, transactional: bool, xid: int | None = None, lsn: int = 0) -> bytes:
    return (b"M" + _xid(xid) + struct.pack(">BQ", int(transactional), lsn) + _cstr("test")
            + struct.pack(">i", len(content)) + content)


def stream_start(xid: int, first: bool) -> bytes:
    return b"S" + struct.pack(">IB", xid, int(first))


def stream_stop() -> bytes:
    return b"E"


def stream_commit(xid: int, commit_lsn: int, end_lsn: int) -> bytes:
    return b"c" + struct.pack(">IBQQq", xid, 0, commit_lsn, end_lsn, T0_WIRE)


def stream_abort(xid: int, subxid: int) -> bytes:
    return b"A" + struct.pack(">II", xid, subxid)


def begin_prepare(xid: int, prepare_lsn: int, end_lsn: int, gid: str) -> bytes:
    return b"b" + struct.pack(">QQqI", prepare_lsn, end_lsn, T0_WIRE, xid) + _cstr(gid)


def prepare(xid: int, prepare_lsn: int, end_lsn: int, gid: str) -> bytes:
    return b"P" + struct.pack(">BQQqI", 0, prepare_lsn, end_lsn, T0_WIRE, xid) + _cstr(gid)


def stream_prepare(xid: int, prepare_lsn: int, end_lsn: int, gid: str) -> bytes:
    return b"p" + struct.pack(">BQQqI", 0, prepare_lsn, end_lsn, T0_WIRE, xid) + _cstr(gid)


def commit_prepared(xid: int, commit_lsn: int, end_lsn: int, gid: str) -> bytes:
    return b"K" + struct.pack(">BQQqI", 0, commit_lsn, end_lsn, T0_WIRE, xid) + _cstr(gid)


def rollback_prepared(xid: int, prepare_end_lsn: int, end_lsn: int, gid: str) -> bytes:
    return (b"r" + struct.pack(">BQQqqI", 0, prepare_end_lsn, end_lsn, T0_WIRE, T0_WIRE, xid)
            + _cstr(gid))


def feed(assembler: Assembler, *raws: bytes) -> None:
    """Decode each message the way the real pipeline does and feed it."""
    for raw in raws:
        assembler.feed(decode(raw, in_stream=assembler.in_stream), raw)


@dataclass
class RecordingSink:
    """Records every sink call as (method name, argument)."""

    calls: list[tuple[str, Any]] = field(default_factory=list)

    def relation(self, msg: Any) -> None:
        self.calls.append(("relation", msg))

    def type(self, msg: Any) -> None:
        self.calls.append(("type", msg))

    def begin(self, txn: TransactionStart) -> None:
        self.calls.append(("begin", txn))

    def origin(self, msg: Any) -> None:
        self.calls.append(("origin", msg))

    def change(self, msg: Any) -> None:
        self.calls.append(("change", msg))

    def take_changes(self, payloads: list[bytes], start: int) -> int:
        return start  # everything decoded, through change()

    def commit(self, txn: TransactionEnd) -> None:
        self.calls.append(("commit", txn))

    def prepare(self, txn: TransactionEnd) -> None:
        self.calls.append(("prepare", txn))

    def commit_prepared(self, msg: Any) -> None:
        self.calls.append(("commit_prepared", msg))

    def rollback_prepared(self, msg: Any) -> None:
        self.calls.append(("rollback_prepared", msg))

    def message(self, msg: Any) -> None:
        self.calls.append(("message", msg))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def values(self) -> list[bytes]:
        """The first column of every delivered insert/update/delete, in order."""
        out = []
        for name, msg in self.calls:
            if name == "change" and hasattr(msg, "new_tuple"):
                out.append(msg.new_tuple.values[0])
            elif name == "change" and hasattr(msg, "old_tuple"):
                out.append(msg.old_tuple.values[0])
        return out

