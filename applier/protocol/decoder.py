"""pgoutput decoder: one message of bytes in, one typed message out.

Owns the wire format of logical replication messages, protocol versions 1-4 (see the protocol
chapter "Logical Replication Message Formats"). Pure: no I/O, no database, no state between
calls; whoever calls it says whether the message sits inside a streamed block (``in_stream``),
because from protocol 2 on Relation, Type, Insert, Update, Delete, Truncate and Message carry a
transaction id there and nowhere else.

Every read is bounds-checked explicitly, so malformed input raises ``DecodeError`` naming the
message, the offset and the fault; nothing else (IndexError, struct.error, UnicodeDecodeError)
may escape. Inserts, updates and deletes are the hot path and are written out inline; the rarer
messages go through the slower, simpler ``_Reader``.

The hot path has an optional C accelerator (``_speedups``, built by ``pip install``) for Insert,
Update, Delete, and Begin and Commit (most of a stream of small transactions), that builds the
very same objects; ``decode`` uses it when it is importable. The pure-Python functions here
stay the reference: the accelerator hands every malformed message back to them, so errors are
theirs, and ``decode_pure`` always runs them alone. Set ``APPLIER_PURE_PYTHON=1`` in the
environment to keep ``decode`` off the accelerator (to rule it out when chasing a bug).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from ..implementation import accelerator
from .errors import DecodeError
from .lsn import LSN, PG_EPOCH, pg_timestamp
from .messages import (
    UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    MessageType,
    Origin,
    Prepare,
    Relation,
    RelationColumn,
    ReplicationMessage,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
)

__all__ = ["decode", "decode_pure", "ACCELERATED", "MESSAGE_NAMES"]

_u32 = struct.Struct(">I").unpack_from
_i32 = struct.Struct(">i").unpack_from
_u64 = struct.Struct(">Q").unpack_from
_i64 = struct.Struct(">q").unpack_from

#: Type byte -> snake_case message name (as used in errors and by ``applier peek``).
MESSAGE_NAMES: Final[dict[int, str]] = {int(t): t.type_name for t in MessageType}

_N, _K, _O = ord("N"), ord("K"), ord("O")
_TEXT, _BINARY, _NULL, _UNCHANGED = ord("t"), ord("b"), ord("n"), ord("u")


def decode_pure(data: bytes | bytearray | memoryview, in_stream: bool = False) -> ReplicationMessage:
    """Decode one pgoutput message, in pure Python (the reference ``decode`` is held to).

    ``data`` is the payload of one XLogData record (or one row of
    ``pg_logical_slot_peek_binary_changes``). ``in_stream`` must be true between Stream Start and
    Stream Stop, where the server adds a transaction id to data and schema messages.

    Raises ``DecodeError`` for anything malformed: empty or truncated input, an unknown type
    byte, a bad tuple kind, a length past the end, or trailing bytes.
    """
    buf = data if type(data) is bytes else bytes(data)
    handler = _PURE_HANDLERS.get(buf[0]) if buf else None
    if handler is None:
        raise _unknown(buf)
    return handler(buf, in_stream)


def _unknown(buf: bytes) -> DecodeError:
    if not buf:
        return DecodeError("unknown", 0, "empty message")
    return DecodeError(repr(chr(buf[0])), 0, f"unknown message type byte 0x{buf[0]:02x}")


def _short(name: str, pos: int, need: int, buf: bytes, what: str) -> DecodeError:
    return DecodeError(name, pos, f"{what} needs {need} bytes but only {max(len(buf) - pos, 0)} remain")


def _trailing(name: str, pos: int, buf: bytes) -> DecodeError:
    return DecodeError(name, pos, f"{len(buf) - pos} unexpected trailing bytes")


# ---------------------------------------------------------------------------------------------
# TupleData and the DML messages: the hot path.

def _tuple(buf: bytes, pos: int, name: str) -> tuple[TupleData, int]:
    end = len(buf)
    if pos + 2 > end:
        raise _short(name, pos, 2, buf, "tuple column count")
    ncols = (buf[pos] << 8) | buf[pos + 1]
    pos += 2
    kinds = bytearray(ncols)
    values: list[bytes | None | object] = [None] * ncols
    for i in range(ncols):
        if pos >= end:
            raise DecodeError(name, pos, f"tuple ends before column {i + 1} of {ncols}")
        kind = buf[pos]
        if kind == _TEXT or kind == _BINARY:
            if pos + 5 > end:
                raise _short(name, pos + 1, 4, buf, f"length of column {i + 1}")
            start = pos + 5
            pos = start + _i32(buf, pos + 1)[0]
            if pos > end or pos < start:
                raise DecodeError(name, start - 4, f"column {i + 1} length {pos - start} runs "
                                  f"past the end of the {end}-byte message")
            values[i] = buf[start:pos]
        elif kind == _NULL:
            pos += 1
        elif kind == _UNCHANGED:
            values[i] = UNCHANGED_TOAST
            pos += 1
        else:
            raise DecodeError(name, pos, f"bad tuple column kind {chr(kind)!r} for column {i + 1}"
                              " (expected n, u, t or b)")
        kinds[i] = kind
    return TupleData(bytes(kinds), tuple(values)), pos  # type: ignore[arg-type]


def _dml_head(buf: bytes, in_stream: bool, name: str) -> tuple[int | None, int, int]:
    """Read the optional xid and the relation id; return (xid, relation_id, next offset)."""
    if in_stream:
        if len(buf) < 10:
            raise _short(name, 1, 9, buf, "transaction id, relation id and tuple tag")
        return _u32(buf, 1)[0], _u32(buf, 5)[0], 9
    if len(buf) < 6:
        raise _short(name, 1, 5, buf, "relation id and tuple tag")
    return None, _u32(buf, 1)[0], 5


def _insert(buf: bytes, in_stream: bool) -> Insert:
    xid, relation_id, pos = _dml_head(buf, in_stream, "insert")
    if buf[pos] != _N:
        raise DecodeError("insert", pos, f"expected new tuple tag 'N', got {chr(buf[pos])!r}")
    new, pos = _tuple(buf, pos + 1, "insert")
    if pos != len(buf):
        raise _trailing("insert", pos, buf)
    return Insert(xid, relation_id, new)


def _update(buf: bytes, in_stream: bool) -> Update:
    xid, relation_id, pos = _dml_head(buf, in_stream, "update")
    tag = buf[pos]
    old_kind: str | None = None
    old: TupleData | None = None
    if tag == _K or tag == _O:
        old_kind = chr(tag)
        old, pos = _tuple(buf, pos + 1, "update")
        if pos >= len(buf):
            raise DecodeError("update", pos, "message ends before the new tuple tag 'N'")
        tag = buf[pos]
    if tag != _N:
        raise DecodeError("update", pos, f"expected tuple tag 'K', 'O' or 'N', got {chr(tag)!r}")
    new, pos = _tuple(buf, pos + 1, "update")
    if pos != len(buf):
        raise _trailing("update", pos, buf)
    return Update(xid, relation_id, old_kind, old, new)


def _delete(buf: bytes, in_stream: bool) -> Delete:
    xid, relation_id, pos = _dml_head(buf, in_stream, "delete")
    tag = buf[pos]
    if tag != _K and tag != _O:
        raise DecodeError("delete", pos, f"expected old tuple tag 'K' or 'O', got {chr(tag)!r}")
    old, pos = _tuple(buf, pos + 1, "delete")
    if pos != len(buf):
        raise _trailing("delete", pos, buf)
    return Delete(xid, relation_id, chr(tag), old)


# ---------------------------------------------------------------------------------------------
# Everything else: read field by field through a checked reader.

class _Reader:
    """Sequential checked reads over one message; every failure is a DecodeError."""

    __slots__ = ("buf", "pos", "name")

    def __init__(self, buf: bytes, name: str) -> None:
        self.buf = buf
        self.pos = 1  # past the type byte
        self.name = name

    def _take(self, size: int, what: str) -> int:
        pos = self.pos
        if pos + size > len(self.buf):
            raise _short(self.name, pos, size, self.buf, what)
        self.pos = pos + size
        return pos

    def u8(self, what: str) -> int:
        return self.buf[self._take(1, what)]

    def u16(self, what: str) -> int:
        pos = self._take(2, what)
        return (self.buf[pos] << 8) | self.buf[pos + 1]

    def u32(self, what: str) -> int:
        return _u32(self.buf, self._take(4, what))[0]

    def i32(self, what: str) -> int:
        return _i32(self.buf, self._take(4, what))[0]

    def lsn(self, what: str) -> LSN:
        return LSN(_u64(self.buf, self._take(8, what))[0])

    def timestamp(self, what: str):  # -> datetime
        pos = self._take(8, what)
        micros = _i64(self.buf, pos)[0]
        try:
            return pg_timestamp(micros)
        except OverflowError:
            raise DecodeError(self.name, pos, f"{what} {micros} is out of range") from None

    def string(self, what: str) -> str:
        pos = self.pos
        end = self.buf.find(0, pos)
        if end < 0:
            raise DecodeError(self.name, pos, f"{what} is not NUL-terminated")
        self.pos = end + 1
        try:
            return self.buf[pos:end].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DecodeError(self.name, pos + exc.start, f"{what} is not valid UTF-8") from None

    def raw(self, size: int, what: str) -> bytes:
        if size < 0:
            raise DecodeError(self.name, self.pos - 4, f"{what} has negative length {size}")
        pos = self._take(size, what)
        return self.buf[pos:pos + size]

    def xid_if(self, in_stream: bool) -> int | None:
        return self.u32("transaction id") if in_stream else None

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise _trailing(self.name, self.pos, self.buf)


def _begin(buf: bytes, in_stream: bool) -> Begin:
    r = _Reader(buf, "begin")
    msg = Begin(r.lsn("final LSN"), r.timestamp("commit timestamp"), r.u32("transaction id"))
    r.done()
    return msg


def _commit(buf: bytes, in_stream: bool) -> Commit:
    r = _Reader(buf, "commit")
    msg = Commit(r.u8("flags"), r.lsn("commit LSN"), r.lsn("end LSN"), r.timestamp("commit timestamp"))
    r.done()
    return msg


def _origin(buf: bytes, in_stream: bool) -> Origin:
    r = _Reader(buf, "origin")
    msg = Origin(r.lsn("origin LSN"), r.string("origin name"))
    r.done()
    return msg


def _relation(buf: bytes, in_stream: bool) -> Relation:
    r = _Reader(buf, "relation")
    xid = r.xid_if(in_stream)
    relation_id = r.u32("relation id")
    namespace = r.string("namespace")
    name = r.string("relation name")
    identity = chr(r.u8("replica identity"))
    if identity not in "dnfi":
        raise DecodeError("relation", r.pos - 1, f"unknown replica identity {identity!r}")
    count = r.u16("column count")
    columns = tuple(
        RelationColumn(r.u8("column flags"), r.string("column name"), r.u32("column type OID"),
                       r.i32("column type modifier"))
        for _ in range(count)
    )
    r.done()
    return Relation(xid, relation_id, namespace, name, identity, columns)


def _type(buf: bytes, in_stream: bool) -> Type:
    r = _Reader(buf, "type")
    msg = Type(r.xid_if(in_stream), r.u32("type OID"), r.string("namespace"), r.string("type name"))
    r.done()
    return msg


def _truncate(buf: bytes, in_stream: bool) -> Truncate:
    r = _Reader(buf, "truncate")
    xid = r.xid_if(in_stream)
    count = r.u32("relation count")
    options = r.u8("options")
    if count * 4 > len(buf) - r.pos:
        raise _short("truncate", r.pos, count * 4, buf, f"{count} relation ids")
    relation_ids = tuple(r.u32("relation id") for _ in range(count))
    r.done()
    return Truncate(xid, options, relation_ids)


def _message(buf: bytes, in_stream: bool) -> Message:
    r = _Reader(buf, "message")
    xid = r.xid_if(in_stream)
    flags = r.u8("flags")
    lsn = r.lsn("message LSN")
    prefix = r.string("prefix")
    content = r.raw(r.i32("content length"), "content")
    r.done()
    return Message(xid, flags, lsn, prefix, content)


def _stream_start(buf: bytes, in_stream: bool) -> StreamStart:
    r = _Reader(buf, "stream_start")
    msg = StreamStart(r.u32("transaction id"), r.u8("first segment flag") == 1)
    r.done()
    return msg


def _stream_stop(buf: bytes, in_stream: bool) -> StreamStop:
    _Reader(buf, "stream_stop").done()
    return StreamStop()


def _stream_commit(buf: bytes, in_stream: bool) -> StreamCommit:
    r = _Reader(buf, "stream_commit")
    msg = StreamCommit(r.u32("transaction id"), r.u8("flags"), r.lsn("commit LSN"),
                       r.lsn("end LSN"), r.timestamp("commit timestamp"))
    r.done()
    return msg


def _stream_abort(buf: bytes, in_stream: bool) -> StreamAbort:
    # Protocol 4 with streaming=parallel appends the abort LSN and time; earlier versions (and
    # streaming=on) send the two xids alone. The length tells which one arrived.
    r = _Reader(buf, "stream_abort")
    xid, subxid = r.u32("transaction id"), r.u32("subtransaction id")
    if r.pos == len(buf):
        return StreamAbort(xid, subxid, None, None)
    msg = StreamAbort(xid, subxid, r.lsn("abort LSN"), r.timestamp("abort timestamp"))
    r.done()
    return msg


def _begin_prepare(buf: bytes, in_stream: bool) -> BeginPrepare:
    r = _Reader(buf, "begin_prepare")
    msg = BeginPrepare(r.lsn("prepare LSN"), r.lsn("end LSN"), r.timestamp("prepare timestamp"),
                       r.u32("transaction id"), r.string("GID"))
    r.done()
    return msg


def _prepare_like(cls: type[Prepare] | type[StreamPrepare], name: str) -> Callable[[bytes, bool], ReplicationMessage]:
    def decode_prepare(buf: bytes, in_stream: bool) -> ReplicationMessage:
        r = _Reader(buf, name)
        msg = cls(r.u8("flags"), r.lsn("prepare LSN"), r.lsn("end LSN"),
                  r.timestamp("prepare timestamp"), r.u32("transaction id"), r.string("GID"))
        r.done()
        return msg
    return decode_prepare


def _commit_prepared(buf: bytes, in_stream: bool) -> CommitPrepared:
    r = _Reader(buf, "commit_prepared")
    msg = CommitPrepared(r.u8("flags"), r.lsn("commit LSN"), r.lsn("end LSN"),
                         r.timestamp("commit timestamp"), r.u32("transaction id"), r.string("GID"))
    r.done()
    return msg


def _rollback_prepared(buf: bytes, in_stream: bool) -> RollbackPrepared:
    r = _Reader(buf, "rollback_prepared")
    msg = RollbackPrepared(r.u8("flags"), r.lsn("prepare end LSN"), r.lsn("rollback end LSN"),
                           r.timestamp("prepare timestamp"), r.timestamp("rollback timestamp"),
                           r.u32("transaction id"), r.string("GID"))
    r.done()
    return msg


_PURE_HANDLERS: Final[dict[int, Callable[[bytes, bool], ReplicationMessage]]] = {
    MessageType.INSERT: _insert, MessageType.UPDATE: _update, MessageType.DELETE: _delete,
    MessageType.BEGIN: _begin, MessageType.COMMIT: _commit, MessageType.ORIGIN: _origin,
    MessageType.RELATION: _relation, MessageType.TYPE: _type, MessageType.TRUNCATE: _truncate,
    MessageType.MESSAGE: _message, MessageType.STREAM_START: _stream_start,
    MessageType.STREAM_STOP: _stream_stop, MessageType.STREAM_COMMIT: _stream_commit,
    MessageType.STREAM_ABORT: _stream_abort, MessageType.BEGIN_PREPARE: _begin_prepare,
    MessageType.PREPARE: _prepare_like(Prepare, "prepare"),
    MessageType.COMMIT_PREPARED: _commit_prepared,
    MessageType.ROLLBACK_PREPARED: _rollback_prepared,
    MessageType.STREAM_PREPARE: _prepare_like(StreamPrepare, "stream_prepare"),
}


def _accelerated() -> Callable[..., ReplicationMessage] | None:
    """The C accelerator's ``decode``, or None when it is absent or disabled. It dispatches in C:
    Begin, Commit, Insert, Update and Delete are decoded there, every other type (and anything
    malformed) by the pure functions here, which it is given."""
    _speedups = accelerator("protocol._speedups")
    if _speedups is None:
        return None
    # The C side gets the classes and the pure decoders rather than importing them itself, so it
    # cannot drift from messages.py; on malformed input it calls the fallbacks for the error.
    _speedups.init(TupleData, Insert, Update, Delete, Begin, Commit, LSN, PG_EPOCH, UNCHANGED_TOAST,
                   _insert, _update, _delete, _begin, _commit, decode_pure)
    return _speedups.decode


#: ``decode(data, in_stream=False)``: ``decode_pure``'s contract, through the C accelerator
#: when it is built (``ACCELERATED``).
decode: Callable[..., ReplicationMessage] = _accelerated() or decode_pure
#: Whether ``decode`` runs Begin/Commit/Insert/Update/Delete through the C accelerator.
ACCELERATED: Final[bool] = decode is not decode_pure
