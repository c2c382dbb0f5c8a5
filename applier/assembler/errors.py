"""The one error type the assembler raises for an impossible message sequence."""

from __future__ import annotations

__all__ = ["ProtocolSequenceError"]


class ProtocolSequenceError(Exception):
    """The server (or the caller) produced a message sequence that logical replication never does.

    The message names the offending message and, where known, the transaction id and LSN. The
    stream cannot be trusted past this point: the caller should stop and restart replication.
    """
