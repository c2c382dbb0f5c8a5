"""Buffered raw changes of one open streamed transaction, spilling to a local file.

Owns, for one top-level xid: the in-memory tail of its changes, the spill file holding the older
part, and where each subtransaction's first change sits (PostgreSQL's subxact_info), so that a
subtransaction abort can cut the buffer back. Must never decode, interpret or apply a change, and
never touch any file but its own spill file.

The buffered changes form one logical sequence of length-prefixed records (big-endian UInt32
length, then the raw pgoutput message including its subxact xid). The spill file always holds an
exact prefix of that sequence and memory holds the rest, so a record's byte offset in the logical
sequence is also its offset in the file once spilled.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from psycopg import pq

from .errors import SpillFailed

__all__ = ["StreamBuffer", "ENTRY_OVERHEAD", "SPILL_GLOB", "default_spill_dir", "spill_path",
           "record_cost"]

_LENGTH = struct.Struct(">I")

#: Estimated memory per buffered change beyond its raw bytes (bytes object header plus the list
#: slot). Counting it keeps the budget honest for transactions of many tiny changes.
ENTRY_OVERHEAD: Final = 64

#: Spill files are named after the top-level xid; the prefix keeps stale-file cleanup from ever
#: removing anything in the directory that is not ours.
_SPILL_PREFIX: Final = "applier-stream-"
_SPILL_SUFFIX: Final = ".changes"
SPILL_GLOB: Final = f"{_SPILL_PREFIX}*{_SPILL_SUFFIX}"

#: Read buffer for replay: large enough for sequential throughput, small enough to stay bounded.
_READ_BUFFER: Final = 1 << 16


def default_spill_dir(slot: str, target: str) -> Path:
    """Where a worker's streamed transactions spill when --spill-dir is not given: a directory
    for each target database and slot, as the worker lock is, so that one worker at a time uses
    it. Keyed by the slot alone, two workers of one slot name on a host (other sources, other
    targets) shared it: each start removed the other's spill files, each exit its directory."""
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in slot)
    digest = hashlib.sha256(_database_identity(target).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"applier-spill-{safe}-{digest}"


def _database_identity(dsn: str) -> str:
    """Host, port and database a connection string names, libpq's defaults (environment
    included) filling what it leaves out: the same for every spelling of one target."""
    given = {o.keyword: o.val for o in pq.Conninfo.parse(dsn.encode()) if o.val}
    defaults = {o.keyword: o.val for o in pq.Conninfo.get_defaults() if o.val}

    def value(keyword: bytes) -> str:
        return (given.get(keyword) or defaults.get(keyword) or b"").decode()

    return "\0".join((value(b"host"), value(b"port"), value(b"dbname") or value(b"user")))


def spill_path(directory: Path, xid: int) -> Path:
    return directory / f"{_SPILL_PREFIX}{xid}{_SPILL_SUFFIX}"


def record_cost(raw: bytes) -> int:
    """Memory charged against the budget for one buffered change."""
    return len(raw) + ENTRY_OVERHEAD


@dataclass(frozen=True, slots=True)
class _SubxactStart:
    subxid: int
    index: int  # position of the subxact's first change among all changes of the transaction
    offset: int  # byte offset of that change in the logical record sequence


class StreamBuffer:
    """The buffered changes of one top-level streamed transaction."""

    __slots__ = ("xid", "path", "memory_bytes", "file_bytes", "_memory", "_file_count",
                 "_end_offset", "_subxacts", "_subxact_index")

    def __init__(self, xid: int, path: Path) -> None:
        self.xid = xid
        self.path = path
        self.memory_bytes = 0  # charged cost of the in-memory records
        self.file_bytes = 0  # size of the spill file
        self._memory: list[bytes] = []  # the records after the spilled prefix, in order
        self._file_count = 0  # number of records in the spill file
        self._end_offset = 0  # length of the whole logical record sequence
        self._subxacts: list[_SubxactStart] = []  # in order of first appearance
        self._subxact_index: dict[int, int] = {}  # subxid -> position in _subxacts

    @property
    def change_count(self) -> int:
        return self._file_count + len(self._memory)

    def append(self, subxid: int, raw: bytes) -> None:
        """Buffer one change in memory; the caller has made room for ``record_cost(raw)``."""
        self._note_subxact(subxid)
        self._memory.append(raw)
        self.memory_bytes += record_cost(raw)
        self._end_offset += _LENGTH.size + len(raw)

    def append_to_file(self, subxid: int, raw: bytes) -> int:
        """Write one change straight to the spill file, for a change larger than the whole
        budget. The in-memory tail goes first to keep the order; returns the memory freed."""
        self.append(subxid, raw)
        return self.spill() - record_cost(raw)

    def spill(self) -> int:
        """Append the in-memory records to the spill file; return the memory freed."""
        if not self._memory:
            return 0
        try:
            # A temp directory cleaner may have removed the directory while it stood empty.
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as file:
                for raw in self._memory:
                    file.write(_LENGTH.pack(len(raw)))
                    file.write(raw)
        except OSError as exc:
            needed = sum(_LENGTH.size + len(raw) for raw in self._memory)
            raise self._failed("write", exc, needed) from exc
        freed = self.memory_bytes
        self._file_count += len(self._memory)
        self.file_bytes = self._end_offset
        self._memory.clear()
        self.memory_bytes = 0
        return freed

    def abort_subxact(self, subxid: int) -> int:
        """Discard ``subxid``'s changes and those of every subxact first seen after it.

        While a subtransaction is open on the server only it and its descendants can change
        anything, and its abort is decoded before any later change of its parent, so everything
        from its first change onward belongs to it or to subtransactions that must go with it
        (PostgreSQL: stream_abort_internal). A subxid with no changes was never recorded: no-op.
        Relation and Type records in the cut range go too, exactly as in PostgreSQL; the server
        may not resend them later in the same top-level transaction, so the apply stage keeps its
        relation cache across transactions rather than relying on one per transaction.
        Returns the memory freed.
        """
        position = self._subxact_index.get(subxid)
        if position is None:
            return 0
        start = self._subxacts[position]
        for gone in self._subxacts[position:]:
            del self._subxact_index[gone.subxid]
        del self._subxacts[position:]
        if start.index >= self._file_count:
            keep = start.index - self._file_count
            freed = sum(record_cost(raw) for raw in self._memory[keep:])
            del self._memory[keep:]
        else:
            # The cut falls inside the spilled prefix: everything in memory comes later still.
            freed = self.memory_bytes
            self._memory.clear()
            try:
                os.truncate(self.path, start.offset)
            except OSError as exc:
                raise self._failed("cut", exc) from exc
            self._file_count = start.index
            self.file_bytes = start.offset
        self.memory_bytes -= freed
        self._end_offset = start.offset
        return freed

    def replay(self) -> Iterator[bytes]:
        """Yield every buffered change in order, reading the spill file one record at a time."""
        if self._file_count:
            try:
                file = open(self.path, "rb", buffering=_READ_BUFFER)
            except OSError as exc:
                raise self._failed("read", exc) from exc
            with file:
                for number in range(self._file_count):
                    try:
                        header = file.read(_LENGTH.size)
                        length = _LENGTH.unpack(header)[0] if len(header) == _LENGTH.size else -1
                        raw = file.read(length) if length >= 0 else b""
                    except OSError as exc:
                        raise self._failed("read", exc) from exc
                    if length < 0 or len(raw) != length:
                        raise SpillFailed(str(self.path.parent), self.xid, "read",
                                          f"{self.path.name} ends inside record {number + 1} of "
                                          f"{self._file_count}: it was changed behind our back")
                    yield raw
        yield from self._memory

    def _failed(self, action: str, exc: OSError, needed: int | None = None) -> SpillFailed:
        directory = self.path.parent
        free = None
        if needed is not None:
            try:
                free = shutil.disk_usage(directory).free
            except OSError:
                pass
        return SpillFailed(str(directory), self.xid, action, exc.strerror or str(exc), needed, free)

    def remove(self) -> None:
        """Forget every change and delete the spill file."""
        self._memory.clear()
        self.memory_bytes = 0
        self.path.unlink(missing_ok=True)
        self.file_bytes = 0
        self._file_count = 0
        self._end_offset = 0
        self._subxacts.clear()
        self._subxact_index.clear()

    def _note_subxact(self, subxid: int) -> None:
        # The top-level xid is never recorded: its abort discards everything anyway.
        if subxid != self.xid and subxid not in self._subxact_index:
            self._subxact_index[subxid] = len(self._subxacts)
            self._subxacts.append(_SubxactStart(subxid, self.change_count, self._end_offset))
