"""Delivering a buffered streamed transaction to the sink, once its end has arrived.

Owns: replaying a buffer a chunk of records at a time, offering each chunk to the sink still
encoded (``take_changes``) and decoding only the records it leaves, and the heartbeat that keeps
a long replay from looking dead to the source. Must never keep state between transactions,
remove a buffer, or decide which message may follow which (the assembler does).
"""

from __future__ import annotations

from collections.abc import Callable

from applier.protocol import Origin, Relation, Type, decode

from .buffer import StreamBuffer
from .sink import TransactionEnd, TransactionSink, TransactionStart

__all__ = ["HEARTBEAT_EVERY", "REPLAY_CHUNK", "deliver", "replay"]

#: Replayed changes of a streamed transaction are offered to the sink this many at a time.
REPLAY_CHUNK = 256
#: How many replayed changes of a streamed transaction pass between two heartbeat calls (a
#: multiple of REPLAY_CHUNK).
HEARTBEAT_EVERY = 4 * REPLAY_CHUNK


def replay(sink: TransactionSink, buffer: StreamBuffer, start: TransactionStart,
           end: TransactionEnd, finish: Callable[[TransactionEnd], None],
           heartbeat: Callable[[], None] | None) -> None:
    """Deliver a streamed transaction from its buffer, a chunk of changes at a time: the sink
    may take changes of a chunk still encoded (``take_changes``); the others are decoded here
    one at a time. ``finish`` (the sink's ``commit`` or ``prepare``) ends it; ``heartbeat`` is
    called every HEARTBEAT_EVERY changes."""
    sink.begin(start)
    chunk: list[bytes] = []
    delivered = 0
    for raw in buffer.replay():
        chunk.append(raw)
        if len(chunk) == REPLAY_CHUNK:
            deliver(sink, chunk)
            chunk = []
            delivered += REPLAY_CHUNK
            if heartbeat is not None and delivered % HEARTBEAT_EVERY == 0:
                heartbeat()
    deliver(sink, chunk)
    finish(end)


def deliver(sink: TransactionSink, chunk: list[bytes]) -> None:
    """Deliver buffered records of a streamed transaction, still encoded, to ``sink`` in order:
    it may take runs of row changes itself (``take_changes``); each record it leaves is decoded
    and delivered by its type."""
    index, count = 0, len(chunk)
    while index < count:
        index = sink.take_changes(chunk, index)
        if index == count:
            return
        msg = decode(chunk[index], in_stream=True)
        index += 1
        kind = type(msg)
        if kind is Relation:
            sink.relation(msg)  # type: ignore[arg-type]
        elif kind is Type:
            sink.type(msg)  # type: ignore[arg-type]
        elif kind is Origin:
            sink.origin(msg)  # type: ignore[arg-type]
        else:
            sink.change(msg)  # type: ignore[arg-type]
