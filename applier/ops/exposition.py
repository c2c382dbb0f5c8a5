"""The HTTP side of a worker's telemetry: Prometheus exposition, ``/healthz`` and ``/readyz``.

Owns the metric collector and the request handler of ``--metrics-port``. Loaded by
``metrics.Telemetry.start`` only when a port is set: prometheus_client and http.server are start-up time
that every ``applier run`` would pay otherwise. Must never touch the worker's connections or
objects: it reads ``Observed.snapshot()`` and ``Observed.readiness()`` only.
"""

from __future__ import annotations

from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .observed import ROW_KINDS, Observed, Probe

__all__ = ["serve"]


def serve(telemetry: Observed, address: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for ``telemetry`` on ``address``:``port``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_WorkerCollector(telemetry))
    return ThreadingHTTPServer((address, port), _handler(telemetry, registry))


class _WorkerCollector(Collector):
    """Builds the metric families from ``Observed.snapshot()`` at each scrape."""

    def __init__(self, telemetry: Observed) -> None:
        self.telemetry = telemetry

    def collect(self) -> Iterator[Metric]:
        snap = self.telemetry.snapshot()
        slot = self.telemetry.slot

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["slot"])
            family.add_metric([slot], value)
            return family

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["slot"])
            if value is not None:
                family.add_metric([slot], value)
            return family

        applied = snap["applied"]
        yield counter("applier_transactions_applied", "Source transactions committed on the target.",
                      applied["transactions"])
        yield counter("applier_streamed_applied_early", "Streamed transactions applied as they "
                      "streamed, in the second target session (--streamed-apply early).",
                      applied["streamed_early"])
        yield counter("applier_schema_changes", "Changes made to target tables to follow the "
                      "source's schema (--schema-changes follow).", applied["schema_change"])
        rows = CounterMetricFamily("applier_rows_applied", "Row changes applied, by type "
                                   "(truncate counts statements).", labels=["slot", "type"])
        for kind in ROW_KINDS:
            rows.add_metric([slot, kind], applied[kind])
        yield rows
        conflicts = CounterMetricFamily("applier_conflicts", "Conflicts resolved while applying, "
                                        "by table and type.", labels=["slot", "table", "type"])
        for (table, kind), count in sorted(snap["conflicts"].items()):
            conflicts.add_metric([slot, table, kind], count)
        yield conflicts
        yield counter("applier_received_bytes", "Bytes received on the replication connection.",
                      snap["bytes_received"])
        yield counter("applier_reconnects", "Replication sessions started after the first one.",
                      snap["reconnects"])
        yield gauge("applier_connected", "1 while streaming from the source.", int(snap["connected"]))
        yield gauge("applier_received_lsn", "Highest source WAL position received.",
                    snap["received_lsn"])
        yield gauge("applier_confirmed_lsn", "Source WAL position confirmed to the slot (durable "
                    "on the target).", snap["confirmed_lsn"])
        yield gauge("applier_open_streamed_transactions", "Streamed transactions received and not "
                    "yet committed or aborted.", snap["open_streamed"])
        yield gauge("applier_streamed_memory_bytes", "Memory held by open streamed transactions.",
                    snap["memory_bytes"])
        yield gauge("applier_spilled_bytes", "Bytes of open streamed transactions spilled to disk.",
                    snap["spilled_bytes"])
        probe: Probe | None = snap["probe"]
        good = probe if probe is not None and probe.error is None else None
        lag = good.lag if good is not None else None
        yield gauge("applier_apply_lag_bytes", "Source WAL not yet applied or confirmed.",
                    lag.bytes if lag else None)
        yield gauge("applier_apply_lag_seconds", "Upper bound on how far the replica is behind "
                    "in time (0 when caught up).", lag.seconds if lag else None)
        yield gauge("applier_source_rtt_seconds", "Round-trip time of a small query on the source.",
                    good.source_rtt if good else None)
        yield gauge("applier_target_rtt_seconds", "Round-trip time of a small query on the target.",
                    good.target_rtt if good else None)
        yield gauge("applier_probe_ok", "1 when the last probe reached both servers.",
                    int(good is not None))
        yield counter("applier_verify_holds", "Times the worker held at a verify's (or a repair's) "
                      "source position.", applied["holds"])
        repairs = good.repairs if good is not None else None
        done = CounterMetricFamily("applier_repairs", "Tables repaired, as recorded in "
                                   "applier.repairs: by key (verify --repair) or copied again "
                                   "(resync).", labels=["slot", "kind"])
        written = CounterMetricFamily("applier_repaired_rows", "Rows those repairs wrote (a "
                                      "resync: the rows it copied).", labels=["slot", "kind"])
        if repairs is not None:
            for kind in ("repair", "resync"):
                done.add_metric([slot, kind], repairs.done.get(kind, 0))
                written.add_metric([slot, kind], repairs.rows.get(kind, 0))
        yield done
        yield written
        yield gauge("applier_resyncs_pending", "Tables marked for a resync, or being copied again.",
                    repairs.pending_resyncs if repairs is not None else None)


def _handler(telemetry: Observed, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body = exposition.generate_latest(registry)
                self._reply(200, body, exposition.CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                # Live = the process answers. A worker waiting to reconnect is live too: restarting
                # it would not help, and /readyz says it is not streaming.
                self._reply(200, b"ok\n")
            elif path == "/readyz":
                ready, reason = telemetry.readiness()
                self._reply(200 if ready else 503, f"{reason}\n".encode())
            else:
                self._reply(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return Handler
