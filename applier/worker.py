"""The replication worker: ``applier run``.

How the whole thing works
=========================

A worker consumes one logical replication slot on the source and keeps one target database
equal to the source's published tables, applying every source transaction exactly once and in
commit order. Data flows one way through five stages, each in its own package:

    source (CopyBoth stream) -> protocol (decode) -> assembler (transactions) -> apply -> progress

* ``source`` opens a ``replication=database`` connection with the session settings that make
  every text value round-trip exactly (ISO dates, ``postgres`` intervals, ``extra_float_digits=3``,
  the target's encoding) and runs START_REPLICATION from the position recorded on the target,
  asking for binary values while every table has the same built-in types on both sides
  (``--binary auto``: the first relation that has not turns the session to text, see Failures).
  A small C reader takes the XLogData payloads straight from libpq. It answers keepalives and
  sends a standby status update at least every ``status_interval``. ``applier run`` starts that
  stream before it loads the rest of the worker (``headstart.py``, psycopg alone), so the source
  decodes a backlog while we import, and a thread receives what it sends meanwhile into libpq's
  buffer (a quarter of the memory budget at most); the first session takes it only if it is the
  very stream it would have started after all its checks.
* ``protocol`` turns each XLogData payload into an immutable message. It is stateless; the worker
  tells it whether it is inside a streamed block, where data messages carry an xid.
* ``assembler`` checks that the messages form possible sequences and turns them into
  transactions. Plain transactions are handed on as they arrive (the server sends them whole, at
  commit). Streamed transactions (large ones the server sends while they are still running) are
  held per xid as raw bytes (row changes are not even decoded until replayed), within a memory
  budget shared by all of them and spilled to local files beyond it; a subtransaction abort cuts
  exactly that subtransaction and the ones started after it; at Stream Commit the transaction
  is replayed in order. One streamed transaction at a time is instead applied as it streams
  (``apply/streaming.py``, PostgreSQL's parallel apply in spirit): in a second target session,
  with a savepoint where each subtransaction begins, committed with its progress row at its
  Stream Commit after everything committed before it. The two sessions take turns writing (and
  holding the replication origin). Its row changes are not buffered, so when that session must
  give up after taking some (a logical message, a conflict, a Stream Prepare, a lock wait past
  its lock_timeout, which the main session also has while that transaction is open, so that
  neither can hang the single-threaded worker), the replication session restarts: the source
  sends the transaction again, and it is buffered and applied at its commit.
* ``apply`` maps each source relation to the target table of the same schema-qualified name and
  its columns by name, and executes cached, prepared statements whose parameters are the bytes
  received, in the format they arrived in, cast by the target column's type. The target session
  runs as a replica (``session_replication_role = replica``) with an empty ``search_path``.
  On the fast path (``apply/batch.py``) consecutive plain source transactions share one target
  transaction: their row changes are folded (repeated updates of a row become one), gathered per
  table and sent as multi-row statements or COPY, in parts that go ahead of the commit without
  waiting for their outcome, each statement checked for the exact number of rows it must
  change. Anything unexpected rolls the batch back and the stretch is redone on the careful,
  row-by-row path, where conflicts are detected and resolved one by one.
  The lane (``apply/lane.py``, its core in C) shortens this path for the commonest changes: it
  takes plain transactions of inserts, of updates of whole rows by key and of deletes by key,
  and those changes of any transaction on the fast path (a replayed streamed one too), straight
  from the received payloads into the batch (inserts as COPY text, or COPY binary for binary
  values, which are already in the format COPY binary carries; updates and deletes folded by
  key), building no message object. It stops at anything else, which then takes the way above from where it stopped; a
  transaction it began and cannot finish is handed to the assembler at its Begin, so a batch
  never ends inside a source transaction.
* ``progress``: the last statement of every target transaction records the commit LSN, end LSN
  and commit time of the last source transaction it holds, for this slot, in that same
  transaction.

Invariants (the tests kill the worker at random points to check them)
--------------------------------------------------------------------
1. A source transaction becomes visible on the target whole or not at all, in source commit
   order: it lies within one target transaction (on the fast path, with the source transactions
   that committed just before and after it).
2. The progress row commits in the same target transaction as the data it covers.
3. The flush position told to the slot never passes a commit that is not durable on the target:
   it advances after COMMIT returned and, with ``synchronous_commit = off`` (the default), only
   once the target reports its WAL flushed past that commit's position. (When the stream pauses
   with nothing open, the worker does not wait for the target's WAL writer: it rewrites the
   progress row in a transaction committed with synchronous_commit on, which flushes the WAL
   through every earlier commit.)
   When no transaction is open or buffered, the position the server last said it had sent
   (keepalive WAL end) is confirmed too, so a slot of idle or filtered tables holds no WAL back.
4. On start, everything at or below the recorded position is skipped; nothing above it is. The
   server starts at max(requested, slot's confirmed position); transactions it redelivers that
   were applied but not yet confirmed are recognised by their commit LSN and skipped whole.
5. Memory for open transactions is bounded; beyond it, disk; spill files never outlive their
   transaction (and are removed at start: the server resends unconfirmed transactions).

Beyond rows (``apply/`` modules, one each)
------------------------------------------
* Two-phase (``twophase``): a prepared source transaction is held durably on the target before
  its prepare is confirmed: PREPAREd under our own GID (mode ``prepare``) or stored in the applier
  schema until COMMIT PREPARED (mode ``defer``), each with its position in the same target
  transaction or right after it, and recognised after a crash so it is never applied twice. So
  invariant 3 holds for prepares as for commits, and confirming the keepalive WAL end when idle
  stays safe.
* Origins (``origins``): the apply session is tagged with a replication origin so replications
  out of the target can ignore our writes; per-origin positions; ``--skip-origin``.
* Logical messages (``messages``), conflicts (``conflicts``) and skip requests (``skipping``):
  all written in the target transaction of the source transaction they belong to.

Failures
--------
A lost connection on either side ends the current session: the open target transactions (if
any, in either target session) are rolled back, buffered streamed transactions are dropped, and
after a backoff (tenacity) a new session starts from the recorded position. So does a lock wait
past its lock_timeout while a transaction is applied as it streams, and, at once, a relation
whose binary values would not mean the same on the target (the new session asks for text values,
for the rest of the process; a prepared transaction deferred to COMMIT PREPARED is checked
before it is stored, since the source never sends its content again). Errors that waiting cannot
fix (slot or publication missing, authentication, a missing target table or column, malformed
protocol bytes) stop the worker with a message that names the object, the source LSN and xid
where known, and what to do (including the ``applier skip`` command that skips that one
transaction); nothing of the failing transaction or any later one is applied, and the next
start resumes there.

Stopping
--------
SIGTERM or SIGINT ends the worker between messages: an open target transaction is rolled back
(the source will resend it), a final status update confirms what is durable, and it exits 0.
With ``--exit-when-caught-up`` it exits 0 once every transaction the source had committed when
the worker started is applied on the target and the slot has confirmed it.
"""

