"""Transaction assembler: decoded messages in, whole source transactions out to a sink.

Owns the transaction structure of the replication stream: which messages may follow which,
passing plain transactions straight through, and for a streamed (in-progress) transaction where
each record of its stream blocks goes: buffered per top-level xid (:mod:`.streams`, under one
memory budget) until its Stream Commit or Stream Prepare replays it (:mod:`.replay`), or passed
on as it streams to an ``EarlyApply`` (:mod:`.early`), which then holds the only copy of its row
changes. PostgreSQL's apply worker in serialize mode (worker.c) is the behavioural model of the
buffering, its parallel apply that of the early apply. Must never apply anything, touch a
database or the network, or keep message objects of a streamed transaction in memory (only their
raw bytes).

If the sink raises, the assembler's state for the transaction being delivered is gone: the caller
must ``close()`` and restart replication from the server, which resends the transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from applier.protocol import (
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    Prepare,
    Relation,
    ReplicationMessage,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
)

from .buffer import StreamBuffer
from .early import EarlyRoute
from .errors import ProtocolSequenceError
from .replay import replay
from .sink import Change, EarlyApply, TransactionEnd, TransactionSink, TransactionStart
from .streams import OpenStreams

__all__ = ["Assembler"]


class Assembler:
    """Feed every decoded message with ``feed(msg, raw)``; the sink receives transactions."""

    def __init__(self, sink: TransactionSink, *, memory_budget: int, spill_dir: Path,
                 heartbeat: Callable[[], None] | None = None,
                 early: EarlyApply | None = None) -> None:
        self._streams = OpenStreams(memory_budget, spill_dir)
        self._sink = sink
        # Called every HEARTBEAT_EVERY changes of a replayed streamed transaction: applying a
        # large one takes longer than the source waits for a sign of life.
        self._heartbeat = heartbeat
        # The non-streamed transaction being passed through (between Begin or Begin Prepare and
        # its end, which must repeat its commit_lsn: Begin's final LSN, Begin Prepare's LSN).
        self._plain: TransactionStart | None = None
        self._block: StreamBuffer | None = None  # the xid between Stream Start and Stream Stop
        self._early = EarlyRoute(early)
        self._handlers: dict[type, Callable[[Any, bytes], None]] = {
            Insert: self._change, Update: self._change, Delete: self._change,
            Truncate: self._change, Message: self._message, Relation: self._relation,
            Type: self._type, Origin: self._origin, Begin: self._begin,
            Commit: self._commit, BeginPrepare: self._begin_prepare, Prepare: self._prepare,
            StreamStart: self._stream_start, StreamStop: self._stream_stop,
            StreamCommit: self._stream_commit, StreamAbort: self._stream_abort,
            StreamPrepare: self._stream_prepare, CommitPrepared: self._commit_prepared,
            RollbackPrepared: self._rollback_prepared,
        }

    @property
    def in_stream(self) -> bool:
        """True between Stream Start and Stream Stop: pass it to ``decode(..., in_stream=)``."""
        return self._block is not None

    @property
    def between_transactions(self) -> bool:
        """No plain transaction and no stream block open (streamed transactions may be)."""
        return self._plain is None and self._block is None

    @property
    def in_plain(self) -> bool:
        """Inside a plain transaction begun by Begin (not a prepared one)."""
        plain = self._plain
        return plain is not None and plain.gid is None

    @property
    def idle(self) -> bool:
        """No transaction or stream block open and nothing buffered: every message received so
        far has been fully delivered to the sink."""
        return self._plain is None and self._block is None and not self._streams

    @property
    def memory_bytes(self) -> int:
        """Bytes charged against the budget by all open streamed transactions."""
        return self._streams.memory_bytes

    @property
    def spilled_bytes(self) -> int:
        """Total size of the spill files of all open streamed transactions."""
        return self._streams.spilled_bytes

    @property
    def open_streamed_xids(self) -> tuple[int, ...]:
        """Streamed transactions started and not yet committed, prepared or aborted."""
        return self._streams.xids

    def feed(self, msg: ReplicationMessage, raw: bytes) -> None:
        """Process one message; ``raw`` is exactly the bytes ``msg`` was decoded from."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise TypeError(f"not a replication message: {type(msg).__name__}")
        handler(msg, raw)

    def buffer_changes(self, payloads: list[bytes], start: int) -> int:
        """Inside a stream block, buffer the row changes (Insert, Update, Delete payloads) from
        ``start`` on as ``feed`` would, without decoding them: a buffered change needs only its
        xid, and its replay decodes it (a malformed one fails there, before anything of its
        transaction commits). Those of the transaction applied as it streams go there instead
        (until it declines). Returns the index of the first payload that is not one."""
        block = self._block
        if block is None:
            return start
        if block.xid == self._early.xid:
            start = self._early.changes(block.xid, payloads, start)
            if block.xid == self._early.xid:
                return start
        return self._streams.buffer_changes(block, payloads, start)

    def close(self) -> None:
        """Drop every buffered transaction and remove all spill files (the one applied as it
        streams is rolled back). What is fed next must begin between transactions: a session
        that starts again, or the worker's redo of what it received since a clean point."""
        self._early.close()
        self._streams.close()
        self._block = None
        self._plain = None

    # -- changes and schema ------------------------------------------------------------------

    def _change(self, msg: Insert | Update | Delete | Truncate | Message, raw: bytes) -> None:
        if self._block is not None:
            self._buffer(msg.xid, raw, msg.type_name, msg)
        elif self._plain is not None:
            self._sink.change(msg)
        else:
            raise ProtocolSequenceError(f"{msg.type_name} outside any transaction or stream block")

    def _message(self, msg: Message, raw: bytes) -> None:
        # The server sends non-transactional messages at once, even from a transaction that
        # later aborts, so they are never buffered.
        if msg.transactional:
            self._change(msg, raw)
        else:
            self._sink.message(msg)

    def _relation(self, msg: Relation, raw: bytes) -> None:
        if self._block is not None:
            self._buffer(msg.xid, raw, "relation", msg)
        else:
            self._sink.relation(msg)

    def _type(self, msg: Type, raw: bytes) -> None:
        if self._block is not None:
            self._buffer(msg.xid, raw, "type", msg)
        else:
            self._sink.type(msg)

    def _origin(self, msg: Origin, raw: bytes) -> None:
        if self._block is not None:
            # Origin carries no xid; it belongs to the top-level transaction of the block.
            self._buffer(self._block.xid, raw, "origin", msg)
        elif self._plain is not None:
            self._sink.origin(msg)
        else:
            raise ProtocolSequenceError(
                f"origin {msg.name!r} at LSN {msg.origin_lsn} outside any transaction or stream block")

    def _buffer(self, subxid: int | None, raw: bytes, what: str,
                msg: Change | Relation | Type | Origin) -> None:
        """Buffer one decoded record of the stream block. When its transaction is applied as it
        streams, ``msg`` goes there instead (a schema message: as well)."""
        block = self._block
        assert block is not None
        if block.xid == self._early.xid and self._early.record(block.xid, subxid, msg):
            return
        self._streams.append(block, subxid, raw, what)

    # -- plain transactions ------------------------------------------------------------------

    def _begin(self, msg: Begin, raw: bytes) -> None:
        if self._plain is not None or self._block is not None:  # the description only for errors
            self._require_idle(f"begin of xid {msg.xid} (final LSN {msg.final_lsn})")
        plain = self._plain = TransactionStart(msg.xid, msg.final_lsn, msg.commit_time,
                                               streamed=False, gid=None, end_lsn=None)
        self._sink.begin(plain)

    def _begin_prepare(self, msg: BeginPrepare, raw: bytes) -> None:
        self._require_idle(f"begin_prepare of xid {msg.xid} (prepare LSN {msg.prepare_lsn})")
        plain = self._plain = TransactionStart(msg.xid, msg.prepare_lsn, msg.prepare_time,
                                               streamed=False, gid=msg.gid, end_lsn=msg.end_lsn)
        self._sink.begin(plain)

    def _commit(self, msg: Commit, raw: bytes) -> None:
        plain = self._plain
        if plain is None or plain.gid is not None:
            raise ProtocolSequenceError(f"commit at commit LSN {msg.commit_lsn} without begin" + (
                f" (xid {plain.xid} began with begin_prepare)" if plain is not None else ""))
        if msg.commit_lsn != plain.commit_lsn:
            raise ProtocolSequenceError(
                f"commit at commit LSN {msg.commit_lsn} does not match the final LSN "
                f"{plain.commit_lsn} of its begin (xid {plain.xid})")
        self._plain = None
        self._sink.commit(TransactionEnd(plain.xid, msg.commit_lsn, msg.end_lsn, msg.commit_time,
                                         streamed=False, gid=None))

    def _prepare(self, msg: Prepare, raw: bytes) -> None:
        plain = self._plain
        where = f"prepare of xid {msg.xid} at prepare LSN {msg.prepare_lsn}"
        if plain is None or plain.gid is None:
            raise ProtocolSequenceError(f"{where} without begin_prepare" + (
                f" (xid {plain.xid} began with begin)" if plain is not None else ""))
        if msg.xid != plain.xid or msg.prepare_lsn != plain.commit_lsn:
            raise ProtocolSequenceError(
                f"{where} does not match its begin_prepare (xid {plain.xid}, "
                f"LSN {plain.commit_lsn})")
        self._plain = None
        self._sink.prepare(TransactionEnd(msg.xid, msg.prepare_lsn, msg.end_lsn, msg.prepare_time,
                                          streamed=False, gid=msg.gid))

    def _commit_prepared(self, msg: CommitPrepared, raw: bytes) -> None:
        self._require_idle(f"commit_prepared of xid {msg.xid} at commit LSN {msg.commit_lsn}")
        self._drop_restreamed(msg.xid)
        self._sink.commit_prepared(msg)

    def _rollback_prepared(self, msg: RollbackPrepared, raw: bytes) -> None:
        self._require_idle(
            f"rollback_prepared of xid {msg.xid} at end LSN {msg.rollback_end_lsn}")
        self._drop_restreamed(msg.xid)
        self._sink.rollback_prepared(msg)

    def _drop_restreamed(self, xid: int) -> None:
        """After a restart past a prepare, the server decodes the prepared transaction again (its
        changes precede the restart position), may stream them once over its memory limit, and
        then, its prepare being already confirmed, sends only Commit/Rollback Prepared
        (reorderbuffer.c: ReorderBufferFinishPrepared). Those streamed changes are never needed:
        PostgreSQL's own worker leaves them in its spool file; we drop them here."""
        buffer = self._streams.get(xid)
        if buffer is not None:
            self._early.abort(xid, xid)
            self._streams.drop(buffer)

    # -- streamed transactions ---------------------------------------------------------------

    def _stream_start(self, msg: StreamStart, raw: bytes) -> None:
        self._require_idle(f"stream_start of xid {msg.xid}")
        buffer = self._streams.get(msg.xid)
        if msg.first_segment:
            if buffer is not None:
                raise ProtocolSequenceError(
                    f"stream_start (first segment) of xid {msg.xid}, which is already open")
            buffer = self._streams.open(msg.xid)
            self._early.open(msg.xid)
        elif buffer is None:
            raise ProtocolSequenceError(
                f"stream_start (later segment) of xid {msg.xid}, whose first segment never came")
        self._block = buffer

    def _stream_stop(self, msg: StreamStop, raw: bytes) -> None:
        block = self._block
        if block is None:
            raise ProtocolSequenceError("stream_stop without stream_start")
        self._block = None
        self._early.pause(block.xid)

    def _stream_abort(self, msg: StreamAbort, raw: bytes) -> None:
        self._require_idle(f"stream_abort of xid {msg.xid} (subxid {msg.subxid})")
        buffer = self._streams.get(msg.xid)
        if buffer is None:
            return  # the server may abort transactions it never streamed a change of
        self._early.abort(msg.xid, msg.subxid)
        if msg.subxid == msg.xid:
            self._streams.drop(buffer)
        else:
            self._streams.abort_subxact(buffer, msg.subxid)

    def _stream_commit(self, msg: StreamCommit, raw: bytes) -> None:
        buffer = self._streamed_end(msg.xid, f"stream_commit of xid {msg.xid} at commit LSN "
                                             f"{msg.commit_lsn}")
        start = TransactionStart(msg.xid, msg.commit_lsn, msg.commit_time, streamed=True,
                                 gid=None, end_lsn=msg.end_lsn)
        end = TransactionEnd(msg.xid, msg.commit_lsn, msg.end_lsn, msg.commit_time,
                             streamed=True, gid=None)
        if self._early.finish(start, end):
            self._streams.drop(buffer)
            return
        self._replay(buffer, start, end, self._sink.commit)

    def _stream_prepare(self, msg: StreamPrepare, raw: bytes) -> None:
        buffer = self._streamed_end(msg.xid, f"stream_prepare of xid {msg.xid} at prepare LSN "
                                             f"{msg.prepare_lsn}")
        self._early.cancel(msg.xid)
        self._replay(buffer,
                     TransactionStart(msg.xid, msg.prepare_lsn, msg.prepare_time, streamed=True,
                                      gid=msg.gid, end_lsn=msg.end_lsn),
                     TransactionEnd(msg.xid, msg.prepare_lsn, msg.end_lsn, msg.prepare_time,
                                    streamed=True, gid=msg.gid),
                     self._sink.prepare)

    def _streamed_end(self, xid: int, what: str) -> StreamBuffer:
        self._require_idle(what)
        buffer = self._streams.get(xid)
        if buffer is None:
            raise ProtocolSequenceError(f"{what}, but no stream_start was seen for that xid")
        return buffer

    def _replay(self, buffer: StreamBuffer, start: TransactionStart, end: TransactionEnd,
                finish: Callable[[TransactionEnd], None]) -> None:
        """Deliver a streamed transaction from its buffer, then drop the buffer (also when the
        sink raises)."""
        try:
            replay(self._sink, buffer, start, end, finish, self._heartbeat)
        finally:
            self._streams.drop(buffer)

    def _require_idle(self, what: str) -> None:
        """Raise unless we are between transactions and outside any stream block."""
        if self._block is not None:
            raise ProtocolSequenceError(
                f"{what} inside the stream block of xid {self._block.xid} (no stream_stop yet)")
        if self._plain is not None:
            raise ProtocolSequenceError(
                f"{what} inside transaction xid {self._plain.xid} (LSN {self._plain.commit_lsn})")
