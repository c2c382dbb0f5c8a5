"""The replication worker's life: ``applier run`` from start to stop.

A worker consumes one logical replication slot on the source and keeps one target database equal
to the source's published tables, applying every source transaction exactly once and in commit
order. Owns the worker's start (the checks of both servers before anything is created: with
``--create-slot`` ``applier.preflight``'s, else the slot, publications and finished copy;
bookkeeping schema, the single-worker lock, a skip request given
on the command line), its sessions one after another (``session.ReplicationSession``), what
happens between them (the error policy, ``applier.errors``, decides: a new session after a
backoff, one at once, or a stop with advice), and its stop (SIGTERM or SIGINT end it between
messages, exit 0). With the change feed, a background thread drops its old history
(``retention``). How the data path works is in docs/design.md.

Invariants (the tests kill the worker at random points to check them):

1. A source transaction becomes visible on the target whole or not at all, in source commit
   order (several consecutive ones may share one target transaction).
2. The progress row commits in the same target transaction as the data it covers.
3. The flush position told to the slot never passes a commit that is not durable on the target.
4. On start, everything at or below the recorded position is skipped; nothing above it is.
5. When the worker stops on an error, every source transaction before the failing one is
   committed.
6. Memory for open streamed transactions is bounded; beyond it, disk; spill files never outlive
   their transaction or a clean exit.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_never

from .. import __version__
from ..apply.skipping import describe_request
from ..assembler.buffer import default_spill_dir
from ..config import ConfigError, Settings, mask_dsn
from ..connections import connect
from ..errors import ApplierError, ApplyError, Cause, Directive, SourceError, cause_of, decide
from ..exit_codes import ExitCode
from ..headstart import HeadStart
from ..implementation import summary
from ..ops.metrics import Telemetry
from ..preflight import PreflightFailed, check_source, check_start
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.lock import WorkerLock
from ..progress.schema import ensure_schema
from ..progress.store import sync_lsns
from .loop import StopRequested
from .retention import FeedRetention
from .session import ReplicationSession, SessionState

__all__ = ["Worker", "WorkerFailed", "run"]

log = logging.getLogger(__name__)


class WorkerFailed(ApplierError):
    """A permanent failure: the message says what is wrong and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.NEEDS_OPERATOR)


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    directive = decide(exc) if exc is not None else Directive.RETRY
    if directive is Directive.REDO_CAREFUL:
        # Not a failure: a conflict or an unexpected row count in a batch, redone row by row.
        assert isinstance(exc, ApplyError)
        log.info("batch rolled back (%s); applying up to %s row by row", exc, exc.careful_until)
        return
    if directive is Directive.RESTART_NOW:  # not a failure either: a change of course
        log.info("%s", exc)
        return
    wait = state.next_action.sleep if state.next_action else 0
    log.warning("session ended: %s; reconnecting in %.1f s (attempt %d)", exc, wait, state.attempt_number)


