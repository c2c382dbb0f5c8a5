"""Test-side pgoutput encoder: builds the bytes PostgreSQL's pgoutput plugin sends.

Owns nothing in the product: it exists so tests and the benchmark can make valid messages of
every type (protocol 1-4) without a server. It must never import the decoder, so a shared bug
cannot make both sides agree. Timestamps are wire microseconds since 2000-01-01 UTC; LSNs ints.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from applier.protocol.messages import UNCHANGED_TOAST, Unchanged

__all__ = [
    "Binary", "Column", "begin", "commit", "origin", "relation", "type_", "tuple_data", "insert",
    "update", "delete", "truncate", "message", "stream_start", "stream_stop", "stream_commit",
    "stream_abort", "begin_prepare", "prepare", "commit_prepared", "rollback_prepared",
    "stream_prepare",
]


@dataclass(frozen=True)
class Binary:
    """A column value sent in binary format (kind ``b``)."""

    data: bytes


#: One TupleData column: text bytes (``t``), Binary (``b``), None (``n``), UNCHANGED_TOAST (``u``).
Column = Union[bytes, Binary, None, Unchanged]


def _u8(v: int) -> bytes:
    return struct.pack(">B", v)


def _u16(v: int) -> bytes:
    return struct.pack(">H", v)


def _u32(v: int) -> bytes:
    return struct.pack(">I", v)


def _i32(v: int) -> bytes:
    return struct.pack(">i", v)


def _u64(v: int) -> bytes:
    return struct.pack(">Q", v)


def _i64(v: int) -> bytes:
    return struct.pack(">q", v)


def _string(s: str) -> bytes:
    return s.encode() + b"\0"


def _xid(xid: int | None) -> bytes:
    # Only inside a streamed block (protocol 2+) does the server put the xid here.
    return b"" if xid is None else _u32(xid)


def tuple_data(columns: Sequence[Column]) -> bytes:
    out = [_u16(len(columns))]
    for value in columns:
        if value is None:
            out.append(b"n")
        elif value is UNCHANGED_TOAST:
            out.append(b"u")
        elif isinstance(value, Binary):
            out.append(b"b" + _i32(len(value.data)) + value.data)
        else:
            assert isinstance(value, bytes)
            out.append(b"t" + _i32(len(value)) + value)
    return b"".join(out)


def begin(final_lsn: int, commit_time: int, xid: int) -> bytes:
    return b"B" + _u64(final_lsn) + _i64(commit_time) + _u32(xid)


def commit(flags: int, commit_lsn: int, end_lsn: int, commit_time: int) -> bytes:
    return b"C" + _u8(flags) + _u64(commit_lsn) + _u64(end_lsn) + _i64(commit_time)


def origin(origin_lsn: int, name: str) -> bytes:
    return b"O" + _u64(origin_lsn) + _string(name)


def relation(relation_id: int, namespace: str, name: str, replica_identity: str,
             columns: Sequence[tuple[int, str, int, int]], xid: int | None = None) -> bytes:
    """``columns`` holds (flags, name, type OID, type modifier) per column."""
    out = [b"R", _xid(xid), _u32(relation_id), _string(namespace), _string(name),
           replica_identity.encode(), _u16(len(columns))]
    for flags, column, oid, typmod in columns:
        out.append(_u8(flags) + _string(column) + _u32(oid) + _i32(typmod))
    return b"".join(out)


def type_(type_oid: int, namespace: str, name: str, xid: int | None = None) -> bytes:
    return b"Y" + _xid(xid) + _u32(type_oid) + _string(namespace) + _string(name)


def insert(relation_id: int, new: Sequence[Column], xid: int | None = None) -> bytes:
    return b"I" + _xid(xid) + _u32(relation_id) + b"N" + tuple_data(new)


def update(relation_id: int, new: Sequence[Column], old: Sequence[Column] | None = None,
           old_kind: str = "K", xid: int | None = None) -> bytes:
    old_part = b"" if old is None else old_kind.encode() + tuple_data(old)
    return b"U" + _xid(xid) + _u32(relation_id) + old_part + b"N" + tuple_data(new)


def delete(relation_id: int, old: Sequence[Column], old_kind: str = "K",
           xid: int | None = None) -> bytes:
    return b"D" + _xid(xid) + _u32(relation_id) + old_kind.encode() + tuple_data(old)


def truncate(relation_ids: Sequence[int], options: int, xid: int | None = None) -> bytes:
    return (b"T" + _xid(xid) + _u32(len(relation_ids)) + _u8(options)
            + b"".join(_u32(r) for r in relation_ids))


def message(flags: int, lsn: int, prefix: str, content: bytes, xid: int | None = None) -> bytes:
    return b"M" + _xid(xid) + _u8(flags) + _u64(lsn) + _string(prefix) + _i32(len(content)) + content


def stream_start(xid: int, first_segment: bool) -> bytes:
    return b"S" + _u32(xid) + _u8(1 if first_segment else 0)


def stream_stop() -> bytes:
    return b"E"


def stream_commit(xid: int, flags: int, commit_lsn: int, end_lsn: int, commit_time: int) -> bytes:
    return b"c" + _u32(xid) + _u8(flags) + _u64(commit_lsn) + _u64(end_lsn) + _i64(commit_time)


def stream_abort(xid: int, subxid: int, abort_lsn: int | None = None,
                 abort_time: int | None = None) -> bytes:
    """Without abort_lsn: the 9-byte form; with it: protocol 4 ``streaming=parallel``'s 25 bytes."""
    tail = b"" if abort_lsn is None else _u64(abort_lsn) + _i64(abort_time or 0)
    return b"A" + _u32(xid) + _u32(subxid) + tail


def begin_prepare(prepare_lsn: int, end_lsn: int, prepare_time: int, xid: int, gid: str) -> bytes:
    return b"b" + _u64(prepare_lsn) + _u64(end_lsn) + _i64(prepare_time) + _u32(xid) + _string(gid)


def _prepare(tag: bytes, flags: int, prepare_lsn: int, end_lsn: int, prepare_time: int, xid: int,
             gid: str) -> bytes:
    return (tag + _u8(flags) + _u64(prepare_lsn) + _u64(end_lsn) + _i64(prepare_time) + _u32(xid)
            + _string(gid))


def prepare(flags: int, prepare_lsn: int, end_lsn: int, prepare_time: int, xid: int,
            gid: str) -> bytes:
    return _prepare(b"P", flags, prepare_lsn, end_lsn, prepare_time, xid, gid)


def stream_prepare(flags: int, prepare_lsn: int, end_lsn: int, prepare_time: int, xid: int,
                   gid: str) -> bytes:
    return _prepare(b"p", flags, prepare_lsn, end_lsn, prepare_time, xid, gid)


def commit_prepared(flags: int, commit_lsn: int, end_lsn: int, commit_time: int, xid: int,
                    gid: str) -> bytes:
    return (b"K" + _u8(flags) + _u64(commit_lsn) + _u64(end_lsn) + _i64(commit_time) + _u32(xid)
            + _string(gid))


def rollback_prepared(flags: int, prepare_end_lsn: int, rollback_end_lsn: int, prepare_time: int,
                      rollback_time: int, xid: int, gid: str) -> bytes:
    return (b"r" + _u8(flags) + _u64(prepare_end_lsn) + _u64(rollback_end_lsn)
            + _i64(prepare_time) + _i64(rollback_time) + _u32(xid) + _string(gid))
