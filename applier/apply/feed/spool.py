"""A streamed transaction's change rows held back until its commit (``--change-feed``).

Owns, for the early session (a transaction applied as it streams, ``streaming.py``), the COPYs
of change rows written before the transaction's commit LSN is known. Written at once they would
carry the ``PENDING`` LSN and be moved to the commit LSN at the commit: every row written twice,
the second time by an UPDATE that moves it to another partition. Held back here instead (in an
anonymous file in the spill directory, so memory stays bounded), they are written once, at the
commit, each row's meta prefix rewritten to the commit LSN and time (``_lane.restamp``).

A savepoint marks how much is held; rolling back to it drops what its subtransaction added. The
rows are not the target's until sent: a rollback of the target transaction clears them.

Must never send anything (``FastPath.send_copy`` does, at the commit) or hold back the rows of
a transaction prepared on the target, which must be there before PREPARE TRANSACTION.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ...errors import ApplyError, Cause
from ...progress.feed import ChangeTable
from ..copy import copy_binary_data, copy_binary_tuples
from .meta import Stamp, meta_prefix

__all__ = ["FeedSpool", "Restamp", "Spooled"]

#: ``_lane.restamp(rows, binary, old, new) -> (rows, restamped)``.
Restamp = Callable[[bytes, bool, bytes, bytes], tuple[bytes, int]]
#: Held-back COPYs of one statement are merged into one of at most this many bytes at the commit.
MERGE_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class _Held:
    change_table: ChangeTable
    copy_sql: str
    binary: bool
    rows: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Spooled:
    """One COPY to send at the commit: its change table, statement, data and row count."""

    change_table: ChangeTable
    copy_sql: str
    data: bytes
    rows: int


class FeedSpool:
    def __init__(self, restamp: Restamp, directory: Path | None = None) -> None:
        self._restamp = restamp
        self._directory = directory
        self._file: IO[bytes] | None = None
        self._held: list[_Held] = []
        self._end = 0
        self._marks: dict[str, int] = {}  # savepoint -> COPYs held before it, oldest first

    def __bool__(self) -> bool:
        return bool(self._held)

    def add(self, change_table: ChangeTable, copy_sql: str, data: bytes | bytearray, rows: int,
            binary: bool) -> None:
        """Hold back a COPY of change rows (``data`` as the COPY would have sent it)."""
        body = copy_binary_tuples(data) if binary else data
        if self._file is None:
            if self._directory is not None:
                self._directory.mkdir(parents=True, exist_ok=True)
            self._file = tempfile.TemporaryFile(prefix="applier-feed-", dir=self._directory)
        self._file.seek(self._end)
        self._file.write(body)
        self._held.append(_Held(change_table, copy_sql, binary, rows, self._end, len(body)))
        self._end += len(body)

    def mark(self, savepoint: str) -> None:
        """A savepoint in order with the held COPYs."""
        self._marks[savepoint] = len(self._held)

    def rollback_to(self, savepoint: str) -> None:
        """Drop what was held after ``savepoint``, and the savepoints made after it."""
        count = self._marks.get(savepoint)
        if count is None:
            return
        later = list(self._marks)[list(self._marks).index(savepoint) + 1:]
        for name in later:
            del self._marks[name]
        if count < len(self._held):
            self._end = self._held[count].offset
            del self._held[count:]

    def restamped(self, pending: Stamp, commit: Stamp) -> Iterator[Spooled]:
        """The held COPYs, consecutive ones of one statement merged, each row's meta prefix
        (``meta.meta_prefix``) rewritten from the ``pending`` stamp to the ``commit`` one, those
        held while this runs too (sending one sends the batch's last rows first); then nothing
        is held any more."""
        while self._held:
            held, self._held = self._held, []
            index = 0
            while index < len(held):
                end = index + 1
                while (end < len(held) and held[end].copy_sql == held[index].copy_sql
                       and held[end].offset + held[end].length - held[index].offset <= MERGE_BYTES):
                    end += 1
                yield self._read(held[index:end], pending, commit)
                index = end
        self.clear()

    def _read(self, held: list[_Held], pending: Stamp, commit: Stamp) -> Spooled:
        """Consecutive held COPYs of one statement as one, restamped."""
        first, last = held[0], held[-1]
        assert self._file is not None
        self._file.seek(first.offset)
        body = self._file.read(last.offset + last.length - first.offset)
        rows = sum(h.rows for h in held)
        data, restamped = self._restamp(body, first.binary, meta_prefix(pending, first.binary),
                                        meta_prefix(commit, first.binary))
        if restamped != rows:  # every row held is the open transaction's: a defect if not
            raise ApplyError(f"change feed: {rows - restamped} of {rows} change rows held back for "
                             f"xid {pending.xid} do not carry its pending stamp", cause=Cause.PROTOCOL)
        return Spooled(first.change_table, first.copy_sql,
                       copy_binary_data(data) if first.binary else data, rows)

    def clear(self) -> None:
        self._held.clear()
        self._marks.clear()
        self._end = 0
        if self._file is not None:
            self._file.close()
            self._file = None
