"""pgoutput encoder: typed messages back to the exact bytes the server sends.

Owns the inverse of ``decode`` for the messages that make up the body of a transaction
(Relation, Type, Origin, Insert, Update, Delete, Truncate, Message). The apply stage uses it to
hold a deferred two-phase transaction durably in the target as protocol bytes, the one format
that cannot drift from what the decoder reads back. Pure: no I/O, no state.

``decode(encode(msg, in_stream), in_stream) == msg`` for every message it accepts; with
``in_stream`` the message's ``xid`` is written after the type byte exactly as pgoutput does
inside a stream block (it must then be set).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from .messages import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED,
    Delete,
    Insert,
    Message,
    Origin,
    Relation,
    ReplicationMessage,
    Truncate,
    TupleData,
    Type,
    Update,
)

__all__ = ["encode", "encode_tuple"]

_U16 = struct.Struct(">H").pack
_U32 = struct.Struct(">I").pack
_I32 = struct.Struct(">i").pack
_U64 = struct.Struct(">Q").pack


def _cstring(text: str) -> bytes:
    return text.encode("utf-8") + b"\0"


def _xid(msg: ReplicationMessage, in_stream: bool) -> bytes:
    if not in_stream:
        return b""
    xid = getattr(msg, "xid", None)
    if not xid:
        raise ValueError(f"{msg.type_name} needs a transaction id to be encoded inside a stream block")
    return _U32(xid)


def encode_tuple(data: TupleData) -> bytes:
    """TupleData: Int16 column count, then per column its kind and, for t/b, Int32 length + bytes."""
    parts = [_U16(len(data.kinds))]
    for kind, value in zip(data.kinds, data.values):
        if kind == KIND_TEXT or kind == KIND_BINARY:
            assert isinstance(value, bytes)
            parts.append(bytes((kind,)) + _I32(len(value)) + value)
        elif kind == KIND_NULL or kind == KIND_UNCHANGED:
            parts.append(bytes((kind,)))
        else:
            raise ValueError(f"bad tuple column kind {kind!r}")
    return b"".join(parts)


def _relation(msg: Relation, in_stream: bool) -> bytes:
    columns = b"".join(bytes((column.flags,)) + _cstring(column.name) + _U32(column.type_oid)
                       + _I32(column.type_modifier) for column in msg.columns)
    return (b"R" + _xid(msg, in_stream) + _U32(msg.relation_id) + _cstring(msg.namespace)
            + _cstring(msg.name) + msg.replica_identity.encode("ascii") + _U16(len(msg.columns))
            + columns)


def _type(msg: Type, in_stream: bool) -> bytes:
    return (b"Y" + _xid(msg, in_stream) + _U32(msg.type_oid) + _cstring(msg.namespace)
            + _cstring(msg.name))


def _origin(msg: Origin, in_stream: bool) -> bytes:
    return b"O" + _U64(msg.origin_lsn) + _cstring(msg.name)


def _insert(msg: Insert, in_stream: bool) -> bytes:
    return b"I" + _xid(msg, in_stream) + _U32(msg.relation_id) + b"N" + encode_tuple(msg.new_tuple)


def _update(msg: Update, in_stream: bool) -> bytes:
    old = b""
    if msg.old_tuple is not None:
        old = (msg.old_kind or "K").encode("ascii") + encode_tuple(msg.old_tuple)
    return (b"U" + _xid(msg, in_stream) + _U32(msg.relation_id) + old + b"N"
            + encode_tuple(msg.new_tuple))


def _delete(msg: Delete, in_stream: bool) -> bytes:
    return (b"D" + _xid(msg, in_stream) + _U32(msg.relation_id) + msg.old_kind.encode("ascii")
            + encode_tuple(msg.old_tuple))


def _truncate(msg: Truncate, in_stream: bool) -> bytes:
    return (b"T" + _xid(msg, in_stream) + _U32(len(msg.relation_ids)) + bytes((msg.options,))
            + b"".join(_U32(relation_id) for relation_id in msg.relation_ids))


def _message(msg: Message, in_stream: bool) -> bytes:
    return (b"M" + _xid(msg, in_stream) + bytes((msg.flags,)) + _U64(msg.lsn)
            + _cstring(msg.prefix) + _I32(len(msg.content)) + msg.content)


_ENCODERS: Final[dict[type, Callable[..., bytes]]] = {
    Relation: _relation, Type: _type, Origin: _origin, Insert: _insert, Update: _update,
    Delete: _delete, Truncate: _truncate, Message: _message,
}


def encode(msg: ReplicationMessage, in_stream: bool = False) -> bytes:
    """The pgoutput bytes of one transaction-body message."""
    encoder = _ENCODERS.get(type(msg))
    if encoder is None:
        raise TypeError(f"encode does not handle {type(msg).__name__} messages")
    return encoder(msg, in_stream)
