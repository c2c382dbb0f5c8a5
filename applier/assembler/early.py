"""The one streamed transaction applied as it streams, and which of its records go there.

Owns: which top-level xid (at most one at a time) an ``EarlyApply`` takes as it streams, the
subtransactions of it seen so far (each announced once, before its first change), passing its
row changes on (still encoded, in runs cut where a subtransaction begins, or decoded one at a
time) and its schema messages (which are buffered as well), and how it ends: finished,
cancelled at a prepare, aborted, or declined by the early apply, after which the transaction is
buffered like any other. Must never buffer a record, deliver anything to the sink, or decide
which message may follow which (the assembler does).
"""

from __future__ import annotations

from applier.protocol import Origin, Relation, Type

from .errors import missing_xid
from .payloads import ROW_CHANGES, change_prefixes, run_end
from .sink import Change, EarlyApply, TransactionEnd, TransactionStart

__all__ = ["EarlyRoute"]


class EarlyRoute:
    """Passes one streamed transaction at a time to ``early`` (with None: never any)."""

    def __init__(self, early: EarlyApply | None) -> None:
        self._early = early
        self._xid: int | None = None  # the streamed xid being applied as it streams
        self._subxids: set[int] = set()  # its subtransactions seen so far

    @property
    def xid(self) -> int | None:
        """The streamed transaction being applied as it streams, if any."""
        return self._xid

    def open(self, xid: int) -> None:
        """The first segment of ``xid`` arrived: offer it, unless one is taken already."""
        if self._early is not None and self._xid is None and self._early.open(xid):
            self._xid = xid

    def changes(self, xid: int, payloads: list[bytes], start: int) -> int:
        """Pass the row changes of ``xid`` (the transaction taken) from ``start`` on, in runs cut
        where a subtransaction begins; returns the index of the first payload that is not one.
        If the early apply declines a run, the transaction is no longer taken and the index
        returned is where that run began: buffer from there on."""
        early = self._early
        assert early is not None
        subxids = self._subxids
        passed = index = start
        count = len(payloads)
        prefixes = change_prefixes(xid)
        while index < count:
            # Most payloads continue the run of the (sub)transaction before them: find where the
            # run ends in one pass of C, and look at that payload alone.
            index = run_end(payloads, index, prefixes)
            if index == count:
                break
            raw = payloads[index]
            if raw[0] not in ROW_CHANGES or len(raw) < 5:
                break
            subxid = int.from_bytes(raw[1:5], "big")
            if subxid != xid and subxid not in subxids:
                if index > passed and not early.changes(payloads, passed, index):
                    self._decline()
                    return passed
                passed = index
                if not subxid:
                    raise missing_xid(xid, subxid, ROW_CHANGES[raw[0]])
                subxids.add(subxid)
                early.subtransaction(subxid)
            prefixes = change_prefixes(xid, subxid)
            index += 1
        if index > passed and not early.changes(payloads, passed, index):
            self._decline()
            return passed
        return index

    def record(self, xid: int, subxid: int | None, msg: Change | Relation | Type | Origin) -> bool:
        """A decoded record of ``xid`` (the transaction taken): True if taken there (and so not
        to be buffered); schema messages are buffered as well."""
        early = self._early
        assert early is not None
        if isinstance(msg, (Relation, Type)):
            early.schema(msg)
            return False
        if not subxid:
            raise missing_xid(xid, subxid, msg.type_name)
        if subxid != xid and subxid not in self._subxids:
            self._subxids.add(subxid)
            early.subtransaction(subxid)
        if early.change(msg):
            return True
        self._decline()
        return False

    def pause(self, xid: int) -> None:
        """Stream Stop of ``xid``."""
        if xid == self._xid:
            assert self._early is not None
            self._early.pause()

    def abort(self, xid: int, subxid: int) -> None:
        """Stream Abort of ``subxid`` of ``xid`` (of the whole transaction when they are equal),
        or its buffered changes dropped for another cause."""
        if xid != self._xid:
            return
        if subxid == xid:
            self.close()
        else:
            assert self._early is not None
            self._early.abort(subxid)

    def finish(self, start: TransactionStart, end: TransactionEnd) -> bool:
        """Stream Commit of the transaction ``start`` begins: True if the early apply finished it
        (its buffer is not needed), False to deliver it from the buffer."""
        if start.xid != self._xid:
            return False
        assert self._early is not None
        self._xid = None
        self._subxids.clear()
        return self._early.finish(start, end)

    def cancel(self, xid: int) -> None:
        """Stream Prepare of ``xid``: a prepared transaction is applied by the two-phase divert,
        from the buffer."""
        if xid == self._xid:
            assert self._early is not None
            self._xid = None
            self._subxids.clear()
            self._early.cancel()

    def close(self) -> None:
        """Roll back the transaction taken, if any."""
        if self._xid is not None:
            assert self._early is not None
            xid, self._xid = self._xid, None
            self._subxids.clear()
            self._early.abort(xid)

    def _decline(self) -> None:
        """The early apply declined the transaction before taking any change: nothing more of
        it goes there."""
        self._xid = None
        self._subxids.clear()
