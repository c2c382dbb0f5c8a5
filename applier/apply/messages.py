"""Logical decoding messages (``pg_logical_emit_message``) delivered to a sink.

Owns what happens to a Message once the assembler hands it over: the prefix filter, and the sink.

* ``table``: ``applier.messages`` on the target (through the bookkeeping store). A
  transactional message is inserted inside the target transaction of its source transaction, in
  stream order with that transaction's row changes, so it becomes visible exactly when (and only
  if) they do, once. A non-transactional one is inserted at once in its own transaction; the
  server may send it again after a restart (it has no commit to confirm), so rows are unique per
  (slot, message LSN) and a resent one is dropped.
* ``log``: one INFO line per message as it is applied.

Must never decide transaction boundaries; the apply stage calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from fnmatch import fnmatchcase

from ..progress.records import MessageRecord
from ..progress.store import ApplyStore
from ..protocol.lsn import LSN
from ..protocol.messages import Message

__all__ = ["MessageSink", "SINKS"]

log = logging.getLogger("applier.messages")

SINKS = ("table", "log")
_SHOWN = 200  # bytes of content shown by the log sink


class MessageSink:
    def __init__(self, store: ApplyStore, sink: str = "table", prefixes: Sequence[str] = ()) -> None:
        if sink not in SINKS:
            raise ValueError(f"message sink must be 'table' or 'log', not {sink!r}")
        self.store = store
        self.sink = sink
        self.prefixes = tuple(prefixes)
        self.delivered = 0

    def wants(self, msg: Message) -> bool:
        return not self.prefixes or any(fnmatchcase(msg.prefix, p) for p in self.prefixes)

    def deliver(self, msg: Message, xid: int | None, commit_lsn: LSN | None) -> None:
        """Transactional: call inside the open target transaction. Non-transactional: outside."""
        if not self.wants(msg):
            return
        self.delivered += 1
        if self.sink == "log":
            shown = msg.content[:_SHOWN]
            text = shown.decode("utf-8", errors="backslashreplace")
            more = f" ... ({len(msg.content)} bytes)" if len(msg.content) > _SHOWN else ""
            log.info("logical message prefix=%r lsn=%s transactional=%s%s: %s%s", msg.prefix,
                     msg.lsn, msg.transactional, f" xid={xid}" if xid is not None else "", text, more)
            return
        self.store.record_message(MessageRecord(msg.lsn, msg.transactional, msg.prefix, msg.content,
                                                xid, commit_lsn))
