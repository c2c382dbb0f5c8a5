"""The in-memory twin of the bookkeeping store, for tests that run without a server.

``MemoryStore`` implements ``ApplyStore`` (bound to one slot) and the reads of ``Bookkeeping``
over plain Python structures, with the transaction semantics the PostgreSQL store gets from the
target: writes made inside a transaction become visible to others only when it commits, vanish
when it rolls back, and wait with a prepared transaction until it is committed or rolled back.
Whoever plays the target session (a test's fake session) calls ``begin``, ``commit``,
``rollback``, ``prepare`` and ``finish_prepared`` as the SQL it receives says. Owns nothing the
real store does not have; must never be used by the worker itself.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

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
from .store import TableState, Writer, sync_lsns

__all__ = ["MemoryStore"]


@dataclass
class _State:
    progress: dict[str, Progress] = field(default_factory=dict)
    origins: dict[tuple[str, str], tuple[OriginRecord, int]] = field(default_factory=dict)
    messages: dict[tuple[str, LSN], MessageRecord] = field(default_factory=dict)
    conflicts: list[tuple[str, ConflictRecord]] = field(default_factory=list)
    schema_changes: list[tuple[str, SchemaChange]] = field(default_factory=list)
    skip_requests: dict[str, LSN] = field(default_factory=dict)
    skipped: list[tuple[str, SkippedTransaction]] = field(default_factory=list)
    prepared: dict[tuple[str, int], PreparedHeader] = field(default_factory=dict)
    chunks: dict[tuple[str, int], dict[int, bytes]] = field(default_factory=dict)
    copy_xids: dict[str, set[int]] = field(default_factory=dict)
    table_sync: dict[tuple[str, TableName], TableState] = field(default_factory=dict)
    publication_tables: dict[tuple[str, TableName], str] = field(default_factory=dict)
    source_types: dict[tuple[str, TableName], dict[str, tuple[int, int]]] = field(default_factory=dict)
    publication_relids: dict[tuple[str, TableName], int] = field(default_factory=dict)


_Op = Callable[[_State], Any]
_V = TypeVar("_V")


def _rename(records: dict[tuple[str, TableName], _V], slot: str, old: TableName,
            new: TableName) -> None:
    if (slot, old) in records:
        records[(slot, new)] = records.pop((slot, old))


class MemoryStore:
    def __init__(self, slot: str) -> None:
        self.slot = slot
        self._committed = _State()
        self._open: list[_Op] | None = None          # writes of the open transaction
        self._prepared: dict[str, list[_Op]] = {}     # writes held by prepared transactions

    def another_session(self) -> MemoryStore:
        """The same database seen from another session: what is committed (and prepared) is
        shared, each session's open transaction is its own."""
        other = MemoryStore(self.slot)
        other._committed, other._prepared = self._committed, self._prepared
        return other

    # -- transactions (driven by the fake target session) ------------------------------------------
    def begin(self) -> None:
        self._open = []

    def commit(self) -> None:
        for op in self._open or ():
            op(self._committed)
        self._open = None

    def rollback(self) -> None:
        self._open = None

    def prepare(self, gid: str) -> None:
        self._prepared[gid] = self._open or []
        self._open = None

    def finish_prepared(self, gid: str, commit: bool) -> None:
        for op in self._prepared.pop(gid) if commit else ():
            op(self._committed)

    def _write(self, op: _Op) -> Any:
        if self._open is None:
            return op(self._committed)  # autocommit
        view = self._view()  # what the statement returns, as seen inside the transaction
        self._open.append(op)
        return op(view)

    def _view(self) -> _State:
        """The state as the open transaction sees it: committed, plus its own writes."""
        state = copy.deepcopy(self._committed)
        for op in self._open or ():
            op(state)
        return state

    @property
    def committed(self) -> _State:
        """What a reader outside any transaction sees (for assertions)."""
        return self._committed

    # -- ApplyStore ---------------------------------------------------------------------------------
    def read_position(self) -> AppliedPosition | None:
        return self.position(self.slot, self._view())

    def record_position(self, position: Position, via: Writer | None = None) -> None:
        slot = self.slot

        def op(state: _State) -> None:
            state.progress[slot] = Progress(slot, position.commit_lsn, position.end_lsn,
                                            position.commit_time, None)
        self._write(op)

    def touch_position(self) -> bool:
        return bool(self._write(lambda state: self.slot in state.progress))

    def record_origin(self, origin: OriginRecord) -> None:
        key = (self.slot, origin.name)

        def op(state: _State) -> None:
            old, count = state.origins.get(key, (None, 0))
            origin_lsn = origin.origin_lsn or (old.origin_lsn if old else LSN(0))
            state.origins[key] = (replace(origin, origin_lsn=origin_lsn), count + 1)
        self._write(op)

    def record_message(self, message: MessageRecord) -> None:
        self._write(lambda state: state.messages.setdefault((self.slot, message.lsn), message))

    def record_conflict(self, conflict: ConflictRecord) -> None:
        self._write(lambda state: state.conflicts.append((self.slot, conflict)))

    def record_schema_change(self, change: SchemaChange) -> None:
        self._write(lambda state: state.schema_changes.append((self.slot, change)))

    def source_types(self, table: TableName) -> dict[str, tuple[int, int]]:
        return dict(self._view().source_types.get((self.slot, table), {}))

    def record_source_types(self, table: TableName, types: dict[str, tuple[int, int]]) -> None:
        self._write(lambda state: state.source_types.__setitem__((self.slot, table), dict(types)))

    def skip_request(self) -> LSN | None:
        return self._view().skip_requests.get(self.slot)

    def drop_skip_request(self, lsn: LSN) -> None:
        def op(state: _State) -> None:
            if state.skip_requests.get(self.slot) == lsn:
                del state.skip_requests[self.slot]
        self._write(op)

    def record_skipped(self, skipped: SkippedTransaction, request: LSN) -> None:
        self._write(lambda state: state.skipped.append((self.slot, skipped)))
        self.drop_skip_request(request)

    def prepared_held(self, xid: int) -> bool:
        return (self.slot, xid) in self._view().prepared

    def store_prepared(self, header: PreparedHeader) -> None:
        self._write(lambda state: state.prepared.__setitem__((self.slot, header.xid), header))

    def store_prepared_chunk(self, xid: int, seq: int, data: bytes) -> None:
        self._write(lambda state: state.chunks.setdefault((self.slot, xid), {}).__setitem__(seq, data))

    def take_prepared(self, xid: int) -> PreparedHeader | None:
        return self._write(lambda state: state.prepared.pop((self.slot, xid), None))

    def prepared_chunks(self, xid: int, from_seq: int) -> list[tuple[int, bytes]]:
        chunks = self._view().chunks.get((self.slot, xid), {})
        return sorted((seq, data) for seq, data in chunks.items() if seq >= from_seq)[:8]

    def drop_prepared_chunks(self, xid: int) -> None:
        self._write(lambda state: state.chunks.pop((self.slot, xid), None))

    def copy_xids(self) -> tuple[int, ...]:
        return tuple(sorted(self._view().copy_xids.get(self.slot, ())))

    def table_sync_lsns(self) -> dict[TableName, LSN]:
        states = self.table_states(self.slot)
        return sync_lsns(self.slot, {name: (s.state, str(s.sync_lsn) if s.sync_lsn else None)
                                     for name, s in states.items()})

    # -- Bookkeeping (reads) and test set-up --------------------------------------------------------
    def tables(self) -> set[str]:
        return {"progress", "origins", "messages", "conflicts", "skip_requests",
                "skipped_transactions", "prepared_transactions", "prepared_changes",
                "copy_transactions", "table_sync"}

    def position(self, slot: str, state: _State | None = None) -> AppliedPosition | None:
        progress = (state or self._committed).progress.get(slot)
        return None if progress is None else AppliedPosition(progress.commit_lsn, progress.end_lsn)

    def progress(self, slot: str) -> Progress | None:
        return self._committed.progress.get(slot)

    def positions(self, slot: str | None = None) -> list[Progress]:
        return [p for name, p in sorted(self._committed.progress.items())
                if slot is None or name == slot]

    def request_skip(self, slot: str, lsn: LSN) -> LSN | None:
        position = self.position(slot)
        if position is not None and lsn <= position.commit_lsn:
            raise ValueError(f"slot {slot!r} has already applied everything up to commit LSN "
                             f"{position.commit_lsn}")
        previous = self._committed.skip_requests.get(slot)
        self._committed.skip_requests[slot] = lsn
        return previous

    def table_states(self, slot: str) -> dict[TableName, TableState]:
        return {name: s for (owner, name), s in self._view().table_sync.items() if owner == slot}

    def set_table_state(self, slot: str, table: TableName, state: TableState) -> None:
        self._committed.table_sync[(slot, table)] = state

    def deferred_prepared(self, slot: str) -> list[dict[str, Any]]:
        return [{"gid": h.source_gid, "prepared": h.prepare_time, "prepare_lsn": str(h.prepare_lsn),
                 "changes": h.changes, "mode": "defer"}
                for (owner, _), h in sorted(self._committed.prepared.items())
                if owner == slot and h.mode == "defer"]

    def rows(self, table: str, slot: str) -> list[Mapping[str, Any]]:
        if table == "origins":
            return [{"slot_name": owner, "origin_name": record.name, "transactions": count,
                     "origin_lsn": str(record.origin_lsn), "commit_lsn": str(record.commit_lsn)}
                    for (owner, _), (record, count) in sorted(self._committed.origins.items())
                    if owner == slot]
        return []

    def schema_changes(self, slot: str, limit: int = 20) -> list[Mapping[str, Any]]:
        changes = [c for owner, c in self._committed.schema_changes if owner == slot][::-1][:limit]
        return [{"table_schema": c.table_schema, "table_name": c.table_name, "kind": c.kind,
                 "statement": c.statement, "source_lsn": c.source_lsn} for c in changes]

    def publication_tables(self, slot: str) -> dict[TableName, str]:
        return {name: state for (owner, name), state in self._committed.publication_tables.items()
                if owner == slot}

    def set_publication_tables(self, slot: str, tables: Iterable[TableName], state: str) -> None:
        for table in tables:
            self._committed.publication_tables[(slot, table)] = state

    def publication_relids(self, slot: str) -> dict[TableName, int]:
        return {name: relid for (owner, name), relid in self._committed.publication_relids.items()
                if owner == slot}

    def set_publication_relids(self, slot: str, relids: Mapping[TableName, int]) -> None:
        for table, relid in relids.items():
            if (slot, table) in self._committed.publication_tables:
                self._committed.publication_relids[(slot, table)] = relid

    def rename_table(self, slot: str, old: TableName, new: TableName) -> None:
        _rename(self._committed.publication_tables, slot, old, new)
        _rename(self._committed.publication_relids, slot, old, new)
        _rename(self._committed.table_sync, slot, old, new)

    def count_by_kind(self, table: str, slot: str) -> dict[str, int]:
        if table == "conflicts":
            return dict(Counter(c.conflict_type for owner, c in self._committed.conflicts
                                if owner == slot))
        if table == "skipped_transactions":
            return dict(Counter(s.kind for owner, s in self._committed.skipped if owner == slot))
        return {}
