"""Transaction assembler: decoded messages in, whole source transactions out to a sink.

Owns the transaction structure of the replication stream: which messages may follow which,
passing plain transactions straight through, and buffering streamed (in-progress) transactions
per top-level xid until their Stream Commit or Stream Prepare, with subtransaction aborts and a
memory budget enforced by spilling to local files (PostgreSQL's apply worker in serialize mode,
worker.c, is the behavioural model). One streamed transaction at a time may instead be passed
on as it streams to an ``EarlyApply`` (PostgreSQL's parallel apply is the model there), which
then holds the only copy of its row changes. Must never apply anything, touch a database or the
network, or keep message objects of a streamed transaction in memory (only their raw bytes).

If the sink raises, the assembler's state for the transaction being delivered is gone: the caller
must ``close()`` and restart replication from the server, which resends the transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice, repeat
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
    MessageType,
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
    decode,
)

from .buffer import SPILL_GLOB, StreamBuffer, record_cost, spill_path
from .errors import ProtocolSequenceError
from .sink import Change, EarlyApply, TransactionEnd, TransactionSink, TransactionStart

__all__ = ["Assembler", "deliver"]

#: Row change payloads by their first byte (the message type).
_ROW_CHANGES = {int(t): t.type_name for t in (MessageType.INSERT, MessageType.UPDATE,
                                              MessageType.DELETE)}


def _change_prefixes(*xids: int) -> tuple[bytes, ...]:
    """How an Insert, Update or Delete payload of each of ``xids`` begins (type, then xid)."""
    return tuple(bytes((kind,)) + xid.to_bytes(4, "big") for xid in dict.fromkeys(xids)
                 for kind in _ROW_CHANGES)


def _run_end(payloads: list[bytes], start: int, prefixes: tuple[bytes, ...]) -> int:
    """The index of the first payload from ``start`` on that begins with none of ``prefixes``
    (``len(payloads)`` if every one does), without a Python step per payload."""
    begins = list(map(bytes.startswith, islice(payloads, start, None), repeat(prefixes)))
    try:
        return start + begins.index(False)
    except ValueError:
        return len(payloads)


#: Replayed changes of a streamed transaction are offered to the sink this many at a time.
REPLAY_CHUNK = 256
#: How many replayed changes of a streamed transaction pass between two heartbeat calls (a
#: multiple of REPLAY_CHUNK).
HEARTBEAT_EVERY = 4 * REPLAY_CHUNK


class Assembler:
    """Feed every decoded message with ``feed(msg, raw)``; the sink receives transactions."""

    def __init__(self, sink: TransactionSink, *, memory_budget: int, spill_dir: Path,
                 heartbeat: Callable[[], None] | None = None,
                 early: EarlyApply | None = None) -> None:
        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {memory_budget}")
        self._sink = sink
        # Called every HEARTBEAT_EVERY changes of a replayed streamed transaction: applying a
        # large one takes longer than the source waits for a sign of life.
        self._heartbeat = heartbeat
        self._budget = memory_budget
        self._spill_dir = spill_dir
        spill_dir.mkdir(parents=True, exist_ok=True)
        # Spill files of an earlier run are worthless: the server restreams those transactions
        # from their first segment because their commit was never confirmed.
        for stale in spill_dir.glob(SPILL_GLOB):
            stale.unlink(missing_ok=True)
        # The non-streamed transaction being passed through (between Begin or Begin Prepare and
        # its end, which must repeat its commit_lsn: Begin's final LSN, Begin Prepare's LSN).
        self._plain: TransactionStart | None = None
        self._block: StreamBuffer | None = None  # the xid between Stream Start and Stream Stop
        self._streams: dict[int, StreamBuffer] = {}  # every open streamed xid, in start order
        self._early = early
        self._early_xid: int | None = None  # the streamed xid being applied as it streams
        self._early_subxids: set[int] = set()  # its subtransactions seen so far
        self._memory_bytes = 0
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
        return self._memory_bytes

    @property
    def spilled_bytes(self) -> int:
        """Total size of the spill files of all open streamed transactions."""
        return sum(buffer.file_bytes for buffer in self._streams.values())

    @property
    def open_streamed_xids(self) -> tuple[int, ...]:
        """Streamed transactions started and not yet committed, prepared or aborted."""
        return tuple(self._streams)

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
        transaction commits). Those of the transaction applied as it streams go there instead.
        Returns the index of the first payload that is not one."""
        block = self._block
        if block is None:
            return start
        if block.xid == self._early_xid:
            return self._buffer_early(block, payloads, start)
        buffer = self._buffer
        for index in range(start, len(payloads)):
            raw = payloads[index]
            name = _ROW_CHANGES.get(raw[0])
            if name is None or len(raw) < 5:
                return index
            buffer(int.from_bytes(raw[1:5], "big"), raw, name)
        return len(payloads)

    def _buffer_early(self, block: StreamBuffer, payloads: list[bytes], start: int) -> int:
        """``buffer_changes`` for the transaction applied as it streams: its changes go there in
        runs cut where a subtransaction begins, and are not buffered (unless it declines)."""
        early = self._early
        assert early is not None
        subxids, xid = self._early_subxids, block.xid
        passed = index = start
        count = len(payloads)
        prefixes = _change_prefixes(xid)
        while index < count:
            # Most payloads continue the run of the (sub)transaction before them: find where the
            # run ends in one pass of C, and look at that payload alone.
            index = _run_end(payloads, index, prefixes)
            if index == count:
                break
            raw = payloads[index]
            if raw[0] not in _ROW_CHANGES or len(raw) < 5:
                break
            subxid = int.from_bytes(raw[1:5], "big")
            if subxid != xid and subxid not in subxids:
                if index > passed and not early.changes(payloads, passed, index):
                    return self._decline_early(payloads, passed)
                passed = index
                if not subxid:
                    raise self._no_xid(block, subxid, _ROW_CHANGES[raw[0]])
                subxids.add(subxid)
                early.subtransaction(subxid)
            prefixes = _change_prefixes(xid, subxid)
            index += 1
        if index > passed and not early.changes(payloads, passed, index):
            return self._decline_early(payloads, passed)
        return index

    def _decline_early(self, payloads: list[bytes], start: int) -> int:
        """The early apply declined the transaction before taking any change: buffer it from
        here on, as any other."""
        self._early_xid = None
        self._early_subxids.clear()
        return self.buffer_changes(payloads, start)

    def close(self) -> None:
        """Drop every buffered transaction and remove all spill files (the one applied as it
        streams is rolled back)."""
        self._abort_early()
        for buffer in self._streams.values():
            buffer.remove()
        self._streams.clear()
        self._block = None
        self._plain = None
        self._memory_bytes = 0

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
                msg: Change | Relation | Type | Origin | None = None) -> None:
        """Buffer one record of the stream block. When its transaction is applied as it streams,
        ``msg`` (the record decoded) goes there instead (a schema message: as well)."""
        block = self._block
        assert block is not None
        if msg is not None and block.xid == self._early_xid and self._pass_early(block, subxid, msg):
            return
        if not subxid:
            raise self._no_xid(block, subxid, what)
        if type(raw) is not bytes:
            raw = bytes(raw)  # never pin a larger receive buffer through a view
        cost = record_cost(raw)
        if self._memory_bytes + cost > self._budget:
            self._make_room(cost)
        if self._memory_bytes + cost > self._budget:
            # One change larger than the whole budget: it goes straight to disk.
            self._memory_bytes -= block.append_to_file(subxid, raw)
        else:
            block.append(subxid, raw)
            self._memory_bytes += cost

    def _pass_early(self, block: StreamBuffer, subxid: int | None,
                    msg: Change | Relation | Type | Origin) -> bool:
        """A decoded record of the transaction applied as it streams: True if taken there (and
        so not to be buffered); schema messages are buffered as well."""
        early = self._early
        assert early is not None
        if isinstance(msg, (Relation, Type)):
            early.schema(msg)
            return False
        if not subxid:
            raise self._no_xid(block, subxid, msg.type_name)
        if subxid != block.xid and subxid not in self._early_subxids:
            self._early_subxids.add(subxid)
            early.subtransaction(subxid)
        if early.change(msg):
            return True
        self._early_xid = None
        self._early_subxids.clear()
        return False

    @staticmethod
    def _no_xid(block: StreamBuffer, subxid: int | None, what: str) -> ProtocolSequenceError:
        # PostgreSQL rejects xid 0 too (worker.c: handle_streamed_transaction); None means the
        # caller decoded without in_stream=True.
        return ProtocolSequenceError(
            f"{what} inside the stream block of xid {block.xid} has no valid transaction id "
            f"({subxid!r}); messages in a stream block must be decoded with in_stream=True")

    def _make_room(self, cost: int) -> None:
        """Spill the largest in-memory buffers until ``cost`` more bytes fit the budget (or
        nothing is left in memory)."""
        while self._memory_bytes + cost > self._budget:
            largest = max(self._streams.values(), key=lambda buffer: buffer.memory_bytes)
            if not largest.memory_bytes:
                return
            self._memory_bytes -= largest.spill()

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
            if xid == self._early_xid:
                self._abort_early()
            self._drop(buffer)

    # -- streamed transactions ---------------------------------------------------------------

    def _stream_start(self, msg: StreamStart, raw: bytes) -> None:
        self._require_idle(f"stream_start of xid {msg.xid}")
        buffer = self._streams.get(msg.xid)
        if msg.first_segment:
            if buffer is not None:
                raise ProtocolSequenceError(
                    f"stream_start (first segment) of xid {msg.xid}, which is already open")
            buffer = StreamBuffer(msg.xid, spill_path(self._spill_dir, msg.xid))
            self._streams[msg.xid] = buffer
            if self._early is not None and self._early_xid is None and self._early.open(msg.xid):
                self._early_xid = msg.xid
        elif buffer is None:
            raise ProtocolSequenceError(
                f"stream_start (later segment) of xid {msg.xid}, whose first segment never came")
        self._block = buffer

    def _stream_stop(self, msg: StreamStop, raw: bytes) -> None:
        block = self._block
        if block is None:
            raise ProtocolSequenceError("stream_stop without stream_start")
        self._block = None
        if block.xid == self._early_xid:
            assert self._early is not None
            self._early.pause()

    def _stream_abort(self, msg: StreamAbort, raw: bytes) -> None:
        self._require_idle(f"stream_abort of xid {msg.xid} (subxid {msg.subxid})")
        buffer = self._streams.get(msg.xid)
        if buffer is None:
            return  # the server may abort transactions it never streamed a change of
        if msg.subxid == msg.xid:
            if msg.xid == self._early_xid:
                self._abort_early()
            self._drop(buffer)
        else:
            if msg.xid == self._early_xid:
                assert self._early is not None
                self._early.abort(msg.subxid)
            self._memory_bytes -= buffer.abort_subxact(msg.subxid)

    def _stream_commit(self, msg: StreamCommit, raw: bytes) -> None:
        buffer = self._streamed_end(msg.xid, f"stream_commit of xid {msg.xid} at commit LSN "
                                             f"{msg.commit_lsn}")
        start = TransactionStart(msg.xid, msg.commit_lsn, msg.commit_time, streamed=True,
                                 gid=None, end_lsn=msg.end_lsn)
        end = TransactionEnd(msg.xid, msg.commit_lsn, msg.end_lsn, msg.commit_time,
                             streamed=True, gid=None)
        if msg.xid == self._early_xid:
            assert self._early is not None
            self._early_xid = None
            self._early_subxids.clear()
            if self._early.finish(start, end):
                self._drop(buffer)
                return
        self._replay(buffer, start, end, self._sink.commit)

    def _stream_prepare(self, msg: StreamPrepare, raw: bytes) -> None:
        buffer = self._streamed_end(msg.xid, f"stream_prepare of xid {msg.xid} at prepare LSN "
                                             f"{msg.prepare_lsn}")
        if msg.xid == self._early_xid:
            assert self._early is not None
            self._early_xid = None  # a prepared transaction is applied by the two-phase divert
            self._early_subxids.clear()
            self._early.cancel()
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
        """Deliver a streamed transaction from its buffer, a chunk of changes at a time: the sink
        may take changes of a chunk still encoded (``take_changes``); the others are decoded here
        one at a time."""
        sink = self._sink
        heartbeat = self._heartbeat
        try:
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
        finally:
            self._drop(buffer)

    def _abort_early(self) -> None:
        if self._early_xid is not None:
            assert self._early is not None
            xid, self._early_xid = self._early_xid, None
            self._early_subxids.clear()
            self._early.abort(xid)

    def _drop(self, buffer: StreamBuffer) -> None:
        self._memory_bytes -= buffer.memory_bytes
        buffer.remove()
        del self._streams[buffer.xid]

    def _require_idle(self, what: str) -> None:
        """Raise unless we are between transactions and outside any stream block."""
        if self._block is not None:
            raise ProtocolSequenceError(
                f"{what} inside the stream block of xid {self._block.xid} (no stream_stop yet)")
        if self._plain is not None:
            raise ProtocolSequenceError(
                f"{what} inside transaction xid {self._plain.xid} (LSN {self._plain.commit_lsn})")


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
