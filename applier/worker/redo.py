"""The payloads received since everything before them was committed, kept to redo them in-session.

Owns the received payloads (as the stream delivered them, in order) since the last moment the
apply stage held nothing uncommitted and the assembler nothing open or buffered, up to a byte
budget. When the fast path rolls a batch back to redo it row by row
(``Directive.REDO_CAREFUL``), the loop feeds them again instead of ending the replication
session, so the source does not send them a second time, as PostgreSQL's parallel apply falls
back in-process to a file of its own (``pa_switch_to_partial_serialize``). Past the budget (a
large streamed transaction) the log lets go of them and the redo restarts the session, as
before. Must never decide whether to redo (``errors.decide``) nor feed anything itself.
"""

from __future__ import annotations

__all__ = ["RedoLog"]


class RedoLog:
    def __init__(self, budget: int) -> None:
        #: Bytes of payloads kept at most; 0 keeps none (no fast path: nothing is ever redone).
        self.budget = budget
        self._batches: list[list[bytes]] = []
        self._bytes = 0
        #: Nothing received since the last clean point was let go of.
        self.complete = True

    def clean(self) -> None:
        """Everything received so far is committed (or needs nothing): forget it."""
        if self._batches or not self.complete:
            self._batches.clear()
            self._bytes = 0
            self.complete = True

    def record(self, payloads: list[bytes]) -> None:
        """``payloads`` were received and are about to be fed."""
        if not self.complete:
            return
        self._bytes += sum(map(len, payloads))
        if self._bytes > self.budget:
            self._batches.clear()
            self.complete = False
            return
        self._batches.append(payloads)

    def batches(self) -> list[list[bytes]]:
        """What to feed again, in order (only while ``complete``)."""
        assert self.complete
        return list(self._batches)
