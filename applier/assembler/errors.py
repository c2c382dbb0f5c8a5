"""The one error type the assembler raises for an impossible message sequence."""

from __future__ import annotations

__all__ = ["ProtocolSequenceError", "missing_xid"]


class ProtocolSequenceError(Exception):
    """The server (or the caller) produced a message sequence that logical replication never does.

    The message names the offending message and, where known, the transaction id and LSN. The
    stream cannot be trusted past this point: the caller should stop and restart replication.
    """


def missing_xid(xid: int, subxid: int | None, what: str) -> ProtocolSequenceError:
    """A record of the stream block of ``xid`` whose own xid is 0 or was never decoded."""
    # PostgreSQL rejects xid 0 too (worker.c: handle_streamed_transaction); None means the
    # caller decoded without in_stream=True.
    return ProtocolSequenceError(
        f"{what} inside the stream block of xid {xid} has no valid transaction id "
        f"({subxid!r}); messages in a stream block must be decoded with in_stream=True")
