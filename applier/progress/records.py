"""What the bookkeeping store reads and writes, as typed records (``applier.*`` rows).

Pure data: no SQL, no I/O. The apply stage, the operations commands and the in-memory store all
speak these, never table rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ..protocol.lsn import LSN

__all__ = ["AppliedPosition", "ConflictRecord", "MessageRecord", "OriginRecord", "Position",
           "PreparedHeader", "Progress", "SchemaChange", "SkippedTransaction", "SourceIdentity",
           "TableName"]

TableName = tuple[str, str]  # (schema, table)


@dataclass
class AppliedPosition:
    """The last source transaction durably applied on the target."""

    commit_lsn: LSN
    end_lsn: LSN


@dataclass(frozen=True, slots=True)
class Position:
    """What the progress row records for the last source transaction of a target transaction."""

    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime | None


@dataclass(frozen=True)
class Progress:
    """A slot's progress row as read back: ``applied_at`` is when the target committed it."""

    slot_name: str
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime | None
    applied_at: datetime | None


@dataclass(frozen=True)
class SourceIdentity:
    """The source server a slot's progress comes from (``applier.source_identity``): its system
    identifier (a physical standby shares its primary's) and the timeline it was on."""

    system_identifier: str
    timeline: int


@dataclass(frozen=True)
class OriginRecord:
    """The last transaction applied from one replication origin (``applier.origins``)."""

    name: str
    origin_lsn: LSN
    commit_lsn: LSN
    commit_time: datetime | None


@dataclass(frozen=True)
class MessageRecord:
    """A logical decoding message delivered to ``applier.messages``."""

    lsn: LSN
    transactional: bool
    prefix: str
    content: bytes
    xid: int | None
    commit_lsn: LSN | None


@dataclass(frozen=True)
class ConflictRecord:
    """One conflict and how it was resolved (``applier.conflicts``). The rows are JSON objects as
    the target's ``to_jsonb`` writes them (values in text, the way a reader expects them)."""

    conflict_type: str
    resolution: str
    table_schema: str
    table_name: str
    source_xid: int | None
    source_lsn: LSN | None
    key: str
    local_row: str | None
    remote_row: str
    local_origin: str | None
    local_commit_time: str | None


@dataclass(frozen=True)
class SkippedTransaction:
    """A source transaction skipped on request (``applier.skipped_transactions``)."""

    kind: str            # commit, prepare, stream_commit, stream_prepare, commit_prepared
    finish_lsn: LSN
    end_lsn: LSN | None
    xid: int | None
    gid: str | None
    changes: int
    tables: tuple[str, ...]


@dataclass(frozen=True)
class SchemaChange:
    """A change the worker made to a target table to follow the source (``applier.schema_changes``)."""

    table_schema: str
    table_name: str
    kind: str            # add_column | widen | drop_not_null
    statement: str
    source_lsn: LSN | None  # commit LSN of the source transaction that needed it


@dataclass(frozen=True)
class PreparedHeader:
    """A prepared source transaction pending on the target (``applier.prepared_transactions``)."""

    xid: int
    mode: str            # prepare | defer
    source_gid: str
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: datetime
    origin_name: str | None
    origin_lsn: LSN | None
    changes: int
