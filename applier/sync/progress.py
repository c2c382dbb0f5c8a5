"""Progress of the initial copy: per-table rows, bytes and rate, and the overall share with an ETA.

Owns the counters the copy sessions update and their display: a redrawn block (one line per table
being copied and an overall bar) when stderr is a terminal, plain log lines every
``interval`` seconds otherwise. Rows of a COPY still running are read from the target's
``pg_stat_progress_copy``. Must never influence the copy: a display failure is logged and ignored.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field

import psycopg

from ..connections import connect
from ..units import readable_size
from .catalog import PublishedTable

__all__ = ["CopyProgress"]

log = logging.getLogger(__name__)

TableName = tuple[str, str]


@dataclass
class _TableProgress:
    label: str
    estimated_rows: int | None
    rows_done: int = 0                 # rows of finished ranges
    nbytes: int = 0                    # COPY bytes streamed so far
    sessions: set[int] = field(default_factory=set)   # target backend pids copying it now
    started: float | None = None
    finished: float | None = None


class CopyProgress:
    def __init__(self, tables: list[PublishedTable], target_dsn: str, *, interactive: bool,
                 interval: float) -> None:
        self._tables = {t.key: _TableProgress(f"{t.schema}.{t.name}", t.estimated_rows) for t in tables}
        self._target_dsn = target_dsn
        self._interactive = interactive
        self._interval = 0.5 if interactive else interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running_rows: dict[int, int] = {}   # target pid -> tuples of its COPY so far
        self._drawn_lines = 0
        self._start = time.monotonic()

    # -- updates from copy sessions -------------------------------------------------------------
    def range_started(self, table: TableName, pid: int) -> None:
        with self._lock:
            entry = self._tables[table]
            entry.sessions.add(pid)
            if entry.started is None:
                entry.started = time.monotonic()

    def add_bytes(self, table: TableName, nbytes: int) -> None:
        self._tables[table].nbytes += nbytes  # one writer per pid; a lost update only delays display

    def range_finished(self, table: TableName, pid: int, rows: int) -> None:
        with self._lock:
            entry = self._tables[table]
            entry.sessions.discard(pid)
            entry.rows_done += rows
            self._running_rows.pop(pid, None)

    def table_finished(self, table: TableName) -> tuple[int, int, float]:
        """Rows, bytes and seconds of a finished table."""
        with self._lock:
            entry = self._tables[table]
            entry.finished = time.monotonic()
            return entry.rows_done, entry.nbytes, entry.finished - (entry.started or entry.finished)

    # -- display --------------------------------------------------------------------------------
    def __enter__(self) -> CopyProgress:
        self._thread = threading.Thread(target=self._report_loop, name="sync-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _report_loop(self) -> None:
        conn: psycopg.Connection | None = None
        try:
            conn = connect(self._target_dsn, autocommit=True, application_name="applier sync progress")
            while not self._stop.wait(self._interval):
                self._poll(conn)
                self._show()
            self._show(final=True)
        except (psycopg.Error, OSError) as exc:
            log.warning("progress display stopped: %s", exc)
        finally:
            if conn is not None:
                conn.close()

    def _poll(self, conn: psycopg.Connection) -> None:
        with self._lock:
            pids = [pid for entry in self._tables.values() for pid in entry.sessions]
        rows = conn.execute("SELECT pid, tuples_processed FROM pg_catalog.pg_stat_progress_copy "
                            "WHERE pid = ANY(%s)", (pids,)).fetchall() if pids else []
        with self._lock:
            self._running_rows = {pid: int(count) for pid, count in rows if pid in pids}

    def _snapshot(self) -> tuple[list[tuple[str, int, int, float]], int, int | None, int]:
        """(active tables as (label, rows, bytes, seconds), rows copied, rows expected, bytes)."""
        now = time.monotonic()
        active, total_rows, total_bytes = [], 0, 0
        expected: int | None = 0
        with self._lock:
            for entry in self._tables.values():
                rows = entry.rows_done + sum(self._running_rows.get(pid, 0) for pid in entry.sessions)
                total_rows += rows
                total_bytes += entry.nbytes
                if entry.estimated_rows is None:
                    expected = None
                elif expected is not None:
                    # A finished table counts as it is; an estimate may be low or stale.
                    expected += rows if entry.finished else max(entry.estimated_rows, rows)
                if entry.started is not None and entry.finished is None:
                    active.append((entry.label, rows, entry.nbytes, now - entry.started))
        return active, total_rows, expected, total_bytes

    def _show(self, final: bool = False) -> None:
        active, rows, expected, nbytes = self._snapshot()
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = rows / elapsed
        share = f"{100 * rows / expected:5.1f}%" if expected else "  ?  %"
        eta = (_duration((expected - rows) / rate) if expected and rate > 0 and not final else "-")
        overall = (f"{rows:,} of ~{expected:,} rows" if expected is not None else f"{rows:,} rows")
        overall += f", {readable_size(nbytes)}, {rate:,.0f} rows/s"
        if self._interactive:
            width = 30
            filled = int(width * min(rows / expected, 1.0)) if expected else 0
            lines = [f"  {label[:40]:40} {r:>12,} rows {readable_size(b):>9} {r / max(s, 1e-9):>10,.0f} rows/s"
                     for label, r, b, s in active]
            lines.append(f"[{'#' * filled}{'.' * (width - filled)}] {share} {overall}, ETA {eta}")
            up = f"\x1b[{self._drawn_lines}F" if self._drawn_lines else ""
            sys.stderr.write(up + "\x1b[J" + "\n".join(lines) + "\n")
            sys.stderr.flush()
            self._drawn_lines = len(lines)
        elif not final:
            copying = "; ".join(f"{label} {r:,} rows {readable_size(b)}" for label, r, b, _ in active[:5])
            log.info("copy progress: %s %s, ETA %s%s", share.strip(), overall, eta,
                     f"; copying {copying}" if copying else "")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02}:{seconds % 60:02}"
