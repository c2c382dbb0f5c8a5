"""The replication connection: START_REPLICATION over CopyBoth, keepalives and feedback.

Owns one ``replication="database"`` psycopg connection. ``read_batch()`` returns XLogData payloads
(``read()`` one XLogData with its WAL position), taken from libpq by a small C reader when it is
built (``_frames.c``), and answers keepalives itself; ``confirm()``
takes the flush position from the worker and standby status updates report exactly that (never
more), at least every ``status_interval`` seconds.
Must never decode pgoutput (that is the protocol stage) or guess durability.
"""

from __future__ import annotations

import fcntl
import logging
import select
import struct
import sys
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_fixed

from ..connections import with_liveness
from ..errors import Cause, SourceError, cause_of, cause_of_sqlstate
from ..libpq import Binding, pointer
from ..protocol.lsn import LSN, PG_EPOCH
from ..quoting import ident
from .lineage import SourceLineage, read_lineage
from .options import StreamOptions

__all__ = ["ReplicationStream", "SourceError", "XLogData", "classify",
           "replication_conninfo"]

log = logging.getLogger(__name__)

_SLOT_RELEASE_SECONDS = 15
_XLOGDATA_START = struct.Struct(">Q").unpack_from  # of the header: start, WAL end, send time
_KEEPALIVE = struct.Struct(">QQB")
_STATUS = struct.Struct(">cQQQQB")
#: A confirmed position that moved is reported after this many seconds at most (the full status
#: interval applies only when nothing moved): the slot releases WAL, and its confirmed position
#: (what operators watch, and what a catch-up waits for) follows the apply closely, as with
#: PostgreSQL's own subscriber, which reports every move. A status update is a few dozen bytes.
PROGRESS_REPORT_INTERVAL = 0.1
#: Seconds without anything from the server after which the stream is taken for dead (half of it
#: without anything: a reply is asked for). PostgreSQL's wal_receiver_timeout defaults to this.
RECEIVE_TIMEOUT = 60.0
#: Most XLogData messages ``read_batch`` returns at once (the caller's stop and commit checks
#: run between batches).
READ_BATCH = 256
_XLOGDATA_HEADER = 25
#: Seconds ``receive_ahead`` waits after each read (the socket holds more than arrives meanwhile).
_READ_AHEAD_PAUSE = 0.005
#: How a frame taker stopped, besides PQgetCopyData's 0 (nothing complete held), -1 (the stream
#: ended) and -2 (an error): the batch is full; a frame other than XLogData (handed back).
_LIMIT, _OTHER = 1, 2
#: (payloads to append to, limit) -> (how it stopped, bytes received, WAL start of the last
#: XLogData taken or -1, the other frame or None)
_TakeFrames = Callable[[list[bytes], int], tuple[int, int, int, "bytes | None"]]


def _take_frames_python(pgconn: pq.abc.PGconn, batch: list[bytes],
                        limit: int) -> tuple[int, int, int, bytes | None]:
    """The C frame reader's loop (``_frames.take``), in Python."""
    received = 0
    last = None  # the last XLogData frame taken (its header is read once, at the end)
    outcome: int = _LIMIT
    other = None
    while len(batch) < limit:
        nbytes, data = pgconn.get_copy_data(1)
        if nbytes <= 0:
            outcome = nbytes
            break
        received += nbytes
        if data[0] == 0x77 and nbytes >= _XLOGDATA_HEADER:  # 'w' XLogData
            batch.append(data[_XLOGDATA_HEADER:].tobytes())
            last = data
            continue
        outcome, other = _OTHER, bytes(data)
        break
    return outcome, received, -1 if last is None else _XLOGDATA_START(last, 1)[0], other


_frames_binding = Binding("replication frame reader", "source._frames", ("PQgetCopyData", "PQfreemem"))

@dataclass(frozen=True, slots=True)
class XLogData:
    data_start: LSN
    payload: bytes


def replication_conninfo(dsn: str, client_encoding: str = "UTF8") -> str:
    """The source DSN with replication=database and the session settings every text value needs
    to round-trip exactly (the same ones PostgreSQL's own subscriber sets)."""
    params = conninfo_to_dict(dsn)
    session = ("-c datestyle=ISO -c intervalstyle=postgres -c extra_float_digits=3 "
               f"-c client_encoding={client_encoding}")
    params["options"] = f"{params['options']} {session}" if params.get("options") else session
    params["replication"] = "database"
    params.setdefault("application_name", "applier")
    return with_liveness(make_conninfo("", **params))


