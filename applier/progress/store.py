"""The bookkeeping store's interface: every read and write of the ``applier.*`` tables.

Two faces, each a typed protocol with a PostgreSQL implementation and an in-memory twin
(``memory.MemoryStore`` implements both, so a unit test can apply with it and read back):

* ``ApplyStore``: what the apply stage reads and writes inside the target transaction of the
  source transaction it belongs to (the position, origins, messages, conflicts, skips, pending
  prepared transactions). Bound to one target session; ``postgres.PostgresApplyStore`` runs it
  there over libpq, with values as bytes.
* ``Bookkeeping``: what runs off the hot path, on any connection a command holds (status,
  metrics, verify, skip, sync, the Spark reader): ``bookkeeping.SqlBookkeeping``.

Owns the shapes of both interfaces and the session protocol the PostgreSQL side needs. Must
never import the apply stage or the source: they depend on it, not it on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ApplierError, Cause
from ..protocol.lsn import LSN
from .records import (
    AppliedPosition,
    ConflictRecord,
    MessageRecord,
    OriginRecord,
    Position,
    PreparedHeader,
    Progress,
    SchemaChange,
    SkippedTransaction,
    TableName,
)

__all__ = ["ApplyStore", "Bookkeeping", "Result", "Session", "StoreStatement", "SyncIncomplete",
           "TableState", "Writer", "sync_lsns"]


class SyncIncomplete(ApplierError):
    """The initial copy of some published tables has not finished; streaming must not start."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.NEEDS_OPERATOR)


@dataclass(frozen=True)
class TableState:
    """A table's initial copy for one slot (``applier.table_sync``)."""

    state: str            # 'copying' | 'done'
    sync_lsn: LSN | None  # set once done


@dataclass(frozen=True, slots=True)
class StoreStatement:
    """A bookkeeping statement prepared once per session under ``name``."""

    name: bytes
    sql: str


class Result(Protocol):
    """A statement's result, as libpq returns it (values are text bytes unless asked binary)."""

    @property
    def ntuples(self) -> int: ...

    @property
    def command_tuples(self) -> int | None: ...

    def get_value(self, row_number: int, column_number: int) -> bytes | None: ...


class Writer(Protocol):
    """Where a write can go: the target session, or a pipeline on it (a fast-path batch's, a
    commit's), where the statement is prepared first if the session has not prepared it yet."""

    def sql(self, text: str, values: Sequence[bytes | None] | None = None) -> Any: ...

    def run(self, statement: StoreStatement, values: Sequence[bytes | None],
            formats: Sequence[int]) -> Any: ...


class Session(Writer, Protocol):
    """The target session the PostgreSQL apply store runs on (``apply.target.TargetSession``)."""

    def sql(self, text: str, values: Sequence[bytes | None] | None = None) -> Result: ...

    def run(self, statement: StoreStatement, values: Sequence[bytes | None],
            formats: Sequence[int]) -> Result: ...

    def execute(self, text: str, values: Sequence[bytes | None] = (),
                formats: Sequence[int] | None = None, binary_result: bool = False) -> Result: ...