from __future__ import annotations

import gc
import logging
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psycopg
from sqlalchemy import Engine
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_never

from .apply.extensions import Extensions, setup_extensions
from .apply.lane import Lane
from .apply.relations import Reflector
from .apply.session import TargetError, TargetSession
from .apply.sink import ApplyError, BatchLimits, TargetApplier, TextValuesNeeded
from .apply.streaming import StreamingApply
from .apply.skipping import request_skip
from .assembler import Assembler, ProtocolSequenceError
from .config import ConfigError, Settings, mask_dsn
from .headstart import HeadStart
from .ops.metrics import Telemetry
from .progress.position import AppliedPosition, read_position
from .progress.store import AlreadyRunning, SchemaError, WorkerLock, make_engine, upgrade_schema
from .protocol import LSN, DecodeError, decode
from .source import ReplicationStream, SourceError, StreamOptions, UnsupportedOption, options_for
from .source.stream import classify, is_permanent
from .source.slots import create_slot, publications_missing, slot_info
from .sync.state import SyncFilter, SyncIncomplete, table_sync_lsns

__all__ = ["Worker", "WorkerFailed", "default_spill_dir", "run"]

log = logging.getLogger(__name__)


class WorkerFailed(Exception):
    """A permanent failure: the message says what is wrong and what to do."""


