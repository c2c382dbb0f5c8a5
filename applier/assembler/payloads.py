"""What the assembler reads of a payload it does not decode: its message type and the xid after it.

Owns recognising the row changes of a stream block (Insert, Update, Delete payloads) by their
first byte, and finding where a run of one (sub)transaction's row changes ends. Must never decode
anything further of a payload, and never name a message type by its byte value (the protocol's
``MessageType`` does).
"""

from __future__ import annotations

from itertools import islice, repeat

from applier.protocol import MessageType

__all__ = ["ROW_CHANGES", "change_prefixes", "run_end"]

#: Row change payloads by their first byte (the message type). In a stream block the top-level
#: or subtransaction xid follows it as a big-endian UInt32 (bytes 1 to 5).
ROW_CHANGES = {int(t): t.type_name for t in (MessageType.INSERT, MessageType.UPDATE,
                                             MessageType.DELETE)}


def change_prefixes(*xids: int) -> tuple[bytes, ...]:
    """How an Insert, Update or Delete payload of each of ``xids`` begins (type, then xid)."""
    return tuple(bytes((kind,)) + xid.to_bytes(4, "big") for xid in dict.fromkeys(xids)
                 for kind in ROW_CHANGES)


def run_end(payloads: list[bytes], start: int, prefixes: tuple[bytes, ...]) -> int:
    """The index of the first payload from ``start`` on that begins with none of ``prefixes``
    (``len(payloads)`` if every one does), without a Python step per payload."""
    begins = list(map(bytes.startswith, islice(payloads, start, None), repeat(prefixes)))
    try:
        return start + begins.index(False)
    except ValueError:
        return len(payloads)
