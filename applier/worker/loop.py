"""The stream loop of one replication session: read, route, commit at pauses, confirm.

Owns when the fast path's batch commits because the stream paused, when commits made with
``synchronous_commit = off`` are confirmed to the slot (only once the target reports its WAL
flushed past them: ``progress.flush.FlushTracker``, invariant 3) and when they are made durable
at once because the stream went quiet, confirming the keepalive's WAL end when nothing is open,
and ``--exit-when-caught-up``. Must never apply or decode anything: the ingest gate and the apply
stage do.

Rows are made visible before they are made durable, as PostgreSQL's own subscriber does: a batch
committed at a pause commits with ``synchronous_commit = off`` like any other, so its rows are
visible as soon as COMMIT returns instead of after the target's WAL flush (a few milliseconds on
a quiet disk, seconds behind a checkpoint's). The slot hears of it once the target's WAL writer
has flushed it or, when the stream stays quiet for ``DURABLE_AFTER_QUIET``, once one durable
rewrite of the progress row has.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from ..apply.dispatch import Applier
from ..assembler import Assembler
from ..errors import ApplyError, Directive, decide
from ..ingest.gate import IngestGate
from ..progress.flush import FlushTracker
from ..protocol.lsn import LSN
from ..source import ReplicationStream
from ..source.slots import slot_info
from ..units import readable_size
from .redo import RedoLog

__all__ = ["CaughtUp", "ProgressLog", "StopRequested", "StreamLoop"]

log = logging.getLogger(__name__)

#: How long one read waits for the rest of a source transaction received in part (and so a batch
#: that cannot commit yet) before the loop looks at its timers again.
MID_TRANSACTION_WAIT = 0.05
#: How long the stream must stay quiet after commits made with synchronous_commit off before they
#: are made durable at once, rather than left to the target's WAL writer (up to three
#: wal_writer_delay). Shorter pauses are the gaps between source transactions under load: a WAL
#: flush waited for there would hold back the transactions that follow.
DURABLE_AFTER_QUIET = 0.02
#: A redo's ``careful_until``: every transaction that begins while a stretch is fed again, and
#: for CAREFUL_AFTER_REDO seconds after it.
_EVERYTHING = LSN(2**64 - 1)
#: Conflicts seldom come alone (rows the target has of its own, each one's first update an
#: update_origin_differs), and each one the fast path meets costs a batch rolled back and fed
#: again: after a redo, transactions go row by row for this long before batching is tried again.
#: (Without it, 3,000 transactions each meeting such a row took 105 redos here.)
CAREFUL_AFTER_REDO = 1.0


class StopRequested(Exception):
    """SIGTERM or SIGINT: the session ends between messages."""


@dataclass
class CaughtUp:
    """The source's WAL position when the worker started: --exit-when-caught-up's goal."""

    goal: LSN


class StreamLoop:
    def __init__(self, stream: ReplicationStream, assembler: Assembler, applier: Applier,
                 gate: IngestGate, control: psycopg.Connection, slot: str,
                 flushed_wal_lsn: Callable[[], LSN], caught_up: CaughtUp | None,
                 stop_requested: Callable[[], bool], progress_interval: float = 10.0,
                 check_publications: Callable[[], None] | None = None,
                 requests: Callable[[], None] | None = None,
                 early_open: Callable[[], bool] = lambda: False) -> None:
        self.stream = stream
        self.assembler = assembler
        self.applier = applier
        self.gate = gate
        self.control = control
        self.slot = slot
        self.flushed_wal_lsn = flushed_wal_lsn
        self.caught_up = caught_up
        self.stop_requested = stop_requested
        #: synchronous_commit = off: commits not known to be on the target's disk yet.
        self.unflushed = FlushTracker()
        # The last of those that a durable rewrite of the progress row could not flush (no row to
        # rewrite: removed by hand?): they are left to the WAL writer, as before every pause.
        self._rewrite_failed_for: LSN | None = None
        self.progress = ProgressLog(applier.counts, progress_interval)
        self.check_publications = check_publications
        #: Between source transactions: the requests of applier resync and verify (``requests``).
        self.requests = requests
        #: A streamed transaction is open in the early session (its changes are not in the log).
        self.early_open = early_open
        #: What a batch rolled back would need fed again: at most what one batch may hold.
        self.redo = RedoLog(applier.fast.limits.bytes if applier.fast is not None else 0)
        #: After a redo: until when transactions go row by row, and the careful_until after it.
        self._careful_for: tuple[float, LSN] | None = None

    def committed(self, end_lsn: LSN, target_lsn: LSN | None) -> None:
        """A target commit covering source ``end_lsn`` (the apply stage's ``on_commit``)."""
        confirm = self.unflushed.committed(end_lsn, target_lsn)
        if confirm is not None:
            self.stream.confirm(confirm)

    def run(self) -> None:
        """Until stopped (``StopRequested``) or, with a goal, caught up. A batch rolled back to
        be redone row by row is redone here when the redo log holds all of it."""
        redo: ApplyError | None = None
        while True:
            try:
                if redo is not None:
                    self._redo(redo)
                self._stream()
                return
            except ApplyError as exc:
                if not self._may_redo_here(exc):
                    raise
                redo = exc

    def _may_redo_here(self, exc: ApplyError) -> bool:
        return (exc.careful_until is not None and decide(exc) is Directive.REDO_CAREFUL
                and self.redo.complete and not self.early_open())

    def _redo(self, exc: ApplyError) -> None:
        """Everything since the last clean point again, with the apply stage and the assembler
        back at that point: what committed since is skipped as already applied, and every
        transaction that begins in it goes row by row, not only those up to
        ``exc.careful_until``: a stretch redone must end committed, so that the next redo (the
        next conflict) never feeds it again."""
        applier = self.applier
        assert exc.careful_until is not None
        applier.abort_open_transaction()
        # self.careful_until, not the applier's: within CAREFUL_AFTER_REDO that one is _EVERYTHING.
        careful_until = LSN(max(self.careful_until, exc.careful_until))
        self.assembler.close()
        batches = self.redo.batches()
        log.info("batch rolled back (%s); applying the %d payload(s) received since nothing was "
                 "left uncommitted (recorded position %s) row by row", exc,
                 sum(map(len, batches)), applier.tx.applied.end_lsn)
        applier.careful_until, applier.redoing = _EVERYTHING, True
        self._careful_for = (time.monotonic() + CAREFUL_AFTER_REDO, careful_until)
        try:
            for payloads in batches:
                self.gate.feed(payloads)
        finally:
            applier.redoing = False

    @property
    def careful_until(self) -> LSN:
        """Up to where the stretches redone in this session reach (what a next session must
        still apply row by row), whether or not the time after a redo has passed."""
        return self._careful_for[1] if self._careful_for is not None else self.applier.careful_until

    def _batch_again(self) -> None:
        """CAREFUL_AFTER_REDO has passed since the last redo: transactions that begin from now
        on may take the batched routes again."""
        assert self._careful_for is not None
        if time.monotonic() >= self._careful_for[0]:
            self.applier.careful_until = self._careful_for[1]
            self._careful_for = None

    def _stream(self) -> None:
        stream, assembler, applier, unflushed = self.stream, self.assembler, self.applier, self.unflushed
        last_flush_check = 0.0
        last_received = time.monotonic()
        redo = self.redo
        while not self.stop_requested():
            if not applier.holds_uncommitted and assembler.idle:
                redo.clean()
            if self._careful_for is not None:
                self._batch_again()
            # With the fast path's batch open between source transactions, take only what has
            # arrived, or what arrives while the batch may still wait for more (--batch-wait);
            # the moment the stream pauses after that, commit it. Inside a source transaction,
            # wait for the rest of it: nothing can commit before it ends. Make commits still
            # waiting for the target's WAL flush durable once nothing is open and the stream has
            # been quiet for DURABLE_AFTER_QUIET. Waiting for the WAL flush otherwise (a streamed
            # transaction open) or (to exit when caught up) for a keepalive past the goal, look
            # again soon: a keepalive asked for may still show the position before the goal. Past
            # the goal already (a start with nothing to do), wait for nothing before checking the
            # slot.
            caught_up = self.caught_up
            past_goal = caught_up is not None and stream.flush_lsn >= caught_up.goal
            waiting = bool(unflushed) or (caught_up is not None and not past_goal)
            latest = unflushed.latest
            flush_at_pause = (latest is not None and assembler.idle
                              and latest.source_end != self._rewrite_failed_for)
            quiet_left = DURABLE_AFTER_QUIET - (time.monotonic() - last_received)
            if applier.holds_uncommitted:
                timeout = applier.wait_left() if assembler.between_transactions else MID_TRANSACTION_WAIT
            else:
                timeout = (0 if past_goal else max(0.0, quiet_left) if flush_at_pause
                           else 0.05 if waiting else 0.5)
            batch = stream.read_batch(timeout=timeout)
            if batch:
                last_received = time.monotonic()
                redo.record(batch)
            self.gate.feed(batch)
            self.progress.maybe_log(stream)
            # A streamed transaction may stay open on the source for as long as it likes: what
            # committed meanwhile is committed here the moment the stream pauses all the same.
            if (not batch and applier.holds_uncommitted and assembler.between_transactions
                    and applier.wait_left() == 0):
                applier.flush()
            elif (not batch and flush_at_pause and not applier.holds_uncommitted
                  and time.monotonic() - last_received >= DURABLE_AFTER_QUIET):
                # The stream went quiet after commits made with synchronous_commit off: make
                # them durable and confirm them now, instead of polling until the target's WAL
                # writer has flushed them (up to three wal_writer_delay).
                assert latest is not None
                if applier.tx.make_durable():
                    confirmed = unflushed.all_durable()
                    if confirmed is not None:
                        stream.confirm(confirmed)
                        # The stream is quiet: tell the slot now rather than at the next status
                        # update (a second later at most), as PostgreSQL's subscriber does.
                        stream.send_status()
                else:
                    self._rewrite_failed_for = latest.source_end
            if unflushed and time.monotonic() - last_flush_check >= 0.1 and assembler.between_transactions:
                confirmed = unflushed.flushed(self.flushed_wal_lsn())
                if confirmed is not None:
                    stream.confirm(confirmed)
                last_flush_check = time.monotonic()
            if self.requests is not None and assembler.between_transactions:
                self.requests()  # every so often: a table to copy again, a position to hold at
            if not assembler.idle:
                continue
            if self.check_publications is not None and not applier.holds_uncommitted:
                self.check_publications()  # every so often: may end the session, to copy a table
            if not applier.holds_uncommitted and not unflushed:
                # Nothing open, buffered or unflushed: everything the server sent is applied and
                # durable, so the position it last reported having sent is safe to confirm too.
                if stream.keepalive_wal_end > stream.flush_lsn:
                    stream.confirm(stream.keepalive_wal_end)
                    stream.send_status_if_due()
                elif caught_up is not None and stream.flush_lsn < caught_up.goal:
                    # Ask for a keepalive: its WAL end tells us when nothing more is coming.
                    stream.send_status(reply_requested=True)
            # Caught up needs no pause in the stream (a busy source may never pause): only that
            # the confirmed position passed the goal and the slot has it.
            if (caught_up is not None and stream.flush_lsn >= caught_up.goal
                    and self._slot_confirmed(caught_up)):
                log.info("caught up: the slot confirmed %s", stream.flush_lsn)
                return
        raise StopRequested()

    def confirm_durable(self) -> None:
        """The session ends: make every commit that returned durable and confirm it (the slot
        then holds nothing the target has; without the target, what it reports flushed)."""
        if not self.unflushed:
            return
        if self.applier.tx.make_durable():
            confirmed = self.unflushed.all_durable()
        else:
            confirmed = self.unflushed.flushed(self.flushed_wal_lsn())
        if confirmed is not None:
            self.stream.confirm(confirmed)

    def _slot_confirmed(self, caught_up: CaughtUp) -> bool:
        """Report the confirmed position and wait (briefly) until the slot shows the goal."""
        stream = self.stream
        stream.send_status()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            info = slot_info(self.control, self.slot)
            if info and info.confirmed_flush_lsn is not None and info.confirmed_flush_lsn >= caught_up.goal:
                return True
            time.sleep(0.05)
            stream.send_status()
        return False


class ProgressLog:
    """A log line every ``interval`` seconds while work is done: what was applied meanwhile, and
    how far the slot's confirmed position is behind what the source last said it had written."""

    def __init__(self, counts: Counter[str], interval: float) -> None:
        self.counts = counts
        self.interval = interval
        self._last = Counter(counts)
        self._at = time.monotonic()

    def maybe_log(self, stream: ReplicationStream) -> None:
        now = time.monotonic()
        if now - self._at < self.interval:
            return
        done = self.counts - self._last
        if done["transactions"] or done["streamed_early"]:
            behind = max(0, int(stream.keepalive_wal_end) - int(stream.flush_lsn))
            rows = ", ".join(f"{done[kind]} {kind}" for kind in ("insert", "update", "delete", "truncate")
                             if done[kind])
            log.info("applied %d transaction(s) in the last %.0f s (%s); confirmed %s, %s of source "
                     "WAL after it", done["transactions"], now - self._at, rows or "no rows",
                     stream.flush_lsn, readable_size(behind))
            self._last = Counter(self.counts)
        self._at = now

