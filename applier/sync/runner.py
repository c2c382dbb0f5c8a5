"""``applier sync``: copy every published table from a snapshot that matches the slot, then stream.

Owns the order of a sync: check both servers before anything is created (``applier.preflight``:
a permanent problem ends the sync at once, listing every problem, and leaves nothing behind), set
up the bookkeeping schema, read the publications, decide which tables still need a copy (those
not recorded as done for this slot), create missing target tables when asked, mark them 'copying'
and empty them in one target transaction, take the snapshot (creating the worker's slot, or a
temporary slot when the slot already exists), copy, set the target's sequences to the source's
(``applier.lifecycle.sequences``; a sequence that cannot be set is a warning, not a failed sync:
``applier cutover`` sets them again and insists), and hand over to the worker. Transient
failures (a lost connection) restart that sequence after a backoff; finished tables are never
copied again. Must never stream changes itself: the worker does, from the slot's own position,
filtering each synced table's changes by its sync LSN (see ``state.SyncFilter``).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

import psycopg
from sqlalchemy import Engine
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ..config import ConfigError, Settings, mask_dsn
from ..errors import Directive, cause_of, decide
from ..exit_codes import ExitCode
from ..lifecycle.sequences import synchronise_sequences
from ..lifecycle.servers import LifecycleError
from ..preflight import PreflightFailed, check_start
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.lock import WorkerLock
from ..progress.schema import make_engine, upgrade_schema
from ..source.slots import slot_info
from ..worker import run
from .catalog import published_tables
from .copy import CopyStopped
from .snapshot import source_session
from .tables import CopyRound, complete_constraints, copy_round

__all__ = ["Syncer", "run_sync"]

log = logging.getLogger(__name__)

#: Attempts of the whole sequence before a transient failure is reported as an error.
ATTEMPTS = 6


def _transient(exc: BaseException) -> bool:
    # A lost or refused connection may come back; a refused password or a missing database not.
    return decide(exc) is Directive.RETRY


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0
    log.warning("sync attempt failed: %s; retrying in %.1f s (finished tables are kept)", exc, wait)


class Syncer:
    def __init__(self, settings: Settings) -> None:
        settings.require("source", "target", "slot", "publication")
        self.settings = settings
        self.slot = settings.required("slot")
        self.stop_requested = threading.Event()

    def run(self) -> bool:
        """Copy what still needs copying; False when stopped by a signal before the end."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        engine = make_engine(self.settings.required("target"))
        lock = WorkerLock(self.settings.required("target"), self.slot)
        try:
            # Before anything is created: a sync that cannot finish must leave nothing behind.
            self._retrying(self._preflight)
            upgrade_schema(engine)
            lock.acquire()
            log.info("sync for slot %r: source %s, target %s", self.slot,
                     mask_dsn(self.settings.required("source")), mask_dsn(self.settings.required("target")))
            self._retrying(lambda: self._attempt(engine))
            self._sequences()
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

    @staticmethod
    def _retrying(step: Callable[[], None]) -> None:
        """Run ``step``, running it again after a transient failure (up to ``ATTEMPTS`` in all)."""
        retrying = Retrying(retry=retry_if_exception(_transient), stop=stop_after_attempt(ATTEMPTS),
                            wait=wait_exponential(multiplier=1, max=30), reraise=True,
                            before_sleep=_log_retry)
        for attempt in retrying:
            with attempt:
                step()

    def _preflight(self) -> None:
        settings = self.settings
        problems = check_start(settings.required("source"), settings.required("target"),
                               slot=self.slot, publications=settings.publication,
                               create_tables=bool(settings.create_tables), copy=True,
                               failover_slot=settings.failover_slot,
                               two_phase=bool(settings.two_phase))
        if problems:
            raise PreflightFailed(problems)

    def _sequences(self) -> None:
        settings = self.settings
        try:
            report = synchronise_sequences(settings.required("source"), settings.required("target"),
                                           settings.publication, margin=settings.margin)
        except (LifecycleError, psycopg.Error) as exc:
            log.warning("the sequences were not set (%s); the copy is complete: set them with "
                        "applier sequences (applier cutover does too)", " ".join(str(exc).split()))
            return
        log.info("sequences of the published tables set on the target:\n%s", report.render())
        for problem in report.problems:
            log.warning("%s", problem)

    def _attempt(self, engine: Engine) -> None:
        settings = self.settings
        control = source_session(settings.required("source"), "UTF8", "applier sync control")
        try:
            # The preflight checked the publications and the slot's plugin.
            fresh = slot_info(control, self.slot) is None
            tables = published_tables(control, settings.publication)
        finally:
            control.close()
        with engine.connect() as conn:
            states = SqlBookkeeping(conn).table_states(self.slot)
        # A new slot starts a new history: whatever an older slot of this name copied is stale.
        done = set() if fresh else {k for k, s in states.items() if s.state == "done"}
        todo = [t for t in tables if t.key not in done]
        if not todo and not fresh:
            log.info("all %d published tables are already copied for slot %r", len(tables), self.slot)
            if settings.create_tables:
                complete_constraints(settings, tables)
            return
        ours = frozenset(k for k, s in states.items() if s.state == "copying")
        copy_round(settings, engine, CopyRound(self.slot, todo, fresh, ours), self.stop_requested)
        with engine.begin() as conn:
            # The tables the worker then follows: one added to a publication later is copied.
            SqlBookkeeping(conn).set_publication_tables(self.slot, [t.key for t in tables],
                                                        "published")
        log.info("initial copy finished: %d table(s)", len(todo))


def run_sync(settings: Settings) -> int:
    """Entry point of ``applier sync``: copy, then continue as ``applier run``."""
    try:
        if not Syncer(settings).run():
            return ExitCode.OK
    except ConfigError:
        raise  # an option the source cannot honour: the command line reports it (exit 2)
    except PreflightFailed as exc:
        count = len(exc.problems)
        log.error("applier sync cannot start (nothing was created); fix %s and run it again:\n%s",
                  "this" if count == 1 else f"these {count} problems", exc)
        return ExitCode.FAILED
    except Exception as exc:
        if cause_of(exc) is None:
            raise  # not a failure of the servers or the settings: a bug
        # E.g. TRUNCATE of a target table another table's foreign key references.
        log.error("sync failed: %s", " ".join(str(exc).split()))
        return ExitCode.FAILED
    return run(settings)  # the slot exists now (sync made it); create_slot is off for sync
