"""Which source position may be confirmed to the slot: only what the target has on disk.

With ``synchronous_commit = off`` a target COMMIT returns before its WAL is flushed. Like
PostgreSQL's subscriber (worker.c, ``FlushPosition`` and ``get_flush_position``), the worker
remembers for each such commit the target WAL position it ends at and the source end LSN it
covers, and tells the slot that source position only once the target reports its WAL flushed
past it (invariant 3). Owns that list; must never talk to a server.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..protocol.lsn import LSN

__all__ = ["FlushPosition", "FlushTracker"]


@dataclass(frozen=True, slots=True)
class FlushPosition:
    """A target commit not yet known durable: where its WAL ends, and the source end LSN it covers."""

    target_lsn: LSN
    source_end: LSN


class FlushTracker:
    def __init__(self) -> None:
        self._pending: deque[FlushPosition] = deque()  # oldest first

    def __bool__(self) -> bool:
        """Some commits wait for the target's WAL flush."""
        return bool(self._pending)

    @property
    def latest(self) -> FlushPosition | None:
        return self._pending[-1] if self._pending else None

    def committed(self, source_end: LSN, target_lsn: LSN | None) -> LSN | None:
        """A target commit covering ``source_end``. ``target_lsn`` None: it was synchronous, so it
        and every commit before it are durable now (the WAL is flushed in order); returns the
        position to confirm now, if any."""
        if target_lsn is None:
            self._pending.clear()
            return source_end
        self._pending.append(FlushPosition(target_lsn, source_end))
        return None

    def flushed(self, flushed_wal: LSN) -> LSN | None:
        """The target's WAL is on disk up to ``flushed_wal``: the furthest source position that
        is durable now, if that moved."""
        confirmed = None
        while self._pending and self._pending[0].target_lsn <= flushed_wal:
            confirmed = self._pending.popleft().source_end
        return confirmed

    def all_durable(self) -> LSN | None:
        """A synchronous commit after all of them made every pending commit durable."""
        latest = self.latest
        self._pending.clear()
        return None if latest is None else latest.source_end

    def clear(self) -> None:
        self._pending.clear()
