"""A change row's meta columns: the source transaction's commit LSN, commit time and xid, and
the change's order in it, encoded once per transaction (``Stamp``) for every route that writes
change rows (the careful path's parameters, the fast path's and the lane's COPY rows, the
early session's spool).

Owns the encodings of those values (text parameters, COPY text fields, binary fields). Must
never decide which change rows are written or where.
"""

from __future__ import annotations

from datetime import datetime

from ...progress.feed import PENDING
from ...protocol.lsn import LSN, to_pg_timestamp

__all__ = ["META", "Meta", "Stamp", "binary_meta", "meta_prefix", "text_meta"]

#: Statement parameter source: the change's meta values (``Statement.params``, beside NEW/OLD).
META = 2


class Stamp:
    """A source transaction's meta values, encoded once for every change row it writes."""

    __slots__ = ("commit_lsn", "commit_time", "xid", "pending", "text", "binary", "seq")

    def __init__(self, commit_lsn: LSN, commit_time: datetime | None, xid: int, pending: bool) -> None:
        if pending:
            commit_lsn, commit_time = PENDING, None
        self.commit_lsn = commit_lsn
        self.commit_time = commit_time
        self.xid = xid
        self.pending = pending
        self.text = (str(commit_lsn).encode(),
                     None if commit_time is None else commit_time.isoformat().encode(),
                     str(xid).encode())
        self.binary = (int(commit_lsn).to_bytes(8, "big"),
                       None if commit_time is None
                       else to_pg_timestamp(commit_time).to_bytes(8, "big", signed=True),
                       xid.to_bytes(8, "big", signed=True))
        self.seq = 0


#: One change's meta: its transaction's stamp and its order in it.
Meta = tuple[Stamp, int]


def text_meta(meta: Meta) -> list[bytes | None]:
    """Commit LSN, time, xid and order as text parameters (the op is a literal)."""
    stamp, seq = meta
    return [*stamp.text, str(seq).encode()]


def meta_prefix(stamp: Stamp, binary: bool) -> bytes:
    """How each change row of ``stamp``'s transaction begins, as the lane and ``feed.rows`` write
    it: its commit LSN, time and xid as COPY text fields, or as binary fields (after the tuple's
    field count)."""
    if binary:
        return b"".join(b"\xff\xff\xff\xff" if value is None else len(value).to_bytes(4, "big") + value
                        for value in stamp.binary)
    return b"".join((b"\\N" if value is None else value) + b"\t" for value in stamp.text)


def binary_meta(meta: Meta) -> tuple[bytes | None, ...]:
    """Commit LSN, time, xid and order in their binary send formats (COPY binary)."""
    stamp, seq = meta
    return (*stamp.binary, seq.to_bytes(8, "big", signed=True))
