"""Telemetry of a running worker: Prometheus metrics, ``/healthz``, ``/readyz``, log context.

Owns one small HTTP server thread (``--metrics-port``; served by ``exposition``, loaded only
then) and one probe thread. Metrics are read from the worker's own objects at scrape time by a
custom collector (the applier's counters, the stream's positions and byte count, the assembler's
memory and spill figures), so the replication hot path does no extra work; counters of ended
sessions are folded into running totals so they never go backwards. The probe thread, every
status interval, times one small query on each server over its own connections (round-trip
times) and reads the source's WAL position and the target's progress row (lag), and the counts
of resyncs and repairs recorded for the slot. Must never
touch the replication connection, the target session or the slot, and must never block the
worker: it only reads attributes the worker thread writes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg

from ..config import ConfigError, Settings, mask_dsn
from ..connections import connect
from ..errors import SourceError
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.repairs import Repairs
from ..protocol.lsn import LSN
from ..source.slots import slot_info
from .lag import Lag, LagLimit, measure_lag
from .logs import set_log_context
from .observed import Probe
from .status import done_position, source_wal_position

if TYPE_CHECKING:
    from http.server import ThreadingHTTPServer

    from ..apply.dispatch import Applier
    from ..assembler import Assembler
    from ..source import ReplicationStream

__all__ = ["Telemetry"]

log = logging.getLogger(__name__)

class Telemetry:
    """What ``applier run`` exposes about itself. Inert unless ``start()`` is called with a port."""

    def __init__(self, slot: str, *, source: str, target: str, port: int | None = None,
                 address: str = "0.0.0.0", probe_interval: float = 10.0,
                 ready_max_lag: LagLimit | None = None) -> None:
        self.slot = slot
        self._source_dsn = source
        self._target_dsn = target
        self.port = port
        self.address = address
        self.probe_interval = probe_interval
        self.ready_max_lag = ready_max_lag
        # The live session's objects (set by attach, cleared by detach).
        self._stream: ReplicationStream | None = None
        self._assembler: Assembler | None = None
        self._applier: Applier | None = None
        # Totals of ended sessions, so counters stay monotonic across reconnects.
        self._applied_base: Counter[str] = Counter()
        self._conflicts_base: Counter[tuple[str, str]] = Counter()
        self._bytes_base = 0
        self._sessions = 0
        self._last_lsn: LSN | None = None
        self._last_xid: int | None = None
        self._probe: Probe | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        #: Set to probe at once (a session attached) or to end the probe loop.
        self._probe_now = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._connections: list[psycopg.Connection[Any] | None] = [None, None]  # the probe's: source, target

    @classmethod
    def from_settings(cls, settings: Settings, slot: str) -> Telemetry:
        assert settings.source is not None and settings.target is not None  # required by run
        return cls(slot, source=settings.source, target=settings.target, port=settings.metrics_port,
                   address=settings.metrics_address, probe_interval=float(settings.status_interval),
                   ready_max_lag=settings.ready_max_lag)

    # -- worker side ----------------------------------------------------------------------------
    def start(self) -> None:
        """Register the log context; serve metrics and probe when a port is configured."""
        set_log_context(self.log_fields)
        if self.port is None:
            return
        from .exposition import serve  # prometheus_client and http.server: only with a port
        try:
            self._server = serve(self, self.address, self.port)
        except OSError as exc:
            raise ConfigError(f"metrics_port: cannot listen on {self.address}:{self.port}: "
                              f"{exc.strerror or exc}") from None
        self._server.daemon_threads = True
        # The first probe before the first scrape: the lag gauges exist, and are right, at once.
        self._probe_step()
        self._threads = [threading.Thread(target=self._server.serve_forever, name="applier-metrics",
                                          daemon=True),
                         threading.Thread(target=self._probe_loop, name="applier-probe", daemon=True)]
        for thread in self._threads:
            thread.start()
        log.info("metrics on http://%s:%d/metrics (also /healthz, /readyz)", self.address,
                 self._server.server_address[1])

    @property
    def bound_port(self) -> int | None:
        """The port actually listened on (``--metrics-port 0`` picks a free one)."""
        return self._server.server_address[1] if self._server else None

    def close(self) -> None:
        """Stop serving. The log context stays: the worker's last error line still needs it."""
        self._stopping.set()
        self._probe_now.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads = []

    def attach(self, stream: ReplicationStream, assembler: Assembler, applier: Applier) -> None:
        """A session is streaming with these objects."""
        with self._lock:
            self._stream, self._assembler, self._applier = stream, assembler, applier
            self._sessions += 1
        # A session's start may have just made the slot: the lag is known from now on.
        self._probe_now.set()

    def detach(self) -> None:
        """The session ended: fold its counters into the totals, keep its last LSN and xid."""
        with self._lock:
            if self._applier is not None:
                self._applied_base.update(self._applier.counts)
                self._conflicts_base.update(self._applier.conflicts)
                self._last_xid = self._applier.tx.xid
            if self._stream is not None:
                self._bytes_base += self._stream.bytes_received
                self._last_lsn = self._stream.received_lsn
            self._stream = self._assembler = self._applier = None

    def log_fields(self) -> dict[str, Any]:
        """Slot, last received source LSN and the xid being applied, for every log record."""
        stream, applier = self._stream, self._applier
        if stream is None:
            return {"slot": self.slot, "lsn": self._last_lsn, "xid": self._last_xid}
        return {"slot": self.slot, "lsn": stream.received_lsn,
                "xid": applier.tx.xid if applier is not None else None}

    # -- observers ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Every figure the collector exports, read consistently with attach/detach."""
        with self._lock:
            stream, assembler, applier = self._stream, self._assembler, self._applier
            applied = Counter(self._applied_base)
            conflicts = Counter(self._conflicts_base)
            received = self._bytes_base
            if applier is not None:
                applied.update(dict(applier.counts))  # dict(): an atomic copy
                conflicts.update(dict(applier.conflicts))
            if stream is not None:
                received += stream.bytes_received
            return {
                "applied": applied, "conflicts": conflicts, "bytes_received": received,
                "reconnects": max(0, self._sessions - 1), "connected": self._connected(stream),
                "received_lsn": stream.received_lsn if stream else None,
                "confirmed_lsn": stream.flush_lsn if stream else None,
                "open_streamed": len(assembler.open_streamed_xids) if assembler else 0,
                "memory_bytes": assembler.memory_bytes if assembler else 0,
                "spilled_bytes": _retry(lambda: assembler.spilled_bytes) if assembler else 0,
                "probe": self._probe,
            }

    @staticmethod
    def _connected(stream: ReplicationStream | None) -> bool:
        if stream is None:
            return False
        try:
            return not stream.connection.closed
        except SourceError:  # not connected yet, or closed
            return False

    def readiness(self) -> tuple[bool, str]:
        """Ready = streaming, the last probe reached both servers, and lag within the limit."""
        if not self._connected(self._stream):
            return False, "not connected to the source"
        probe = self._probe
        if probe is None:
            return False, "no probe yet"
        if probe.error is not None:
            return False, f"probe failed: {probe.error}"
        if self.ready_max_lag is not None and probe.lag is not None and self.ready_max_lag.exceeded_by(probe.lag):
            return False, f"lag {_describe(probe.lag)} exceeds {self.ready_max_lag.text}"
        return True, "ready" + (f": lag {_describe(probe.lag)}" if probe.lag else "")

    # -- probe thread ---------------------------------------------------------------------------
    def _probe_loop(self) -> None:
        while True:
            self._probe_now.wait(self.probe_interval)
            self._probe_now.clear()
            if self._stopping.is_set():
                break
            self._probe_step()
        for conn in self._connections:
            if conn is not None:
                conn.close()

    def _probe_step(self) -> None:
        """One probe over the probe's own connections (made again after any failure)."""
        source, target = self._connections
        try:
            if source is None:
                source = self._connections[0] = connect(self._source_dsn)
            if target is None:
                target = self._connections[1] = connect(self._target_dsn)
            self._probe = self._probe_once(source, target)
        except Exception as exc:  # noqa: BLE001 - any failure: report it, reconnect next time
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self._probe = Probe(time.monotonic(), None, None, None, None, mask_dsn(reason))
            for conn in (source, target):
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001 - it is being discarded anyway
                        pass
            self._connections = [None, None]

    def _probe_once(self, source: psycopg.Connection[Any], target: psycopg.Connection[Any]) -> Probe:
        started = time.perf_counter()
        _, source_lsn = source_wal_position(source)
        source_rtt = time.perf_counter() - started
        # What the slot has confirmed counts as handled (WAL of other tables, or before a new
        # replica's first transaction), as in applier status.
        slot = slot_info(source, self.slot)
        source.rollback()  # end the implicit transaction: the next probe sees new WAL
        started = time.perf_counter()
        progress = SqlBookkeeping(target).progress(self.slot)
        target.rollback()
        target_rtt = time.perf_counter() - started
        stream = self._stream
        confirmed = max(stream.flush_lsn if stream else LSN(0),
                        slot.confirmed_flush_lsn if slot and slot.confirmed_flush_lsn else LSN(0))
        lag: Lag | None = None
        if confirmed or progress is not None:
            lag = measure_lag(source_lsn, done_position(progress, LSN(confirmed)),
                              progress.commit_time if progress else None, datetime.now(UTC))
        # else no slot yet (--create-slot makes it at the session's start): the WAL before it is
        # not the replica's to apply, so the lag is not known rather than all of it.
        repairs = Repairs(target).totals(self.slot)
        target.rollback()
        return Probe(time.monotonic(), source_rtt, target_rtt, source_lsn, lag, None, repairs)


def _retry(read):
    # Iterating a dict the worker thread is resizing raises RuntimeError; the next try succeeds.
    for _ in range(10):
        try:
            return read()
        except RuntimeError:
            continue
    return 0


def _describe(lag: Lag) -> str:
    seconds = "unknown" if lag.seconds is None else f"{lag.seconds:.1f}s"
    return f"{lag.bytes} bytes / {seconds}"
