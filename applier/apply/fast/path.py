"""The fast path: several source transactions in one target transaction, their rows sent in bulk.

Owns the batch (``batch.Batch``) of the open target transaction, the parts of it sent ahead of
the commit and not yet read back (the pipeline in flight), when the batch commits (a limit of
``BatchLimits`` reached, or the worker asks because the stream paused), the commit itself (BEGIN,
the rows and the progress row naming the last source transaction in the batch in one round trip,
COMMIT in a second), and the room it gives the lane (``lane.Lane``). Every batched statement must change an
exact number of rows; any other outcome, or an error, rolls the batch back and asks for the
stretch to be redone on the careful path (``Cause.FAST_PATH_MISMATCH``). Must never decide which
transactions take it (``dispatch.Applier`` does).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...assembler import TransactionEnd
from ...errors import ApplyError, Cause, Directive, TargetError, decide_in_batch
from ...progress.records import Position
from ...protocol.lsn import LSN
from ...protocol.messages import TupleData
from ..copy import sized_copy_sql
from ..feed.meta import Meta
from ..mapping import RelationMapping
from ..transaction import TargetTransaction
from .batch import Batch, KeyRun, Run
from .pipeline import Pipeline, PipelineError, RowCountMismatch

__all__ = ["BatchLimits", "FastPath", "INSERT_PART_ROWS", "LaneRoom", "PART_ROWS"]

log = logging.getLogger(__name__)

#: Rows of a batch are sent ahead of its commit in parts: the target applies one part while the
#: next is decoded, and the commit waits for the last part only. A part is due at this many
#: updated or deleted rows: small enough that the last part is a short wait, and that a multi-row
#: UPDATE or DELETE joins its rows to the table by its key index.
PART_ROWS = 2000
#: ... or at as many inserted rows; but when the lane takes the changes of one open transaction (a
#: large one, or a streamed one), at this many, which go as one COPY. On PostgreSQL 18 here,
#: loading 1,000,000 rows in one transaction took the target 3.4-3.6 s of CPU as 500 COPYs of 2,000
#: rows, 2.5 s as COPYs of 5,000 and 2.1-2.5 s as COPYs of 10,000 to 50,000 rows. Between whole
#: transactions (many small ones) parts of 10,000 made the drain slower: the worker then read the
#: source in longer bursts, and the walsender spent more CPU.
INSERT_PART_ROWS = 10_000
#: The first batch of a session commits after at most this long (later ones after
#: ``BatchLimits.seconds``): a worker started on a backlog shows its first rows on the target at
#: once instead of after a whole batch, for the cost of one more commit.
FIRST_BATCH_SECONDS = 0.05


@dataclass(frozen=True)
class BatchLimits:
    """When the fast path commits: whichever limit is reached first, and when the stream pauses
    with the batch at least ``wait`` seconds old. Rows and bytes also bound memory inside one
    large source transaction."""

    rows: int
    bytes: int
    seconds: float
    wait: float = 0.0


@dataclass(frozen=True, slots=True)
class LaneRoom:
    """How far the lane may take payloads now."""

    after: LSN             # take only transactions committing after this LSN
    part_rows: int         # updated or deleted rows until a part is due
    insert_part_rows: int  # inserted rows until a part is due
    rows: int              # rows until the batch is full
    bytes: int             # bytes until the batch is full


class FastPath:
    def __init__(self, tx: TargetTransaction, limits: BatchLimits,
                 guard: Callable[[str], str] | None = None) -> None:
        self.tx = tx
        self.limits = limits
        # Fast-path updates carry the same origin guard as careful ones (``guard(xmin)``: the
        # SQL test that this worker wrote the row last), so a row another origin wrote shows up
        # as a row-count difference and goes to the careful path's detection.
        self.batch = Batch(guard)
        self.open = False                 # a target transaction holds fast-path work
        self.last: TransactionEnd | None = None  # the last source transaction in the batch
        self._started = 0.0
        self._seconds = min(limits.seconds, FIRST_BATCH_SECONDS)  # the open batch's time limit
        self._prepared: dict[tuple, bytes] = {}
        self._in_flight: Pipeline | None = None  # rows sent, results not read yet (settle)
        self._sent_rows = 0               # rows of the open target transaction sent ahead
        self._names = itertools.count(1)  # never reused: dropped shapes stay prepared

    # -- recording --------------------------------------------------------------------------------
    def begin(self) -> None:
        """A source transaction joins the batch: the batch's target transaction opens if needed."""
        if not self.open:
            self.tx.begin()
            self.open = True
            self._started = time.monotonic()

    def insert(self, mapping: RelationMapping, new: TupleData, meta: Meta | None = None) -> None:
        self.batch.insert(mapping, new, meta)
        self._bound()

    def update(self, mapping: RelationMapping, new: TupleData, old: TupleData | None,
               meta: Meta | None = None, moved: tuple[tuple[int, ...], Meta] | None = None) -> None:
        self.batch.update(mapping, new, old, meta, moved)
        self._bound()

    def delete(self, mapping: RelationMapping, old: TupleData, meta: Meta | None = None) -> None:
        self.batch.delete(mapping, old, meta)
        self._bound()

    def statement(self, sql: str) -> None:
        """A statement that runs in order with the rows around it (TRUNCATE, SAVEPOINT)."""
        self.batch.statement(sql)

    def add_commit(self, slot: str, commit_lsn: LSN, end_lsn: LSN) -> None:
        """A source transaction of the batch wrote change rows: its applier.change_commits row."""
        self.batch.add_commit(slot, commit_lsn, end_lsn)

    def ended(self, txn: TransactionEnd) -> None:
        """A source transaction of the batch committed: commit the batch if a limit is reached."""
        self.last = txn
        limits = self.limits
        if (self._sent_rows + self.batch.rows >= limits.rows or self.batch.bytes >= limits.bytes
                or time.monotonic() - self._started >= self._seconds):
            self.commit()

    def forget(self, relation_id: int) -> None:
        """A relation's description changed (rows queued under the old one were sent first):
        drop the statements and runs built from it."""
        self._prepared = {k: v for k, v in self._prepared.items() if k[0][1] != relation_id}
        self.batch.forget(relation_id)

    def _bound(self) -> None:
        limits = self.limits
        batch = self.batch
        if (batch.rows - batch.inserts >= PART_ROWS or batch.inserts >= PART_ROWS
                or batch.rows >= limits.rows or batch.bytes >= limits.bytes):
            self.send_part()

    # -- sending and committing -------------------------------------------------------------------
    def commit(self) -> None:
        """Commit the batch's target transaction: BEGIN (if nothing was sent ahead), its rows and
        the progress row naming the last source transaction in it in one pipeline round trip,
        then (every row count being as expected) COMMIT in a second. With synchronous_commit off
        the rows are visible as soon as COMMIT returns, and the worker confirms the batch's
        position once the target's WAL is flushed past it (``worker.loop``)."""
        if not self.open:
            return
        tx = self.tx
        last = self.last
        position = None if last is None else Position(last.commit_lsn, last.end_lsn, last.commit_time)
        target_lsn: list[LSN] = []
        try:
            self.settle()
            with tx.session.pipeline() as pipeline:
                self._emit(pipeline)
                if position is not None:
                    tx.store.record_position(position, via=pipeline)
                # Row counts are checked before COMMIT is even sent: a mismatch must roll back.
                pipeline.sync()
                tx.send_commit(pipeline, target_lsn)
                pipeline.sync()
        except (RowCountMismatch, PipelineError) as exc:
            raise self._failed(exc, last) from exc
        finally:
            self._reset()
        self._seconds = self.limits.seconds
        tx.committed(position, target_lsn[0] if target_lsn else None)

    def send_part(self) -> None:
        """Send the rows recorded so far without committing (bounds memory in large transactions).

        Their results are not waited for: the target works through them while the next rows
        are decoded and recorded, and ``settle`` reads them before the session is used again
        (the next send, the commit, or any other statement: the session calls it)."""
        if not self.batch:
            return
        self.settle()
        self._sent_rows += self.batch.rows
        pipeline = self.tx.session.pipeline().open()
        try:
            self._emit(pipeline)
            pipeline.send_sync()
        except (RowCountMismatch, PipelineError) as exc:
            pipeline.abandon()
            raise self._failed(exc, self.last) from exc
        finally:
            self.batch.clear()
        self._in_flight = pipeline
        self.tx.session.pending = self.settle

    def settle(self) -> None:
        """Read the outcome of the rows sent ahead; a failure or a row count other than expected
        sends the stretch to the careful path, like a failure at commit."""
        pipeline = self._in_flight
        if pipeline is None:
            return
        self._in_flight = None
        self.tx.session.pending = None
        try:
            pipeline.finish()
        except (RowCountMismatch, PipelineError) as exc:
            raise self._failed(exc, self.last) from exc

    def _emit(self, pipeline: Pipeline) -> None:
        feed = self.tx.feed
        spool = feed.spool if feed is not None else None
        hold = feed is not None and feed.holds_back()
        for statement in self.batch.statements(change_rows_copy=hold):
            if spool is not None:
                if hold and statement.change_rows is not None and statement.copy_data is not None:
                    assert statement.expected_rows is not None
                    spool.add(statement.change_rows.change_table, statement.sql, statement.copy_data,
                              statement.expected_rows, statement.change_rows.binary)
                    continue
                if statement.savepoint is not None:
                    spool.mark(statement.savepoint)
            if statement.copy_data is not None:
                log.debug("%s: %d rows", statement.sql, statement.expected_rows)
                pipeline.copy(sized_copy_sql(statement.sql, statement.expected_rows), statement.copy_data,
                              statement.expected_rows)
                continue
            if statement.cache_key is None:
                pipeline.send(statement.sql, expected_rows=statement.expected_rows)
                continue
            name = self._prepared.get(statement.cache_key)
            if name is None:
                name = self._prepared[statement.cache_key] = f"applier_b{next(self._names)}".encode()
                pipeline.prepare(name, statement.sql)
            pipeline.send_prepared(name, statement.sql, statement.values, statement.formats,
                                   statement.expected_rows)

    def _failed(self, exc: RowCountMismatch | PipelineError, last: TransactionEnd | None) -> ApplyError:
        """Roll back and ask for the stretch to be redone carefully, row by row; a lost
        connection (or a lock wait that timed out) instead ends the session."""
        tx = self.tx
        retry = decide_in_batch(exc) is not Directive.REDO_CAREFUL
        # Statements the failed pipeline was to prepare after the failure never were: every shape
        # is prepared again, under new names.
        self._prepared.clear()
        try:
            tx.rollback()
        except TargetError as lost:  # the connection is gone: whatever happened is rolled back
            return ApplyError(f"{exc} ({lost})", cause=Cause.LOST_CONNECTION)
        if retry:
            assert isinstance(exc, PipelineError)  # a row count that differs is redone
            return ApplyError(str(exc), cause=exc.cause, sqlstate=exc.sqlstate)
        current = tx.current
        until = LSN(max(last.commit_lsn if last else 0, current.commit_lsn if current else 0))
        log.info("fast apply met %s; redoing up to %s row by row", exc, until)
        return ApplyError(f"fast path: {exc}", cause=Cause.FAST_PATH_MISMATCH, careful_until=until)

    def abandon(self) -> None:
        """Drop the batch and whatever is in flight (the caller rolls the transaction back)."""
        if self._in_flight is not None:
            self._in_flight.abandon()
            self._in_flight = None
            self.tx.session.pending = None
        self._reset()

    def _reset(self) -> None:
        self.batch.clear()
        self.open = False
        self.last = None
        self._sent_rows = 0

    # -- savepoints (a transaction applied as it streams, streaming.py) -------------------------------
    def savepoint(self, name: str) -> None:
        """A savepoint (``name`` quoted) in the open target transaction, in order with the
        changes around it: it is sent with them, and no change is folded across it."""
        self.batch.statement(f"SAVEPOINT {name}", savepoint=name)

    def rollback_to_savepoint(self, name: str) -> None:
        """Undo every change since the savepoint ``name`` (quoted), the change rows the feed's
        spool holds included."""
        self.send_part()  # the savepoint itself may still be in the batch
        self.tx.sql(f"ROLLBACK TO SAVEPOINT {name}")
        if self.tx.feed is not None and self.tx.feed.spool is not None:
            self.tx.feed.spool.rollback_to(name)

    def send_copy(self, sql: str, data: bytes, rows: int) -> None:
        """Send one COPY (the change rows the feed's spool held, at the commit) after what the
        batch holds, its outcome read as a part's (``send_part``)."""
        self.send_part()
        self.settle()
        pipeline = self.tx.session.pipeline().open()
        try:
            pipeline.copy(sized_copy_sql(sql, rows), data, rows)
            pipeline.send_sync()
        except (RowCountMismatch, PipelineError) as exc:
            pipeline.abandon()
            raise self._failed(exc, self.last) from exc
        self._in_flight = pipeline
        self.tx.session.pending = self.settle

    # -- the lane ------------------------------------------------------------------------------------
    def room(self, whole: bool, after: LSN) -> LaneRoom | None:
        """The lane's room: ``whole`` transactions need the batch's target transaction open;
        changes of the open transaction take larger insert parts (one COPY each)."""
        if whole and not self.open:
            return None
        limits, batch = self.limits, self.batch
        insert_part_rows = PART_ROWS if whole else INSERT_PART_ROWS
        return LaneRoom(after, min(PART_ROWS, limits.rows) - (batch.rows - batch.inserts),
                        min(insert_part_rows, limits.rows) - batch.inserts,
                        limits.rows - self._sent_rows - batch.rows, limits.bytes - batch.bytes)

    def open_run(self, mapping: RelationMapping, run: Run | KeyRun, kind: str) -> None:
        self.batch.open_run(mapping, run, kind)

    def took(self, inserts: int, updates: int, deletes: int, value_bytes: int, transactions: int,
             last: TransactionEnd | None) -> None:
        """Count what the lane took, as the ordinary path counts its changes and commits."""
        batch = self.batch
        batch.rows += inserts + updates + deletes
        batch.inserts += inserts
        batch.bytes += value_bytes
        pending = self.tx.pending
        pending["insert"] += inserts
        pending["update"] += updates
        pending["delete"] += deletes
        if transactions:
            pending["transactions"] += transactions
            self.last = last
            self.tx.origin = None

    def wait_left(self) -> float:
        """Seconds the open batch may still wait, at a pause in the stream, for more source
        transactions before it commits (0: commit now)."""
        if not self.open:
            return 0.0
        return max(0.0, self.limits.wait - (time.monotonic() - self._started))

    def due(self) -> None:
        """After the lane's last commit, no transaction open: commit the batch if its time is up."""
        if self.open and time.monotonic() - self._started >= self._seconds:
            self.commit()
