"""``applier run``'s head start: the replication stream started before the worker is loaded.

Loading the worker takes about a sixth of a second (the apply stage, mostly), and on a backlog
the source has work to do before its first message reaches us: a large transaction is decoded
whole before its first change is sent, which takes the walsender seconds. So ``run`` first does,
with psycopg alone, what the worker's first session does to start its stream: read the target's
encoding and the slot's recorded position (``progress.bookkeeping``), look at the slot, resolve
the options, note the source's WAL position (the goal of ``--exit-when-caught-up``), and
START_REPLICATION. Then it loads the worker, while the source decodes; a thread receives what the
source sends into libpq's buffer meanwhile (up to a quarter of ``--memory-budget``), so that a
backlog of many small transactions, which fills the socket at once, does not keep the walsender
waiting.

Owns that one start. Must never parse the stream or confirm anything: the worker adopts the
stream only after all of its own checks (bookkeeping schema, worker lock, slot, publications,
the source server against the target's records, which is checked here too before anything
starts) and only if its first session would have started exactly this one (same position, options and
encoding); otherwise the stream is closed. Any failure here just means no head start: the worker
then meets the same problem itself and reports it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import psycopg

from .config import ConfigError, Settings
from .connections import connect
from .errors import SourceError
from .progress.bookkeeping import SqlBookkeeping
from .protocol.lsn import LSN
from .source import ReplicationStream, StreamOptions, UnsupportedOption, options_for
from .source.lineage import check_lineage, missing_slot
from .source.slots import slot_info

__all__ = ["HeadStart", "start_early"]

log = logging.getLogger(__name__)


@dataclass
class HeadStart:
    """A stream started early from ``start_lsn``, for a target in ``encoding``, until taken; the
    server it reached and its WAL position then are in ``stream.lineage``."""

    stream: ReplicationStream | None
    start_lsn: LSN
    encoding: str
    received_ahead: int = 0  # bytes the read-ahead thread received
    _reader: threading.Thread | None = field(default=None, repr=False)
    _wake: tuple[int, int] | None = field(default=None, repr=False)

    def read_ahead(self, budget: int) -> None:
        """Receive up to ``budget`` bytes into libpq's buffer in a thread until taken: many small
        transactions fill the socket long before the worker has loaded, and the walsender would
        wait on it. (libpq keeps its buffer at the size it grew to until the stream is closed.)"""
        assert self.stream is not None
        self._wake = os.pipe()
        self._reader = threading.Thread(target=self._receive, name="applier read-ahead",
                                        args=(self.stream, budget, self._wake[0]), daemon=True)
        self._reader.start()

    def _receive(self, stream: ReplicationStream, budget: int, wake_fd: int) -> None:
        self.received_ahead = stream.receive_ahead(budget, wake_fd)

    @property
    def reading_ahead(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def _stop_reading(self) -> None:
        if self._reader is not None and self._wake is not None:
            os.write(self._wake[1], b"x")
            self._reader.join()
            for fd in self._wake:
                os.close(fd)
            self._reader = self._wake = None
            log.debug("received %d bytes ahead while the worker loaded", self.received_ahead)

    def take(self, options: StreamOptions, start_lsn: LSN, encoding: str) -> ReplicationStream | None:
        """The stream, if it is the one a session with these would start; else None (closed)."""
        self._stop_reading()
        stream, self.stream = self.stream, None
        if stream is None:
            return None
        if (stream.options, self.start_lsn, self.encoding) == (options, start_lsn, encoding):
            return stream
        log.info("the stream started while the worker loaded (from %s with %s) is not this "
                 "session's (from %s with %s): starting another", self.start_lsn,
                 stream.options.sql(), start_lsn, options.sql())
        stream.close()
        return None

    def close(self) -> None:
        self._stop_reading()
        if self.stream is not None:
            self.stream.close()
            self.stream = None


def start_early(settings: Settings) -> HeadStart | None:
    """START_REPLICATION as the worker's first session would; None when anything is in the way
    (a setting missing, no bookkeeping schema yet, no slot, the slot in use, a server down)."""
    try:
        settings.require("source", "target", "slot", "publication")
    except ConfigError:
        return None
    slot = settings.required("slot")
    stream: ReplicationStream | None = None
    try:
        with connect(settings.required("target"), autocommit=True,
                             application_name=f"applier {slot} (start)") as target:
            encoding = target.info.parameter_status("server_encoding") or "UTF8"
            bookkeeping = SqlBookkeeping(target)
            applied = bookkeeping.position(slot)
            recorded = bookkeeping.source_identity(slot)
        with connect(settings.required("source"), autocommit=True,
                             application_name="applier control") as control:
            info = slot_info(control, slot)
            if info is None or info.plugin != "pgoutput":
                log.debug("no head start: slot %r is missing or not pgoutput", slot)
                return None
            options = options_for(settings, control, info.two_phase)
        start_lsn = applied.end_lsn if applied is not None else LSN(0)
        stream = ReplicationStream(settings.required("source"), slot, options,
                                   status_interval=settings.status_interval, client_encoding=encoding)
        stream.connect()
        # The worker checks this server against the target's records before it takes the
        # stream (worker.session), and that must be read before START_REPLICATION; with it the
        # source's WAL position, the goal of --exit-when-caught-up. A server the target's
        # progress did not come from gets no START_REPLICATION at all: the stream's keepalive
        # replies would confirm the target's position on its slot of that name.
        lineage = stream.read_lineage()
        if lineage.slot is None:
            raise missing_slot(slot, applied)
        check_lineage(slot, lineage, recorded, applied)
        stream.start(start_lsn, wait_for_slot=False)
    except (psycopg.Error, SourceError, UnsupportedOption) as exc:
        log.debug("no head start: %s", str(exc).strip())
        if stream is not None:
            stream.close()
        return None
    log.debug("stream started from %s before the worker loaded", start_lsn)
    head_start = HeadStart(stream, start_lsn, encoding)
    head_start.read_ahead(settings.memory_budget // 4)
    return head_start
