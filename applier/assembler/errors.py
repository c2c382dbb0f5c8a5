"""The errors the assembler raises: an impossible message sequence, and a spill that failed."""

from __future__ import annotations

__all__ = ["ProtocolSequenceError", "SpillFailed", "missing_xid"]


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


class SpillFailed(Exception):
    """A streamed transaction's spill file could not be written or read back (a full disk, a
    file size limit, a file changed by someone else): the operator's problem, not a bug. Nothing
    is lost: the transaction was neither applied nor confirmed, so the source sends it again."""

    def __init__(self, directory: str, xid: int, action: str, reason: str, needed: int | None = None,
                 free: int | None = None) -> None:
        space = ""
        if needed is not None:
            space = f" ({needed} bytes to write" + (f", {free} bytes free there)" if free is not None else ")")
        super().__init__(
            f"cannot {action} the spill file of streamed transaction {xid} in {directory}: "
            f"{reason}{space}. Free space there, or give --spill-dir a directory on a larger disk "
            "(or a larger --memory-budget), then start the worker again: the source sends the "
            "transaction again, nothing is lost")
        self.directory = directory
