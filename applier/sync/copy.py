"""Parallel COPY of the published tables from one exported snapshot.

Owns cutting tables into work items (a whole table, or block ranges of a large plain table), the
``--jobs`` sessions that run them (each a source session that imported the snapshot and a target
session), and marking a table done once all its ranges are committed. Every range commits on its
own, so a table is only ever done or redone whole: a crash between ranges leaves it 'copying', and
the next sync truncates and recopies it from a new snapshot (ranges from two snapshots must never
meet in one table). A table copied whole gets its indexes built after its data, in the same
transaction (``indexes``). Must never choose the snapshot or check target tables.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from ..errors import ApplierError, Cause, cause_of
from ..progress.bookkeeping import SqlBookkeeping
from ..quoting import ident
from .indexes import drop_indexes, rebuild_indexes
from .progress import CopyProgress
from .relay import relay
from .snapshot import ExportedSnapshot, source_session
from .target import TargetPlan, build_secondary_indexes, target_session

__all__ = ["CopyFailed", "CopyStopped", "CopyTask", "plan_tasks", "source_copy_sql", "copy_tables"]

log = logging.getLogger(__name__)


class CopyFailed(ApplierError):
    """Copying one table failed (the cause says whether a new attempt can succeed)."""

    def __init__(self, message: str, *, cause: Cause) -> None:
        super().__init__(message, cause=cause)


class CopyStopped(Exception):
    """The copy was stopped on request; finished tables stay finished."""


@dataclass(frozen=True)
class CopyTask:
    plan: TargetPlan
    first_block: int | None   # None: from the start
    end_block: int | None     # None: to the end (the last range is open, so rows in blocks added
                              # after the size was measured are still copied)


def plan_tasks(plans: list[TargetPlan], range_size: int, block_size: int) -> list[CopyTask]:
    """Whole tables, and plain tables over ``range_size`` cut into block ranges; largest first so
    the long ones start early and the small ones fill the gaps."""
    tasks = []
    step = max(1, range_size // block_size)
    for plan in sorted(plans, key=lambda p: p.table.size_bytes, reverse=True):
        blocks = -(-plan.table.size_bytes // block_size)
        if plan.table.relkind != "r" or blocks <= step:
            tasks.append(CopyTask(plan, None, None))
            continue
        starts = list(range(0, blocks, step))
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else None
            tasks.append(CopyTask(plan, start or None, end))
    return tasks


def source_copy_sql(task: CopyTask) -> str:
    """COPY ... TO STDOUT of exactly the rows and columns the stream publishes, for one range."""
    table = task.plan.table
    columns = ", ".join(ident(c) for c in table.columns)
    conditions = [f"({table.row_filter})"] if table.row_filter else []
    if task.first_block is not None:
        conditions.append(f"ctid >= '({task.first_block},0)'::pg_catalog.tid")
    if task.end_block is not None:
        conditions.append(f"ctid < '({task.end_block},0)'::pg_catalog.tid")
    options = " (FORMAT binary)" if task.plan.binary else ""
    if not conditions and table.relkind == "r":
        return f"COPY {table.sql_name} ({columns}) TO STDOUT{options}"
    # ONLY: an inheritance child is published (and copied) as a table of its own; a partitioned
    # table published via its root is read through the root, partitions included.
    only = "ONLY " if table.relkind == "r" else ""
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    return f"COPY (SELECT {columns} FROM {only}{table.sql_name}{where}) TO STDOUT{options}"


def target_copy_sql(plan: TargetPlan) -> str:
    columns = ", ".join(ident(c) for c in plan.table.columns)
    options = " (FORMAT binary)" if plan.binary else ""
    return f"COPY {plan.table.sql_name} ({columns}) FROM STDIN{options}"


class _Copier:
    def __init__(self, source_dsn: str, target_dsn: str, slot: str, snapshot: ExportedSnapshot,
                 tasks: list[CopyTask], progress: CopyProgress, client_encoding: str) -> None:
        self.source_dsn = source_dsn
        self.target_dsn = target_dsn
        self.slot = slot
        self.snapshot = snapshot
        self.progress = progress
        self.client_encoding = client_encoding
        self.queue: queue.SimpleQueue[CopyTask] = queue.SimpleQueue()
        self.remaining: dict[tuple[str, str], int] = {}
        for task in tasks:
            self.queue.put(task)
            key = task.plan.table.key
            self.remaining[key] = self.remaining.get(key, 0) + 1
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.sources: list[psycopg.Connection] = []

    def run_session(self, number: int) -> None:
        source = target = None
        try:
            source = source_session(self.source_dsn, self.client_encoding, f"applier sync {number}")
            with self.lock:
                self.sources.append(source)
            self.snapshot.begin(source)
            target = target_session(self.target_dsn, f"applier sync {number}")
            while not self.stop.is_set():
                try:
                    task = self.queue.get_nowait()
                except queue.Empty:
                    return
                self._copy(task, source, target)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
            with self.lock:
                if not self.stop.is_set():
                    self.errors.append(exc)
                self.stop.set()
            self.cancel_all()
        finally:
            for conn in (source, target):
                if conn is not None:
                    conn.close()

    def cancel_all(self) -> None:
        with self.lock:
            sources = list(self.sources)
        for conn in sources:
            if not conn.closed:
                try:
                    conn.cancel_safe(timeout=5)
                except psycopg.Error:
                    pass  # it is ending anyway

    def _copy(self, task: CopyTask, source: psycopg.Connection, target: psycopg.Connection) -> None:
        key = task.plan.table.key
        pid = target.info.backend_pid
        self.progress.range_started(key, pid)
        whole = task.first_block is None and task.end_block is None
        try:
            with target.transaction():
                SqlBookkeeping(target).record_copy_transaction(self.slot)
                # Ranges of one table commit apart, so only a table copied whole in this one
                # transaction can have its indexes built after its data.
                rebuilt = drop_indexes(target, task.plan.table) if whole else []
                with source.cursor() as reader, reader.copy(source_copy_sql(task)) as out, \
                        target.cursor().copy(target_copy_sql(task.plan)) as into:
                    rows = relay(out, into, lambda nbytes: self.progress.add_bytes(key, nbytes))
                rebuild_indexes(target, rebuilt)
            if rebuilt:
                log.debug("built %d index(es) of %s after its data", len(rebuilt), task.plan.table.sql_name)
        except psycopg.Error as exc:
            raise CopyFailed(f"copying {task.plan.table.sql_name} failed: {str(exc).strip()}",
                             cause=cause_of(exc) or Cause.REFUSED_DATA) from exc
        self.progress.range_finished(key, pid, rows)
        with self.lock:
            self.remaining[key] -= 1
            last = self.remaining[key] == 0
        if last:
            self._finish_table(task.plan, target)

    def _finish_table(self, plan: TargetPlan, target: psycopg.Connection) -> None:
        if plan.definition is not None:
            build_secondary_indexes(target, plan)
        rows, nbytes, seconds = self.progress.table_finished(plan.table.key)
        with target.transaction():
            bookkeeping = SqlBookkeeping(target)
            bookkeeping.mark_done(self.slot, plan.table.key, self.snapshot.consistent_point, rows, nbytes)
            if not self.snapshot.temporary:  # the worker's slot: it starts at this point
                bookkeeping.record_copied_position(self.slot, self.snapshot.consistent_point)
        log.info("copied %s: %d rows, %d bytes (%s COPY) in %.1f s (%.0f rows/s); sync LSN %s",
                 plan.table.sql_name, rows, nbytes, "binary" if plan.binary else "text", seconds,
                 rows / max(seconds, 1e-9), self.snapshot.consistent_point)


def copy_tables(source_dsn: str, target_dsn: str, slot: str, snapshot: ExportedSnapshot,
                tasks: list[CopyTask], jobs: int, progress: CopyProgress, client_encoding: str,
                stop_requested: threading.Event, tick: Callable[[], None] | None = None) -> None:
    """Run ``tasks`` on ``jobs`` sessions, marking each table done (with the snapshot's consistent
    point as its sync LSN) once all its ranges are in. The first failure stops the other sessions
    (their open COPYs are cancelled) and is raised; tables finished before it stay done.
    ``tick`` is called about five times a second meanwhile.
    """
    copier = _Copier(source_dsn, target_dsn, slot, snapshot, tasks, progress, client_encoding)
    threads = [threading.Thread(target=copier.run_session, args=(n,), name=f"sync-{n}", daemon=True)
               for n in range(1, min(jobs, len(tasks)) + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.2)
            if tick is not None:
                tick()
            if stop_requested.is_set() and not copier.stop.is_set():
                copier.stop.set()
                copier.cancel_all()
    if copier.errors:
        raise copier.errors[0]
    if stop_requested.is_set():
        raise CopyStopped()
