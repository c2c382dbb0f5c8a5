"""Typed, immutable pgoutput messages (protocol versions 1-4).

Owns the shape of every logical replication message and of TupleData. Pure data: no decoding
logic, no I/O. Column values stay exactly the bytes the server sent (text or binary format);
nothing on the hot path converts them to Python objects.

Field names follow the protocol documentation, in snake_case. ``xid`` on Relation, Type,
Insert, Update, Delete, Truncate and Message is the (sub)transaction id that the server sends
only inside a streamed block (protocol 2+); outside one it is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum, IntEnum
from typing import ClassVar, Final, TypeAlias, Union

from .lsn import LSN

__all__ = [
    "MessageType", "ROW_CHANGE_TYPES", "UNCHANGED_TOAST", "Unchanged", "ColumnValue", "TupleData", "RelationColumn",
    "Begin", "Commit", "Origin", "Relation", "Type", "Insert", "Update", "Delete", "Truncate",
    "Message", "StreamStart", "StreamStop", "StreamCommit", "StreamAbort", "BeginPrepare",
    "Prepare", "CommitPrepared", "RollbackPrepared", "StreamPrepare", "ReplicationMessage",
    "KIND_NULL", "KIND_UNCHANGED", "KIND_TEXT", "KIND_BINARY", "FIRST_NORMAL_OID",
]

#: Types with an OID below this are built in: identical OIDs (and binary formats) everywhere.
FIRST_NORMAL_OID = 16384


class MessageType(IntEnum):
    """The type byte that begins every pgoutput payload, by message name. Code outside
    ``protocol/`` names types by this enum, never by their byte."""

    BEGIN = ord("B")
    COMMIT = ord("C")
    ORIGIN = ord("O")
    RELATION = ord("R")
    TYPE = ord("Y")
    INSERT = ord("I")
    UPDATE = ord("U")
    DELETE = ord("D")
    TRUNCATE = ord("T")
    MESSAGE = ord("M")
    STREAM_START = ord("S")
    STREAM_STOP = ord("E")
    STREAM_COMMIT = ord("c")
    STREAM_ABORT = ord("A")
    BEGIN_PREPARE = ord("b")
    PREPARE = ord("P")
    COMMIT_PREPARED = ord("K")
    ROLLBACK_PREPARED = ord("r")
    STREAM_PREPARE = ord("p")

    @property
    def type_name(self) -> str:
        """The snake_case name used in errors and by ``applier peek`` (``stream_start``)."""
        return self.name.lower()


#: Insert, Update and Delete: the row changes, as plain ints (a payload's first byte is an int,
#: and testing one against this set is the hot path's cheapest test).
ROW_CHANGE_TYPES: Final = frozenset(int(t) for t in (MessageType.INSERT, MessageType.UPDATE,
                                                     MessageType.DELETE))


class Unchanged(Enum):
    """Marker for a TOASTed value the server did not send because it did not change (kind ``u``)."""

    TOAST = "u"

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST: Final = Unchanged.TOAST

#: TupleData column kinds, as the byte values found in ``TupleData.kinds``.
KIND_NULL: Final = ord("n")
KIND_UNCHANGED: Final = ord("u")
KIND_TEXT: Final = ord("t")
KIND_BINARY: Final = ord("b")

#: One column of a TupleData: raw bytes (text or binary format), None for NULL, or UNCHANGED_TOAST.
ColumnValue: TypeAlias = Union[bytes, None, Unchanged]


@dataclass(frozen=True, slots=True)
class TupleData:
    """A row image. ``kinds[i]`` is ``n``/``u``/``t``/``b`` (as ints) for ``values[i]``.

    ``size`` is the bytes of its values, what holding the row costs: the apply stage bounds its
    batches by it. The C decoder fills it as it reads the values; built here, it is summed."""

    kinds: bytes
    values: tuple[ColumnValue, ...]
    size: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", sum(len(v) for v in self.values if type(v) is bytes))

    def is_binary(self, column: int) -> bool:
        return self.kinds[column] == KIND_BINARY


@dataclass(frozen=True, slots=True)
class RelationColumn:
    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        """Part of the replica identity (flag 1)."""
        return bool(self.flags & 1)


@dataclass(frozen=True, slots=True)
class Begin:
    type_name: ClassVar[str] = "begin"
    final_lsn: LSN
    commit_time: datetime
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    type_name: ClassVar[str] = "commit"
    flags: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime


@dataclass(frozen=True, slots=True)
class Origin:
    type_name: ClassVar[str] = "origin"
    origin_lsn: LSN
    name: str


@dataclass(frozen=True, slots=True)
class Relation:
    type_name: ClassVar[str] = "relation"
    xid: int | None
    relation_id: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[RelationColumn, ...]


@dataclass(frozen=True, slots=True)
class Type:
    type_name: ClassVar[str] = "type"
    xid: int | None
    type_oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    type_name: ClassVar[str] = "insert"
    xid: int | None
    relation_id: int
    new_tuple: TupleData


@dataclass(frozen=True, slots=True)
class Update:
    type_name: ClassVar[str] = "update"
    xid: int | None
    relation_id: int
    old_kind: str | None  # 'K' (key columns only), 'O' (whole old row) or None (not sent)
    old_tuple: TupleData | None
    new_tuple: TupleData


@dataclass(frozen=True, slots=True)
class Delete:
    type_name: ClassVar[str] = "delete"
    xid: int | None
    relation_id: int
    old_kind: str  # 'K' or 'O'
    old_tuple: TupleData


@dataclass(frozen=True, slots=True)
class Truncate:
    type_name: ClassVar[str] = "truncate"
    xid: int | None
    options: int
    relation_ids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        return bool(self.options & 1)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & 2)


@dataclass(frozen=True, slots=True)
class Message:
    type_name: ClassVar[str] = "message"
    xid: int | None
    flags: int
    lsn: LSN
    prefix: str
    content: bytes

    @property
    def transactional(self) -> bool:
        return bool(self.flags & 1)


@dataclass(frozen=True, slots=True)
class StreamStart:
    type_name: ClassVar[str] = "stream_start"
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    type_name: ClassVar[str] = "stream_stop"


@dataclass(frozen=True, slots=True)
class StreamCommit:
    type_name: ClassVar[str] = "stream_commit"
    xid: int
    flags: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime


@dataclass(frozen=True, slots=True)
class StreamAbort:
    type_name: ClassVar[str] = "stream_abort"
    xid: int
    subxid: int
    abort_lsn: LSN | None  # protocol 4 with streaming=parallel only
    abort_time: datetime | None


@dataclass(frozen=True, slots=True)
class BeginPrepare:
    type_name: ClassVar[str] = "begin_prepare"
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: datetime
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare:
    type_name: ClassVar[str] = "prepare"
    flags: int
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: datetime
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared:
    type_name: ClassVar[str] = "commit_prepared"
    flags: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared:
    type_name: ClassVar[str] = "rollback_prepared"
    flags: int
    prepare_end_lsn: LSN
    rollback_end_lsn: LSN
    prepare_time: datetime
    rollback_time: datetime
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare:
    type_name: ClassVar[str] = "stream_prepare"
    flags: int
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: datetime
    xid: int
    gid: str


ReplicationMessage: TypeAlias = Union[
    Begin, Commit, Origin, Relation, Type, Insert, Update, Delete, Truncate, Message,
    StreamStart, StreamStop, StreamCommit, StreamAbort, BeginPrepare, Prepare, CommitPrepared,
    RollbackPrepared, StreamPrepare,
]