class _StopRequested(Exception):
    pass


@dataclass
class _CaughtUp:
    """The source's WAL position when the worker started: --exit-when-caught-up's goal."""

    goal: LSN


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, SourceError):
        return not exc.permanent
    if isinstance(exc, (TargetError, ApplyError)):
        return exc.transient
    return isinstance(exc, psycopg.OperationalError) and not is_permanent(exc)


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    if isinstance(exc, ApplyError) and exc.careful_until is not None:
        # Not a failure: a conflict or an unexpected row count in a batch, redone row by row.
        log.info("batch rolled back (%s); applying up to %s row by row", exc, exc.careful_until)
        return
    if isinstance(exc, TextValuesNeeded):  # not a failure either: a one-time switch
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
        self.slot: str = settings.slot
        self.stop_requested = False
        self.caught_up: _CaughtUp | None = None
        self.spill_dir = Path(settings.spill_dir or default_spill_dir(self.slot))
        self._engine: Engine | None = None
        # Everything up to this source commit LSN goes through the careful, row-by-row path: the
        # fast path met a conflict or error there and handed the stretch back.
        self.careful_until = LSN(0)
        # synchronous_commit = off: (target WAL position, source end LSN) of commits that are not
        # known to be on the target's disk yet, oldest first.
        self._unflushed: deque[tuple[LSN, LSN]] = deque()
        # The last of those that a durable rewrite of the progress row could not flush (no row to
        # rewrite: removed by hand?): they are left to the WAL writer, as before every pause.
        self._rewrite_failed_for: LSN | None = None
        self._failures_without_progress = 0
        self._progressed = False
        self._stopping = threading.Event()
        # Metrics, /healthz, /readyz and the slot/LSN/xid of log lines (applier.ops.metrics).
        self.telemetry = Telemetry.from_settings(settings, self.slot)
        self._warned: set[str] = set()
        # Streamed xids whose early apply was open when a session ended: applied at their commit.
        self._refused_early: set[int] = set()
        # --binary auto met a relation whose binary values would not mean the same on the
        # target: text values from then on.
        self._text_values = False

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        lock = WorkerLock(self.settings.target, self.slot)
        try:
            self.telemetry.start()
            self._engine = make_engine(self.settings.target)
            self._with_retry(lambda: upgrade_schema(self._engine))
            self._with_retry(lock.acquire)
            log.info("worker for slot %r started: source %s, target %s", self.slot,
                     mask_dsn(self.settings.source), mask_dsn(self.settings.target))
            if self.settings.skip_lsn is not None:
                self._with_retry(self._request_skip)
            _tune_gc()
            self._with_retry(self._session)
            return 0
        except _StopRequested:
            log.info("stopped on signal")
            return 0
        finally:
            if self._head_start is not None:
                self._head_start.close()
            self.telemetry.close()
            lock.release()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _request_skip(self) -> None:
        assert self._engine is not None
        try:
            log.warning("%s", request_skip(self._engine, self.slot, self.settings.skip_lsn))
        except ValueError as exc:  # already behind the recorded position: nothing left to skip
            log.warning("--skip-lsn ignored: %s", exc)

    def _warn_once(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            log.warning("%s", text)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.info("received %s: stopping after the current message", signal.Signals(signum).name)
        self.stop_requested = True
        self._stopping.set()  # also ends a backoff sleep at once

    def _backoff(self, state: RetryCallState) -> float:
        """Exponential backoff over consecutive failures without progress; none before a careful
        redo or a switch to text values (``ApplyError.restart_at_once``: not a failure of the
        connection)."""
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, ApplyError) and exc.restart_at_once:
            return 0.0
        if self._progressed:
            self._progressed = False
            self._failures_without_progress = 0
        self._failures_without_progress += 1
        return min(30.0, 0.5 * 2 ** (self._failures_without_progress - 1))

    def _with_retry(self, func) -> None:  # noqa: ANN001 - a no-argument callable
        retrying = Retrying(retry=retry_if_exception(_transient), stop=stop_never,
                            wait=self._backoff, reraise=True, before_sleep=_log_retry,
                            sleep=self._stopping.wait)
        for attempt in retrying:
            with attempt:
                if self.stop_requested:
                    raise _StopRequested()
                func()

    # -- one connected session ------------------------------------------------------------------
    def _session(self) -> None:
        settings = self.settings
        assert self._engine is not None
        engine = self._engine
        target = self._target_session()
        self._unflushed.clear()
        try:
            control = psycopg.connect(settings.source, autocommit=True, application_name="applier control")
        except psycopg.Error as exc:
            target.close()
            raise classify(exc) from exc
        stream: ReplicationStream | None = None
        assembler: Assembler | None = None
        applier: TargetApplier | None = None
        early: StreamingApply | None = None
        reflector = Reflector(engine)
        try:
            applied = read_position(target.conn, self.slot) or AppliedPosition(LSN(0), LSN(0))
            slot_two_phase = self._check_source(control)
            try:
                options = options_for(settings, control.info.server_version, slot_two_phase,
                                      text_values=self._text_values)
            except UnsupportedOption as exc:
                raise ConfigError(str(exc)) from None
            # auto: binary values until a relation is found not binary-safe (checked per relation).
            auto_binary = settings.binary == "auto" and options.binary
            stream, early_position = self._open_stream(options, applied.end_lsn, target.server_encoding)
            started_early = early_position is not None
            if self.caught_up is None and settings.exit_when_caught_up:
                self.caught_up = _CaughtUp(early_position if early_position is not None
                                           else stream.identify_system()[2])
                log.info("will exit once caught up with source position %s", self.caught_up.goal)

            def on_commit(end_lsn: LSN, target_lsn: LSN | None) -> None:
                self._progressed = True
                if target_lsn is None:
                    # Durable now, and so is every earlier commit: the WAL is flushed in order.
                    stream.confirm(end_lsn)
                    self._unflushed.clear()
                else:
                    self._unflushed.append((target_lsn, end_lsn))

            limits = BatchLimits(settings.batch_rows,
                                 min(settings.batch_bytes, settings.memory_budget // 2),
                                 settings.batch_time / 1000)
            # Tables copied by applier sync: their changes from before each copy's LSN are in it.
            sync_filter = SyncFilter(table_sync_lsns(engine, self.slot))
            applier = TargetApplier(target, reflector, self.slot, applied, on_commit,
                                    limits=limits, careful_until=self.careful_until,
                                    track_target_lsn=settings.synchronous_commit == "off",
                                    sync_filter=sync_filter, binary_check=auto_binary,
                                    extensions=self._extensions(target, options))
            if settings.streamed_apply == "early" and options.streaming != "off":
                early = StreamingApply(applier, lambda: self._target_session("streamed"),
                                       reflector, self._refused_early)
            assembler = Assembler(applier, memory_budget=settings.memory_budget, spill_dir=self.spill_dir,
                                  heartbeat=stream.send_status_if_due, early=early)
            self.telemetry.attach(stream, assembler, applier)
            log.info("streaming from %s (recorded commit %s) with %s%s", applied.end_lsn,
                     applied.commit_lsn, options.sql(),
                     ", started while the worker loaded" if started_early else "")
            if not started_early:
                stream.start(applied.end_lsn)
            self._stream_loop(stream, assembler, applier, early, control)
        except (ApplyError, DecodeError, ProtocolSequenceError, SourceError, TargetError) as exc:
            if isinstance(exc, ApplyError) and exc.careful_until is not None:
                self.careful_until = max(self.careful_until, exc.careful_until)
            if isinstance(exc, TextValuesNeeded):
                self._text_values = True
            if _transient(exc):
                raise
            raise WorkerFailed(self._describe_failure(exc, stream)) from exc
        finally:
            # Each step on its own: a failure in one (a dead connection) must not keep the next
            # from running, above all closing the replication connection, whose walsender
            # otherwise holds the slot.
            self.telemetry.detach()
            steps = [target.close, control.close, reflector.close]
            if applier is not None:
                steps.insert(0, lambda: log.info("%s", _summary(applier)))
            if stream is not None:
                steps[:0] = [stream.send_status, stream.close]
            if assembler is not None:
                steps.insert(0, assembler.close)
            if applier is not None:
                steps.insert(0, applier.abort_open_transaction)
            if early is not None:
                steps.insert(0, early.close)
            for step in steps:
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - the session is ending; its cause is reported
                    log.debug("cleanup step %s failed: %s", step.__qualname__, exc)

    def _open_stream(self, options: StreamOptions, start_lsn: LSN, encoding: str
                     ) -> tuple[ReplicationStream, LSN | None]:
        """The stream started while the worker loaded, if it is the one this session would start,
        with the source's WAL position noted then; else a new connection, not started yet."""
        if self._head_start is not None:
            stream = self._head_start.take(options, start_lsn, encoding)
            if stream is not None:
                return stream, self._head_start.source_position
        stream = ReplicationStream(self.settings.source, self.slot, options,
                                   status_interval=self.settings.status_interval, client_encoding=encoding)
        stream.connect()
        return stream, None

    def _target_session(self, role: str | None = None) -> TargetSession:
        name = f"applier {self.slot}" + (f" ({role})" if role else "")
        return TargetSession(self.settings.target, application_name=name,
                             synchronous_commit=self.settings.synchronous_commit)

    def _extensions(self, target: TargetSession, options: StreamOptions) -> Extensions:
        settings = self.settings
        try:
            return setup_extensions(
                target, self.slot, two_phase=options.two_phase,
                two_phase_mode=settings.two_phase_mode,
                replication_origin=settings.replication_origin,
                skip_origins=settings.skip_origin,
                message_sink=settings.message_sink,
                message_prefixes=settings.message_prefix,
                conflict_policy=settings.conflict_policy, warn=self._warn_once)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _describe_failure(self, exc: Exception, stream: ReplicationStream | None) -> str:
        where = f"slot {self.slot!r}"
        if stream is not None:
            where += f", last received source LSN {stream.received_lsn}"
        text = f"{exc} ({where})"
        if isinstance(exc, ApplyError) and exc.commit_lsn is not None:
            text += (f". If this source transaction must not be applied, skip it: applier skip "
                     f"--target <target DSN> --slot {self.slot} --lsn {exc.commit_lsn} (or start "
                     f"the worker with --skip-lsn {exc.commit_lsn})")
        return text

    def _check_source(self, control: psycopg.Connection) -> bool:
        """Slot and publications exist (creating the slot when asked); returns the slot's two_phase."""
        settings = self.settings
        info = slot_info(control, self.slot)
        if info is None:
            if not settings.create_slot:
                raise SourceError(f"source: replication slot {self.slot!r} does not exist; create it "
                                  "with --create-slot (or applier sync)", permanent=True)
            info = create_slot(control, self.slot, two_phase=bool(settings.two_phase))
            log.info("created slot %r at %s", self.slot, info.confirmed_flush_lsn)
        elif info.plugin != "pgoutput":
            raise SourceError(f"source: slot {self.slot!r} uses plugin {info.plugin!r}; applier "
                              "needs a pgoutput slot", permanent=True)
        missing = publications_missing(control, settings.publication)
        if missing:
            raise SourceError(f"source: publication(s) {', '.join(map(repr, missing))} do not exist "
                              "in the source database; create them (CREATE PUBLICATION) or fix "
                              "--publication", permanent=True)
        return info.two_phase

    def _stream_loop(self, stream: ReplicationStream, assembler: Assembler, applier: TargetApplier,
                     early: StreamingApply | None, control: psycopg.Connection) -> None:
        lane = applier.lane

        def hand_back(begin: bytes) -> None:
            assembler.feed(decode(begin), begin)

        last_flush_check = 0.0
        while not self.stop_requested:
            # While the fast path holds uncommitted work, only take what has already arrived;
            # the moment the stream pauses, commit it; likewise make commits still waiting for
            # the target's WAL flush durable at once when nothing is open. Waiting for the WAL
            # flush otherwise (a streamed transaction open) or (to exit when caught up) for a
            # keepalive past the goal, look again soon: a keepalive asked for may still show the
            # position before the goal. Past the goal already (a start with nothing to do), wait
            # for nothing before checking the slot.
            past_goal = self.caught_up is not None and stream.flush_lsn >= self.caught_up.goal
            waiting = self._unflushed or (self.caught_up is not None and not past_goal)
            flush_at_pause = (self._unflushed and assembler.idle
                              and self._unflushed[-1][1] != self._rewrite_failed_for)
            pause_settles = applier.holds_uncommitted or flush_at_pause
            batch = stream.read_batch(timeout=0 if pause_settles or past_goal
                                      else 0.05 if waiting else 0.5)
            _feed(batch, assembler, lane, hand_back)
            # A streamed transaction may stay open on the source for as long as it likes: what
            # committed meanwhile is committed here the moment the stream pauses all the same.
            if not batch and applier.holds_uncommitted and assembler.between_transactions:
                applier.flush(durable=True)
            elif not batch and flush_at_pause:
                # The stream paused after commits made with synchronous_commit off (a batch full
                # before the pause): make them durable and confirm them now, instead of polling
                # until the target's WAL writer has flushed them (up to three wal_writer_delay).
                if applier.session.flush_wal(self.slot):
                    stream.confirm(self._unflushed[-1][1])
                    self._unflushed.clear()
                else:
                    self._rewrite_failed_for = self._unflushed[-1][1]
            if self._unflushed and time.monotonic() - last_flush_check >= 0.1 and assembler.between_transactions:
                self._confirm_flushed(stream, early.flushed_wal_lsn if early is not None
                                      else applier.session.flushed_wal_lsn)
                last_flush_check = time.monotonic()
            if not assembler.idle:
                continue
            if not applier.holds_uncommitted and not self._unflushed:
                # Nothing open, buffered or unflushed: everything the server sent is applied and
                # durable, so the position it last reported having sent is safe to confirm too.
                if stream.keepalive_wal_end > stream.flush_lsn:
                    stream.confirm(stream.keepalive_wal_end)
                elif self.caught_up is not None and stream.flush_lsn < self.caught_up.goal:
                    # Ask for a keepalive: its WAL end tells us when nothing more is coming.
                    stream.send_status(reply_requested=True)
            # Caught up needs no pause in the stream (a busy source may never pause): only that
            # the confirmed position passed the goal and the slot has it.
            if (self.caught_up is not None and stream.flush_lsn >= self.caught_up.goal
                    and self._slot_confirmed(stream, control)):
                log.info("caught up: the slot confirmed %s", stream.flush_lsn)
                return
        raise _StopRequested()

    def _confirm_flushed(self, stream: ReplicationStream, flushed_wal_lsn: Callable[[], str]) -> None:
        """synchronous_commit = off: confirm the source positions whose target commits are on disk."""
        flushed = LSN.parse(flushed_wal_lsn())
        while self._unflushed and self._unflushed[0][0] <= flushed:
            stream.confirm(self._unflushed.popleft()[1])

    def _slot_confirmed(self, stream: ReplicationStream, control: psycopg.Connection) -> bool:
        """Report the confirmed position and wait (briefly) until the slot shows the goal."""
        assert self.caught_up is not None
        stream.send_status()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            info = slot_info(control, self.slot)
            if info and info.confirmed_flush_lsn is not None and info.confirmed_flush_lsn >= self.caught_up.goal:
                return True
            time.sleep(0.05)
            stream.send_status()
        return False


#: First bytes of the payloads the lane may take: Begin, Insert, Update and Delete.
_LANE_KINDS = (ord("B"), ord("I"), ord("U"), ord("D"))
#: First bytes of the row changes a stream block's buffer takes undecoded.
_ROW_CHANGES = (ord("I"), ord("U"), ord("D"))


def _feed(payloads: list[bytes], assembler: Assembler, lane: Lane | None,
          hand_back: Callable[[bytes], None]) -> None:
    """Every payload, in order: row changes inside a stream block straight to their buffer (they
    are decoded when replayed), plain transactions to the lane where it takes them (``hand_back``
    gives the assembler one the lane began and did not finish), the rest decoded to the
    assembler."""
    index, count = 0, len(payloads)
    while index < count:
        payload = payloads[index]
        kind = payload[0]
        if assembler.in_stream:
            if kind in _ROW_CHANGES:
                taken = assembler.buffer_changes(payloads, index)
                if taken > index:
                    index = taken
                    continue
        elif lane is not None and kind in _LANE_KINDS:
            between = assembler.between_transactions
            if between or assembler.in_plain:
                taken = lane.take(payloads, index, hand_back=hand_back if between else None)
                if taken > index:
                    index = taken
                    continue
        assembler.feed(decode(payload, assembler.in_stream), payload)
        index += 1


def _tune_gc() -> None:
    """Make the cyclic garbage collector rare on the hot path. Every message, row and batch entry
    is a short-lived container object, so with the default threshold (700 allocations) the
    collector runs every few hundred rows, and its older-generation passes walk everything alive:
    the open batch, the startup's modules (SQLAlchemy, alembic). Those passes cost a third of the
    time of a large transaction and find nothing (the hot path makes no reference cycles), so:
    startup objects move to the permanent generation, and a young collection waits for 50,000
    allocations (a few MB of objects at most)."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def default_spill_dir(slot: str) -> Path:
    """Where a slot's streamed transactions spill when --spill-dir is not given."""
    return Path(tempfile.gettempdir()) / f"applier-spill-{_safe(slot)}"


def _summary(applier: TargetApplier) -> str:
    counts = applier.applied_counts
    text = (f"this session applied {counts['transactions']} transaction(s): "
            + ", ".join(f"{counts[kind]} {kind}" for kind in ("insert", "update", "delete", "truncate")))
    if counts["streamed_early"]:
        text += f"; {counts['streamed_early']} streamed transaction(s) applied as they streamed"
    if counts["skipped_origin"]:
        text += f"; dropped {counts['skipped_origin']} transaction(s) from skipped origins"
    if applier.conflicts:
        text += "; conflicts: " + ", ".join(f"{kind} on {table} x{n}"
                                            for (table, kind), n in sorted(applier.conflicts.items()))
    return text


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def run(settings: Settings, head_start: HeadStart | None = None) -> int:
    """Entry point of ``applier run``: exit status 0 on a clean stop, 1 on a permanent failure."""
    try:
        return Worker(settings, head_start).run()
    except (WorkerFailed, AlreadyRunning, SchemaError, SourceError, TargetError, SyncIncomplete,
            psycopg.OperationalError) as exc:
        log.error("%s", exc)
        return 1
