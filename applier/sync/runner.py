"""``applier sync``: copy every published table from a snapshot that matches the slot, then stream.

Owns the order of a sync: read the publications, decide which tables still need a copy (those not
recorded as done for this slot), check or create their target tables, mark them 'copying' and
empty them in one target transaction, take the snapshot (creating the worker's slot, or a
temporary slot when the slot already exists), copy, and hand over to the worker. Transient
failures restart that sequence after a backoff; finished tables are never copied again. Must never
stream changes itself: the worker does, from the slot's own position, filtering each synced
table's changes by its sync LSN (see ``state.SyncFilter``).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

import psycopg
from sqlalchemy import Engine
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ..config import Settings, mask_dsn
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.lock import AlreadyRunning, WorkerLock
from ..progress.schema import SchemaError, make_engine, upgrade_schema
from ..source import SourceError
from ..source.slots import publications_missing, slot_info
from ..worker import run
from .catalog import CatalogError, PublishedTable, published_tables
from .copy import CopyFailed, CopyStopped, copy_tables, plan_tasks
from .progress import CopyProgress
from .relay import accelerated
from .snapshot import ExportedSnapshot, source_session, temporary_slot_name
from .target import TargetCheckError, is_empty, prepare_targets, target_session

__all__ = ["Syncer", "run_sync"]

log = logging.getLogger(__name__)

#: Attempts of the whole sequence before a transient failure is reported as an error.
ATTEMPTS = 6


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, CopyFailed):
        return exc.transient
    if isinstance(exc, SourceError):
        return not exc.permanent
    return isinstance(exc, psycopg.OperationalError)


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0
    log.warning("sync attempt failed: %s; retrying in %.1f s (finished tables are kept)", exc, wait)


class Syncer:
    def __init__(self, settings: Settings) -> None:
        settings.require("source", "target", "slot", "publication")
        self.settings = settings
        self.slot: str = settings.slot
        self.stop_requested = threading.Event()

    def run(self) -> bool:
        """Copy what still needs copying; False when stopped by a signal before the end."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        engine = make_engine(self.settings.target)
        lock = WorkerLock(self.settings.target, self.slot)
        try:
            upgrade_schema(engine)
            lock.acquire()
            log.info("sync for slot %r: source %s, target %s", self.slot,
                     mask_dsn(self.settings.source), mask_dsn(self.settings.target))
            retrying = Retrying(retry=retry_if_exception(_transient), stop=stop_after_attempt(ATTEMPTS),
                                wait=wait_exponential(multiplier=1, max=30), reraise=True,
                                before_sleep=_log_retry)
            for attempt in retrying:
                with attempt:
                    self._attempt(engine)
            return True
        except CopyStopped:
            log.info("sync stopped on signal; finished tables are kept, the next sync redoes the rest")
            return False
        finally:
            lock.release()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.info("received %s: stopping the copy", signal.Signals(signum).name)
        self.stop_requested.set()

    def _attempt(self, engine: Engine) -> None:
        settings = self.settings
        target = target_session(settings.target, "applier sync")
        encoding = target.info.parameter_status("server_encoding") or "UTF8"
        control = source_session(settings.source, encoding, "applier sync control")
        try:
            missing = publications_missing(control, settings.publication)
            if missing:
                raise SourceError(f"source: publication(s) {', '.join(map(repr, missing))} do not "
                                  "exist in the source database", permanent=True)
            info = slot_info(control, self.slot)
            if info is not None and info.plugin != "pgoutput":
                raise SourceError(f"source: slot {self.slot!r} uses plugin {info.plugin!r}; applier "
                                  "needs a pgoutput slot", permanent=True)
            fresh = info is None
            tables = published_tables(control, settings.publication)
            with engine.connect() as conn:
                states = SqlBookkeeping(conn).table_states(self.slot)
            # A new slot starts a new history: whatever an older slot of this name copied is stale.
            done = set() if fresh else {k for k, s in states.items() if s.state == "done"}
            todo = [t for t in tables if t.key not in done]
            if not todo and not fresh:
                log.info("all %d published tables are already copied for slot %r", len(tables), self.slot)
                return
            plans = prepare_targets(control, target, engine, todo, create_tables=settings.create_tables)
            self._check_empty(target, todo, {k for k, s in states.items() if s.state == "copying"})
            with target.transaction():
                SqlBookkeeping(target).start_copies(self.slot, [t.key for t in todo],
                                                    forget_position=fresh)
                if todo:
                    target.execute("TRUNCATE " + ", ".join(t.sql_name for t in todo))
            block_size = int(control.execute("SELECT pg_catalog.current_setting('block_size')")
                             .fetchone()[0])  # type: ignore[index]
            snapshot = ExportedSnapshot.create(
                settings.source, self.slot if fresh else temporary_slot_name(self.slot),
                temporary=not fresh, two_phase=bool(settings.two_phase) and fresh)
            try:
                tasks = plan_tasks(plans, settings.range_size, block_size)
                log.info("copying %d table(s) in %d piece(s) with %d job(s) from snapshot %s "
                         "(consistent point %s), relaying in %s", len(todo), len(tasks), settings.jobs,
                         snapshot.name, snapshot.consistent_point,
                         "C" if accelerated(control) else "Python")
                with CopyProgress(todo, settings.target, interactive=sys.stderr.isatty(),
                                  interval=settings.progress_interval) as progress:
                    copy_tables(settings.source, settings.target, self.slot, snapshot, tasks,
                                settings.jobs, progress, encoding, self.stop_requested)
            finally:
                snapshot.close()
            log.info("initial copy finished: %d table(s)", len(todo))
        finally:
            control.close()
            target.close()

    def _check_empty(self, target: psycopg.Connection, todo: list[PublishedTable],
                     ours: set[tuple[str, str]]) -> None:
        """Refuse non-empty target tables unless --truncate-target; a table holding our own
        unfinished copy is emptied without asking."""
        if self.settings.truncate_target:
            return
        full = [t.sql_name for t in todo if t.key not in ours and not is_empty(target, t)]
        if full:
            raise TargetCheckError(f"target table(s) {', '.join(full)} are not empty; the copy "
                                   "would mix with their rows. Empty them, or pass "
                                   "--truncate-target to have applier sync truncate them")


def run_sync(settings: Settings) -> int:
    """Entry point of ``applier sync``: copy, then continue as ``applier run``."""
    try:
        if not Syncer(settings).run():
            return 0
    except (CatalogError, TargetCheckError, CopyFailed, SourceError, AlreadyRunning,
            SchemaError) as exc:
        log.error("%s", exc)
        return 1
    except psycopg.Error as exc:
        # E.g. TRUNCATE of a target table another table's foreign key references.
        log.error("sync failed: %s", str(exc).strip())
        return 1
    # The slot exists now (sync made it); ``run`` must never create one on its own.
    settings.values.setdefault("create_slot", False)
    return run(settings)
