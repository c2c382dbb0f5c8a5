"""The ingest gate: one decision per received payload, as PostgreSQL's worker.c makes it.

Owns the routing of every XLogData payload the stream delivers, in order, to exactly one of:

* the **lane** (``apply.lane``): plain transactions of row changes, taken straight into the fast
  path's batch without decoding, while no transaction is open or inside a plain one;
* the **stream block's buffer** (``Assembler.buffer_changes``): row changes inside a stream
  block, kept undecoded (decoded when replayed) — the gate PostgreSQL calls
  ``handle_streamed_transaction``;
* the **decoder** (``protocol.decode``) and then the assembler: everything else.

A transaction the lane began and could not finish is handed back here (its Begin payload) and
goes on through the decoder. Must never apply, buffer or decode anything itself.
"""

from __future__ import annotations

from ..apply.fast.lane import Lane
from ..assembler import Assembler
from ..protocol import decode
from ..protocol.messages import ROW_CHANGE_TYPES, MessageType

__all__ = ["IngestGate"]

#: Payloads the lane may take: Begin, and the row changes.
_LANE_TYPES = frozenset({int(MessageType.BEGIN)}) | ROW_CHANGE_TYPES


class IngestGate:
    def __init__(self, assembler: Assembler, lane: Lane | None) -> None:
        self.assembler = assembler
        self.lane = lane

    def hand_back(self, begin: bytes) -> None:
        """A transaction the lane began and did not finish: the ordinary path takes it on."""
        self.assembler.feed(decode(begin), begin)

    def feed(self, payloads: list[bytes]) -> None:
        """Every payload, in order, to the lane, the stream block's buffer or the decoder."""
        assembler, lane = self.assembler, self.lane
        index, count = 0, len(payloads)
        while index < count:
            payload = payloads[index]
            kind = payload[0]
            if assembler.in_stream:
                if kind in ROW_CHANGE_TYPES:
                    taken = assembler.buffer_changes(payloads, index)
                    if taken > index:
                        index = taken
                        continue
            elif lane is not None and kind in _LANE_TYPES:
                between = assembler.between_transactions
                if between or assembler.in_plain:
                    taken = lane.take(payloads, index, hand_back=self.hand_back if between else None)
                    if taken > index:
                        index = taken
                        continue
            assembler.feed(decode(payload, assembler.in_stream), payload)
            index += 1