class Worker:
    def __init__(self, settings: Settings, head_start: HeadStart | None = None) -> None:
        settings.require("source", "target", "slot", "publication")
        self.settings = settings
        # The stream ``applier run`` started before loading the worker: the first session takes
        # it if it would have started the same one (headstart.py).
        self._head_start = head_start
        self.slot = settings.required("slot")
        self.stop_requested = False
        self.spill_dir = Path(settings.spill_dir or default_spill_dir(self.slot, settings.required("target")))
        self._lock: WorkerLock | None = None
        self._state = SessionState()
        self._failures_without_progress = 0
        self._stopping = threading.Event()
        # Metrics, /healthz, /readyz and the slot/LSN/xid of log lines (applier.ops.metrics).
        self.telemetry = Telemetry.from_settings(settings, self.slot)
        self._warned: set[str] = set()

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        log.info("applier %s, %s: worker for slot %r starting", __version__, summary(), self.slot)
        lock = self._lock = WorkerLock(self.settings.required("target"), self.slot)
        retention: FeedRetention | None = None
        try:
            self.telemetry.start()
            # Before the bookkeeping schema, the slot or an origin is created: a start that
            # cannot succeed must leave nothing behind on either server.
            self._with_retry(self._preflight if self.settings.create_slot else self._check_start)
            self._with_retry(lambda: ensure_schema(self.settings.required("target")))
            self._with_retry(lock.acquire)
            log.info("worker for slot %r started: source %s, target %s", self.slot,
                     mask_dsn(self.settings.required("source")), mask_dsn(self.settings.required("target")))
            if self.settings.skip_lsn is not None:
                self._with_retry(self._request_skip)
            if self.settings.change_feed:
                retention = FeedRetention(self.settings.required("target"), self.slot,
                                          self.settings.change_feed_retention)
                retention.start()
            _tune_gc()
            self._with_retry(self._session)
            return ExitCode.OK
        except StopRequested:
            log.info("stopped on signal")
            return ExitCode.OK
        finally:
            if retention is not None:
                retention.stop()
            if self._head_start is not None:
                self._head_start.close()
            self.telemetry.close()
            self._remove_spill_dir()  # while the lock still keeps the next worker out
            lock.release()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _remove_spill_dir(self) -> None:
        """The per-slot spill directory this worker made goes with it (its files are gone with
        their transactions; a crash leaves them, and the next start removes them). A directory
        given with --spill-dir is the operator's: it stays."""
        if self.settings.spill_dir is None:
            try:
                self.spill_dir.rmdir()
            except OSError:
                pass  # not there, or not empty (another process's files): leave it

    def _preflight(self) -> None:
        settings = self.settings
        problems = check_start(settings.required("source"), settings.required("target"),
                               slot=self.slot, publications=settings.publication,
                               create_tables=bool(settings.create_tables), copy=False,
                               failover_slot=settings.failover_slot,
                               two_phase=bool(settings.two_phase))
        if problems:
            count = len(problems)
            raise WorkerFailed(f"applier run --create-slot cannot start (nothing was created); "
                               f"fix {'this' if count == 1 else f'these {count} problems'} and "
                               f"run it again:\n{PreflightFailed(problems)}")

    def _check_start(self) -> None:
        """Without --create-slot: the slot and the publications exist on the source, and no
        initial copy of the slot is unfinished on the target (``SyncIncomplete``), but for the
        copies of tables added to a publication, which the worker finishes itself."""
        settings = self.settings
        with connect(settings.required("source"), autocommit=True,
                     application_name="applier check") as control:
            problems = check_source(control, slot=self.slot, publications=settings.publication,
                                    create_slot=False)
        if problems:
            raise SourceError("; ".join(problems), cause=Cause.NEEDS_OPERATOR)
        with connect(settings.required("target"), autocommit=True) as conn:
            store = SqlBookkeeping(conn)
            if "table_sync" in store.tables():
                own = {table for table, state in store.publication_tables(self.slot).items()
                       if state == "copying"}
                sync_lsns(self.slot, {table: (state.state, None) for table, state
                                      in store.table_states(self.slot).items() if table not in own})

    def _request_skip(self) -> None:
        lsn = self.settings.skip_lsn
        assert lsn is not None
        try:
            with connect(self.settings.required("target")) as conn:
                previous = SqlBookkeeping(conn).request_skip(self.slot, lsn)
        except ValueError as exc:  # already behind the recorded position: nothing left to skip
            log.warning("--skip-lsn ignored: %s", exc)
            return
        log.warning("%s", describe_request(self.slot, lsn, previous))

    def _warn_once(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            log.warning("%s", text)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.info("received %s: stopping after the current message", signal.Signals(signum).name)
        self.stop_requested = True
        self._stopping.set()  # also ends a backoff sleep at once

    def _backoff(self, state: RetryCallState) -> float:
        """Exponential backoff over consecutive failures without progress; none before a change
        of course (a careful redo, a switch to text values, a transaction to be sent again)."""
        exc = state.outcome.exception() if state.outcome else None
        if exc is not None and decide(exc) in (Directive.RESTART_NOW, Directive.REDO_CAREFUL):
            return 0.0
        if self._state.progressed:
            self._state.progressed = False
            self._failures_without_progress = 0
        self._failures_without_progress += 1
        return min(30.0, 0.5 * 2 ** (self._failures_without_progress - 1))

    def _sleep(self, seconds: float) -> None:
        """The backoff's sleep, cut short by SIGTERM or SIGINT."""
        self._stopping.wait(seconds)

    def _with_retry(self, func: Callable[[], object]) -> None:
        retrying = Retrying(retry=retry_if_exception(lambda exc: decide(exc) is not Directive.STOP),
                            stop=stop_never, wait=self._backoff, reraise=True,
                            before_sleep=_log_retry, sleep=self._sleep)
        for attempt in retrying:
            with attempt:
                if self.stop_requested:
                    raise StopRequested()
                func()

    def _session(self) -> None:
        assert self._lock is not None
        self._lock.ensure()  # a lost lock connection (a target restart) is taken again first
        session = ReplicationSession(self.settings, self._state, self.telemetry, self._head_start,
                                     self._stopping, self._warn_once, self.spill_dir)
        try:
            session.run()
        except (StopRequested, ConfigError):
            raise  # a ConfigError is the command line's to report, with its usage (exit 2)
        except Exception as exc:
            if decide(exc) is Directive.STOP and cause_of(exc) is not None:
                raise WorkerFailed(session.describe(exc)) from exc
            raise


def _tune_gc() -> None:
    """Make the cyclic garbage collector rare on the hot path. Every message, row and batch entry
    is a short-lived container object, so with the default threshold (700 allocations) the
    collector runs every few hundred rows, and its older-generation passes walk everything alive:
    the open batch, the startup's modules. Those passes cost a third of the time of a large
    transaction and find nothing (the hot path makes no reference cycles), so: startup objects
    move to the permanent generation, and a young collection waits for 50,000 allocations (a few
    MB of objects at most)."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def run(settings: Settings, head_start: HeadStart | None = None) -> int:
    """Entry point of ``applier run``: exit status 0 on a clean stop, 1 on a permanent failure."""
    try:
        return Worker(settings, head_start).run()
    except ConfigError:
        raise  # the command line reports it, with its usage (exit 2)
    except Exception as exc:
        if cause_of(exc) is None:
            raise  # not a failure of the servers, the stream or the settings: a bug
        log.error("%s", exc)
        return ExitCode.FAILED