class ApplyStore(Protocol):
    """Reads and writes in the open target transaction of the session the store is bound to."""

    slot: str

    def read_position(self) -> AppliedPosition | None: ...

    def record_position(self, position: Position, via: Writer | None = None) -> None:
        """The progress row, in the open target transaction (``via``: a pipeline instead)."""

    def touch_position(self) -> bool:
        """Rewrite the progress row unchanged (a write that makes a commit flush the WAL); False
        without one."""

    def record_origin(self, origin: OriginRecord) -> None: ...

    def record_message(self, message: MessageRecord) -> None: ...

    def record_conflict(self, conflict: ConflictRecord) -> None: ...

    def record_schema_change(self, change: SchemaChange) -> None: ...

    def source_types(self, table: TableName) -> dict[str, tuple[int, int]]:
        """Column -> (type OID, modifier) of the source table as last recorded (none yet: {})."""

    def record_source_types(self, table: TableName, types: dict[str, tuple[int, int]]) -> None:
        """The source table's columns and types as of now, replacing what was recorded."""

    def skip_request(self) -> LSN | None: ...

    def drop_skip_request(self, lsn: LSN) -> None: ...

    def record_skipped(self, skipped: SkippedTransaction, request: LSN) -> None:
        """What was skipped, and the request that asked for it is done."""

    def prepared_held(self, xid: int) -> bool: ...

    def store_prepared(self, header: PreparedHeader) -> None: ...

    def store_prepared_chunk(self, xid: int, seq: int, data: bytes) -> None: ...

    def take_prepared(self, xid: int) -> PreparedHeader | None:
        """Remove and return a pending prepared transaction's header."""

    def prepared_chunks(self, xid: int, from_seq: int) -> list[tuple[int, bytes]]:
        """A deferred transaction's stored messages, some chunks at a time, from ``from_seq``."""

    def drop_prepared_chunks(self, xid: int) -> None: ...

    def copy_xids(self) -> tuple[int, ...]:
        """The target xids of the slot's initial-copy transactions."""

    def table_sync_lsns(self) -> dict[TableName, LSN]:
        """The sync LSN of every table ``applier sync`` copied for the slot; raises
        ``SyncIncomplete`` while a copy is unfinished."""


class Bookkeeping(Protocol):
    """Off the hot path: reads for operations, and the writes of ``skip`` and ``sync``."""

    def tables(self) -> set[str]:
        """The tables of the ``applier`` schema (empty before the first run)."""

    def position(self, slot: str) -> AppliedPosition | None: ...

    def progress(self, slot: str) -> Progress | None: ...

    def positions(self, slot: str | None = None) -> list[Progress]: ...

    def request_skip(self, slot: str, lsn: LSN) -> LSN | None:
        """Store a skip request; returns the one it replaces. Raises ValueError when ``lsn`` is
        at or behind the recorded position."""

    def table_states(self, slot: str) -> dict[TableName, TableState]: ...

    def deferred_prepared(self, slot: str) -> list[dict[str, Any]]: ...

    def rows(self, table: str, slot: str) -> list[Mapping[str, Any]]: ...

    def count_by_kind(self, table: str, slot: str) -> dict[str, int]: ...

    def schema_changes(self, slot: str, limit: int = 20) -> list[Mapping[str, Any]]:
        """The latest schema changes made for the slot, newest first."""

    def publication_tables(self, slot: str) -> dict[TableName, str]:
        """The tables the worker follows for the slot, and their state."""

    def set_publication_tables(self, slot: str, tables: Iterable[TableName], state: str) -> None: ...

    def publication_relids(self, slot: str) -> dict[TableName, int]:
        """The source OID of each followed table whose OID is known."""

    def set_publication_relids(self, slot: str, relids: Mapping[TableName, int]) -> None: ...

    def rename_table(self, slot: str, old: TableName, new: TableName) -> None:
        """Every record of the slot about table ``old`` follows its new name ``new``."""


def sync_lsns(slot: str, states: dict[TableName, tuple[str, str | None]]) -> dict[TableName, LSN]:
    """The sync LSN of each copied table; ``SyncIncomplete`` when a copy is unfinished: the target
    table may hold a partial copy, and changes applied on top of it would leave it wrong for good."""
    unfinished = sorted(name for name, (state, _) in states.items() if state != "done")
    if unfinished:
        listed = ", ".join(f"{s}.{t}" for s, t in unfinished[:10])
        raise SyncIncomplete(f"the initial copy for slot {slot!r} is unfinished ({len(unfinished)} "
                             f"table(s): {listed}); run applier sync to finish it before "
                             "applier run")
    return {name: LSN.parse(lsn) for name, (_, lsn) in states.items() if lsn is not None}
