"""The buffers of the open streamed transactions and the one memory budget they share.

Owns: a ``StreamBuffer`` per open top-level xid (in the order their first segments came), the
bytes they hold in memory against the budget, spilling the largest buffers to their files when a
record would not fit (a record larger than the whole budget goes straight to its file), and the
removal of spill files an earlier run left. Must never decode a record beyond its type and xid,
know of the sink or of the early apply, or decide which message may follow which (the
assembler does).
"""

from __future__ import annotations

from pathlib import Path

from .buffer import SPILL_GLOB, StreamBuffer, record_cost, spill_path
from .errors import missing_xid
from .payloads import ROW_CHANGES

__all__ = ["OpenStreams"]


class OpenStreams:
    """Every streamed transaction started and not yet committed, prepared or aborted."""

    def __init__(self, memory_budget: int, spill_dir: Path) -> None:
        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {memory_budget}")
        self._budget = memory_budget
        self._spill_dir = spill_dir
        spill_dir.mkdir(parents=True, exist_ok=True)
        # Spill files of an earlier run are worthless: the server restreams those transactions
        # from their first segment because their commit was never confirmed.
        for stale in spill_dir.glob(SPILL_GLOB):
            stale.unlink(missing_ok=True)
        self._buffers: dict[int, StreamBuffer] = {}  # every open streamed xid, in start order
        #: Bytes charged against the budget by all open streamed transactions.
        self.memory_bytes = 0

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def xids(self) -> tuple[int, ...]:
        return tuple(self._buffers)

    @property
    def spilled_bytes(self) -> int:
        """Total size of the spill files of all open streamed transactions."""
        return sum(buffer.file_bytes for buffer in self._buffers.values())

    def get(self, xid: int) -> StreamBuffer | None:
        return self._buffers.get(xid)

    def open(self, xid: int) -> StreamBuffer:
        """A new, empty buffer for ``xid`` (the caller has checked that it is not open)."""
        buffer = self._buffers[xid] = StreamBuffer(xid, spill_path(self._spill_dir, xid))
        return buffer

    def append(self, block: StreamBuffer, subxid: int | None, raw: bytes, what: str) -> None:
        """Buffer one record of ``block``'s stream block, spilling to make room for it."""
        if not subxid:
            raise missing_xid(block.xid, subxid, what)
        if type(raw) is not bytes:
            raw = bytes(raw)  # never pin a larger receive buffer through a view
        cost = record_cost(raw)
        if self.memory_bytes + cost > self._budget:
            self._make_room(cost)
        if self.memory_bytes + cost > self._budget:
            # One change larger than the whole budget: it goes straight to disk.
            self.memory_bytes -= block.append_to_file(subxid, raw)
        else:
            block.append(subxid, raw)
            self.memory_bytes += cost

    def buffer_changes(self, block: StreamBuffer, payloads: list[bytes], start: int) -> int:
        """Buffer the row changes from ``start`` on, still encoded, by the xid each carries;
        returns the index of the first payload that is not one."""
        append = self.append
        for index in range(start, len(payloads)):
            raw = payloads[index]
            name = ROW_CHANGES.get(raw[0])
            if name is None or len(raw) < 5:
                return index
            append(block, int.from_bytes(raw[1:5], "big"), raw, name)
        return len(payloads)

    def abort_subxact(self, buffer: StreamBuffer, subxid: int) -> None:
        """Discard ``subxid``'s changes (and those of later subtransactions) from ``buffer``."""
        self.memory_bytes -= buffer.abort_subxact(subxid)

    def drop(self, buffer: StreamBuffer) -> None:
        """Forget a transaction's buffer and remove its spill file."""
        self.memory_bytes -= buffer.memory_bytes
        buffer.remove()
        del self._buffers[buffer.xid]

    def close(self) -> None:
        """Drop every buffer and remove all spill files."""
        for buffer in self._buffers.values():
            buffer.remove()
        self._buffers.clear()
        self.memory_bytes = 0

    def _make_room(self, cost: int) -> None:
        """Spill the largest in-memory buffers until ``cost`` more bytes fit the budget (or
        nothing is left in memory)."""
        while self.memory_bytes + cost > self._budget:
            largest = max(self._buffers.values(), key=lambda buffer: buffer.memory_bytes)
            if not largest.memory_bytes:
                return
            self.memory_bytes -= largest.spill()