def classify(exc: psycopg.Error) -> SourceError:
    """A psycopg error of the source as a ``SourceError`` (its cause read by the error policy)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return SourceError(f"source: {text}", cause=cause_of(exc, side="source") or Cause.LOST_CONNECTION,
                       sqlstate=exc.sqlstate)


def _cause(sqlstate: str | None) -> Cause:
    return cause_of_sqlstate(sqlstate, side="source") if sqlstate else Cause.LOST_CONNECTION


class ReplicationStream:
    """One START_REPLICATION session. Not thread-safe; one per worker."""

    def __init__(self, dsn: str, slot: str, options: StreamOptions, *, status_interval: float = 10.0,
                 client_encoding: str = "UTF8") -> None:
        self.slot = slot
        self.options = options
        self.status_interval = status_interval
        self._conninfo = replication_conninfo(dsn, client_encoding)
        self._conn: psycopg.Connection | None = None
        #: The server this connection reached, as it said before streaming (``read_lineage``).
        self.lineage: SourceLineage | None = None
        self.received_lsn = LSN(0)     # highest position the server has sent us (data or keepalive)
        self.flush_lsn = LSN(0)        # durable on the target: the only position we ever confirm
        self.keepalive_wal_end = LSN(0)
        self._last_status = 0.0
        self._reported_flush_lsn = LSN(0)
        self.bytes_received = 0
        self._ended = False            # the server ended the stream after the last batch
        self.last_start = 0            # WAL start of the last payload read_batch returned
        self._take: _TakeFrames | None = None  # the frame taker of the open connection
        #: When the server was last heard from (data or keepalive), and whether a reply was
        #: asked for since (see ``RECEIVE_TIMEOUT``).
        self._heard = time.monotonic()
        self._pinged = False

    # -- connection ---------------------------------------------------------------------------
    def connect(self) -> psycopg.Connection:
        try:
            self._conn = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise classify(exc) from exc
        self._take = None
        self.lineage = None
        return self._conn

    @property
    def connection(self) -> psycopg.Connection:
        if self._conn is None:
            raise SourceError("replication connection is not open", cause=Cause.LOST_CONNECTION)
        return self._conn

    def server_version(self) -> int:
        return self.connection.info.server_version

    def identify_system(self) -> tuple[str, int, LSN]:
        """(system id, timeline, current WAL flush position)."""
        try:
            row = self.connection.execute("IDENTIFY_SYSTEM").fetchone()
        except psycopg.Error as exc:
            raise classify(exc) from exc
        assert row is not None
        return row[0], int(row[1]), LSN.parse(row[2])

    def read_lineage(self) -> SourceLineage:
        """Which server this connection reached: its identity, timeline history and the slot as
        it has it (``lineage.read_lineage``); only before ``start``."""
        try:
            self.lineage = read_lineage(self.connection, self.slot)
        except psycopg.Error as exc:
            raise classify(exc) from exc
        return self.lineage

    def start(self, start_lsn: LSN, *, wait_for_slot: bool = True) -> None:
        """START_REPLICATION from ``start_lsn``; the server begins at max(it, confirmed_flush).

        A slot still "active" is retried for a while (unless not ``wait_for_slot``): after a lost
        connection the server may not yet have noticed that our previous walsender is gone. A
        slot held by another consumer for longer than that is a permanent error.
        """
        self._ended = False
        retrying = Retrying(retry=retry_if_exception(lambda e: wait_for_slot and isinstance(e, SourceError)
                                                     and e.sqlstate == "55006"),
                            stop=stop_after_delay(_SLOT_RELEASE_SECONDS), wait=wait_fixed(0.5),
                            reraise=True)
        for attempt in retrying:
            with attempt:
                self._start(start_lsn)

    def _start(self, start_lsn: LSN) -> None:
        self._heard, self._pinged = time.monotonic(), False
        self.flush_lsn = max(self.flush_lsn, start_lsn)
        self.received_lsn = max(self.received_lsn, start_lsn)
        command = (f"START_REPLICATION SLOT {ident(self.slot)} LOGICAL {start_lsn} "
                   f"{self.options.sql()}")
        log.debug("source: %s", command)
        pgconn = self.connection.pgconn
        try:
            pgconn.send_query(command.encode())
        except psycopg.Error as exc:
            raise SourceError(f"source: {exc}", cause=Cause.LOST_CONNECTION) from exc
        result = pgconn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            while pgconn.get_result() is not None:  # drain, so the connection can be used again
                pass
            message = (result.error_message.decode(errors="replace").strip() if result else "")
            sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE) if result else None
            state = sqlstate.decode() if sqlstate else None
            reason = message or pgconn.error_message.decode(errors="replace")
            raise SourceError(f"source: START_REPLICATION failed: {reason}", cause=_cause(state),
                              sqlstate=state)
        pgconn.nonblocking = 1
        self._last_status = time.monotonic()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            self._take = None

    # -- stream -------------------------------------------------------------------------------
    def read(self, timeout: float) -> XLogData | None:
        """Next XLogData, or None after ``timeout`` seconds without one (``read_batch`` of one)."""
        deadline = time.monotonic() + timeout
        while True:  # a keepalive ends a read_batch early; wait on for data until the deadline
            batch = self.read_batch(max(deadline - time.monotonic(), 0.0), limit=1)
            if batch:
                return XLogData(LSN(self.last_start), batch[0])
            if time.monotonic() >= deadline:
                return None

    def read_batch(self, timeout: float, limit: int = READ_BATCH) -> list[bytes]:
        """The XLogData payloads that have arrived: waits up to ``timeout`` seconds for the first,
        then takes what is already here (at most ``limit``) without waiting again; empty after
        ``timeout`` without any. Taking a batch spares the per-message overhead of a call and an
        object each, and the C frame reader (``_frames``) takes them with no Python per message;
        ``last_start`` is the WAL start of the last payload returned.

        Keepalives are consumed here; a keepalive that asks for a reply gets a status update at
        once, and one is sent anyway when ``status_interval`` has passed. A keepalive before any
        payload ends the wait at once (empty): its WAL end (``keepalive_wal_end``) may be what
        the caller waits for, as the worker does to exit when caught up.
        """
        if self._ended:
            self._raise_stream_end()
        pgconn = self.connection.pgconn
        self.send_status_if_due()
        batch: list[bytes] = []
        take = self._take
        if take is None:
            take = self._take = self._take_frames(pgconn)
        received = 0
        deadline: float | None = None
        try:
            while True:
                outcome, nbytes, start, frame = take(batch, limit)
                received += nbytes
                if nbytes:
                    self._heard, self._pinged = time.monotonic(), False
                if start >= 0:
                    self.last_start = start
                if outcome == _LIMIT:
                    return batch
                if outcome == _OTHER:
                    assert frame is not None
                    self._other_frame(frame)
                    if not batch:
                        return batch
                    continue
                if outcome == -2:
                    raise psycopg.OperationalError("receiving replication data failed: "
                                                   + pgconn.error_message.decode(errors="replace"))
                if batch:
                    self._ended = outcome < 0  # deliver what came before the end; the next call raises
                    return batch
                if outcome < 0:
                    self._raise_stream_end()
                # Nothing complete in libpq's buffer: look at the socket (even with no time left,
                # what has already arrived must be read in, or a zero timeout would spin).
                now = time.monotonic()
                if deadline is None:
                    deadline = now + timeout
                remaining = max(deadline - now, 0.0)
                readable, _, _ = select.select([pgconn.socket], [], [], min(remaining, self.status_interval))
                if readable:
                    pgconn.consume_input()
                    continue
                self._check_heard(time.monotonic())
                if remaining <= 0:
                    return batch
                self.send_status_if_due()
        finally:
            self.bytes_received += received
            if batch:
                self._received(self.last_start)

    def _check_heard(self, now: float) -> None:
        """Like PostgreSQL's wal_receiver_timeout: a server silent for half of RECEIVE_TIMEOUT is
        asked for a reply; silent for all of it, the connection is taken for dead (a server or a
        path that hangs while keeping TCP alive)."""
        silent = now - self._heard
        if silent > RECEIVE_TIMEOUT:
            raise SourceError(f"source: nothing received for {silent:.0f} s, not even a keepalive "
                              "asked for: the replication connection is taken for dead",
                              cause=Cause.LOST_CONNECTION)
        if silent > RECEIVE_TIMEOUT / 2 and not self._pinged:
            self.send_status(reply_requested=True)
            self._pinged = True

    def receive_ahead(self, budget: int, wake_fd: int) -> int:
        """Read what the server sends into libpq's input buffer, unparsed, until ``budget``
        bytes have come or ``wake_fd`` is readable; the bytes read. For a thread other than the
        one that reads the stream (which must wait for it to return): while the worker loads,
        the walsender keeps sending instead of waiting on a full socket. An error ends it
        quietly: the next ``read_batch`` meets it."""
        pgconn = self.connection.pgconn
        received = 0
        waiting = bytearray(4)
        try:
            sock = pgconn.socket
            while received < budget:
                readable, _, _ = select.select([sock, wake_fd], [], [])
                if wake_fd in readable:
                    break
                fcntl.ioctl(sock, termios.FIONREAD, waiting)
                if not any(waiting):  # readable and empty: the connection is closing
                    break
                pgconn.consume_input()
                received += int.from_bytes(waiting, sys.byteorder)
                # Take the socket's contents in a few large reads rather than message by
                # message: each wake-up costs CPU and the GIL that the loading thread needs.
                time.sleep(_READ_AHEAD_PAUSE)
        except (OSError, psycopg.Error):
            pass
        return received

    def _take_frames(self, pgconn: pq.abc.PGconn) -> _TakeFrames:
        """The frame taker for this connection: the C reader when it is built and bound to
        psycopg's libpq, else the same loop in Python."""
        frames = _frames_binding.get(pgconn)
        if frames is None:
            return lambda batch, limit: _take_frames_python(pgconn, batch, limit)
        address = pointer(pgconn)
        return lambda batch, limit: frames.take(address, batch, limit)

    def _other_frame(self, frame: bytes) -> None:
        """A CopyData frame that is not XLogData: a keepalive, answered at once if it asks."""
        kind = frame[0]
        if kind == 0x6B and len(frame) == 1 + _KEEPALIVE.size:  # 'k' keepalive
            wal_end, _, reply = _KEEPALIVE.unpack_from(frame, 1)
            self.keepalive_wal_end = LSN(wal_end)
            self._received(wal_end)
            if reply:
                self.send_status()
            return
        raise SourceError(f"source: unexpected CopyData message type {chr(kind)!r} of {len(frame)} "
                          "bytes", cause=Cause.PROTOCOL)

    def _received(self, position: int) -> None:
        if position > self.received_lsn:
            self.received_lsn = LSN(position)

    def _raise_stream_end(self) -> None:
        pgconn = self.connection.pgconn
        result = pgconn.get_result()
        message = ""
        state = None
        if result is not None and result.status == pq.ExecStatus.FATAL_ERROR:
            message = result.error_message.decode(errors="replace").strip()
            raw = result.error_field(pq.DiagnosticField.SQLSTATE)
            state = raw.decode() if raw else None
        message = message or pgconn.error_message.decode(errors="replace").strip() or "the server ended the stream"
        raise SourceError(f"source: {message}", cause=_cause(state), sqlstate=state)

    def confirm(self, flush_lsn: LSN) -> None:
        """Record a position durable on the target; the next status update reports it."""
        if flush_lsn > self.flush_lsn:
            self.flush_lsn = LSN(flush_lsn)

    def send_status_if_due(self) -> None:
        """A status update when ``status_interval`` has passed since the last one: also called
        while a long transaction is applied without reading, so the source's
        ``wal_sender_timeout`` never mistakes a busy worker for a dead one."""
        elapsed = time.monotonic() - self._last_status
        if elapsed >= self.status_interval or (self.flush_lsn > self._reported_flush_lsn
                                               and elapsed >= PROGRESS_REPORT_INTERVAL):
            self.send_status()

    def send_status(self, reply_requested: bool = False) -> None:
        """Standby status update: write = received, flush = apply = the confirmed position."""
        now = int((time.time() - PG_EPOCH.timestamp()) * 1_000_000)
        written = max(self.received_lsn, self.flush_lsn)
        message = _STATUS.pack(b"r", written, self.flush_lsn, self.flush_lsn, now, int(reply_requested))
        pgconn = self.connection.pgconn
        if pgconn.put_copy_data(message) != 1:
            raise SourceError(f"source: could not send status update: "
                              f"{pgconn.error_message.decode(errors='replace').strip()}",
                              cause=Cause.LOST_CONNECTION)
        while pgconn.flush() == 1:
            select.select([], [pgconn.socket], [], 1.0)
        self._last_status = time.monotonic()
        self._reported_flush_lsn = self.flush_lsn

