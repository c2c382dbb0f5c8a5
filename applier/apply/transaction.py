"""The one owner of the target transaction.

Owns, for one target session: which source transaction is being applied (``current``, its
``origin``), the error context every failure inside it carries (set once, at its begin, as
PostgreSQL's apply_error_callback does), transaction control (BEGIN, COMMIT with the progress row,
ROLLBACK, PREPARE TRANSACTION and its end), the recorded position (``applied``), the counts of
what was applied, and telling the worker about each commit (``on_commit``: the source end LSN it
covers and, with ``synchronous_commit = off``, the target WAL position that must be flushed
before the slot may hear of it). Everything else in ``apply/`` reaches the target through it or
through its ``store``. Must never decide what to apply or when a batch ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from psycopg import pq, sql

from .. import faults
from ..assembler import TransactionStart
from ..errors import ApplyError, Cause, TargetError
from ..faults import FailPoint
from ..progress.records import AppliedPosition, Position
from ..progress.store import ApplyStore, StoreStatement
from ..protocol.lsn import LSN
from ..protocol.messages import KIND_BINARY, Origin, TupleData
from .ddl import DDL_INLINE
from .fast.pipeline import Pipeline
from .feed.writer import FeedWriter
from .mapping import RelationMapping
from .statements import NEW, Statement
from .target import Preparable, TargetSession

__all__ = ["DURABLE_COMMIT", "OnCommit", "TargetTransaction", "WAL_INSERT_LSN"]

#: In a session running with synchronous_commit = off: this transaction's COMMIT waits for its
#: WAL flush (``SET LOCAL``, prepared once rather than parsed at every durable commit).
DURABLE_COMMIT = StoreStatement(b"applier_durable_commit",
                                "SELECT pg_catalog.set_config('synchronous_commit', 'on', true)")
#: Where the target's WAL ends: a commit just made is durable once the WAL is flushed up to here.
WAL_INSERT_LSN = StoreStatement(b"applier_wal_insert_lsn", "SELECT pg_catalog.pg_current_wal_insert_lsn()")

#: Called after a target commit: the source end LSN it covers, and (with synchronous_commit off)
#: the target WAL position that must be flushed before the slot may be told.
OnCommit = Callable[[LSN, "LSN | None"], None]


class TargetTransaction:
    def __init__(self, session: TargetSession, store: ApplyStore, applied: AppliedPosition,
                 on_commit: OnCommit, *, track_target_lsn: bool = False) -> None:
        self.session = session
        self.store = store
        self.applied = applied
        self.on_commit = on_commit
        #: synchronous_commit = off: each commit's target WAL position is noted for ``on_commit``.
        self.track_target_lsn = track_target_lsn
        self.current: TransactionStart | None = None
        self.origin: Origin | None = None
        self.counts: Counter[str] = Counter()    # committed on the target
        self.pending: Counter[str] = Counter()   # in the open target transaction
        #: How a schema change needed now is made (``schema_follow.DDL_*``): inside the open
        #: transaction, committed on its own before it, or not at all.
        self.schema_changes = DDL_INLINE
        #: Called with True when the open transaction commits, False when it rolls back.
        self.on_end: list[Callable[[bool], None]] = []
        #: The change feed's writer of this session (--change-feed), None when the feed is off.
        self.feed: FeedWriter | None = None

    # -- the source transaction and its error context ---------------------------------------------
    def start(self, txn: TransactionStart | None) -> None:
        """``txn`` is being applied from now on (None: none is)."""
        self.current = txn
        self.origin = None

    @property
    def xid(self) -> int | None:
        """Source xid of the transaction being applied, if any (log context and metrics)."""
        return self.current.xid if self.current is not None else None

    def error(self, message: str, *, cause: Cause = Cause.REFUSED_DATA,
              sqlstate: str | None = None) -> ApplyError:
        """An ``ApplyError`` naming the source transaction being applied, if any."""
        txn = self.current
        # The transaction first: its LSN is the one ``applier skip`` takes.
        if txn is not None and txn.gid is None:
            message = f"source transaction xid {txn.xid}, commit LSN {txn.commit_lsn}: {message}"
        elif txn is not None:
            message = (f"source transaction xid {txn.xid}, GID {txn.gid!r}, finish LSN "
                       f"{txn.commit_lsn}: {message}")
        return ApplyError(message, cause=cause, sqlstate=sqlstate,
                          commit_lsn=txn.commit_lsn if txn else None, xid=txn.xid if txn else None)

    def failed(self, exc: TargetError, what: str = "") -> ApplyError:
        """``exc`` (a target statement that failed) with the transaction's context."""
        return self.error(f"{exc}{what}", cause=exc.cause, sqlstate=exc.sqlstate)

    # -- statements ---------------------------------------------------------------------------
    def sql(self, text: str, values: Sequence[bytes | None] | None = None) -> pq.abc.PGresult:
        return self.session.sql(text, values)

    def run(self, statement: Preparable, values: Sequence[bytes | None],
            formats: Sequence[int]) -> pq.abc.PGresult:
        return self.session.run(statement, values, formats)

    def execute_row(self, statement: Statement, new: TupleData | None, old: TupleData | None,
                    mapping: RelationMapping, meta: Sequence[bytes | None] = ()) -> pq.abc.PGresult:
        """Run a row statement, its parameters taken from the new and old rows in the format
        each value arrived in (and the change feed's ``meta`` values, in text); a failure names
        the table."""
        values: list[bytes | None] = []
        formats: list[int] = []
        for source, position in statement.params:
            if source > 1:  # feed.meta.META
                values.append(meta[position])
                formats.append(0)
                continue
            row = new if source == NEW else old
            assert row is not None
            values.append(row.values[position])  # type: ignore[arg-type]
            formats.append(1 if row.kinds[position] == KIND_BINARY else 0)
        try:
            return self.session.run(statement, values, formats)
        except TargetError as exc:
            raise self.failed(exc, f" (table {mapping.table.sql_name})") from exc

    # -- transaction control --------------------------------------------------------------------
    @property
    def open(self) -> bool:
        return self.session.in_transaction

    def begin(self) -> None:
        """Open the target transaction (BEGIN goes with its first statement)."""
        self.session.begin()

    def rollback(self) -> None:
        """Roll back whatever is open (nothing of it was counted as applied)."""
        self.pending.clear()
        self.session.rollback()
        self.ended(False)

    def ended(self, committed: bool) -> None:
        """The open transaction (or the part of it after a savepoint) is over."""
        for listener in self.on_end:
            listener(committed)

    def commit_alone(self) -> None:
        """Commit the open transaction, which holds no source transaction's position (a schema
        change made ahead of the transaction that needs it)."""
        self.session.sql("COMMIT")
        self.counts.update(self.pending)
        self.pending.clear()
        self.ended(True)

    def commit(self, position: Position, fault: FailPoint = FailPoint.BEFORE_FEEDBACK) -> None:
        """Record ``position`` in the open transaction, commit it, tell the worker: one round trip."""
        target_lsn: list[LSN] = []
        with self.session.pipeline() as pipeline:  # a failure is a TargetError (PipelineError)
            self.store.record_position(position, via=pipeline)
            self.send_commit(pipeline, target_lsn)
            pipeline.sync()
        self.committed(position, target_lsn[0] if target_lsn else None, fault)

    def send_commit(self, pipeline: Pipeline, target_lsn: list[LSN]) -> None:
        """Queue COMMIT and, with synchronous_commit off, the query whose answer, appended to
        ``target_lsn``, is the WAL position to be flushed before the slot may hear of it."""
        pipeline.send("COMMIT")
        if self.track_target_lsn:
            pipeline.run(WAL_INSERT_LSN, [], on_value=lambda v: target_lsn.append(LSN.parse((v or b"0/0").decode())))

    def committed(self, position: Position | None, target_lsn: LSN | None,
                  fault: FailPoint = FailPoint.BEFORE_FEEDBACK) -> None:
        """The open transaction committed (here or in a pipeline), holding ``position`` if any."""
        # Counted only once the target committed: a rolled-back batch is redone and would
        # otherwise be counted twice.
        self.counts.update(self.pending)
        self.pending.clear()
        self.ended(True)
        if position is None:
            return
        self.applied = AppliedPosition(position.commit_lsn, position.end_lsn)
        faults.hit(fault)
        self.on_commit(position.end_lsn, target_lsn)

    def make_durable(self) -> bool:
        """Make every commit that has returned durable now, rather than when the WAL writer gets
        to it (synchronous_commit = off): the progress row is written again, unchanged, in a
        transaction committed with synchronous_commit on, so COMMIT returns once the WAL up to
        its commit record, and so everything before it, is on disk. (A transaction that writes
        no WAL commits without a flush.) False, and nothing flushed, without that row."""
        self.session.begin()
        self.session.run(DURABLE_COMMIT, [], [])
        written = self.store.touch_position()
        self.session.sql("COMMIT")
        return written

    # -- prepared transactions on the target ------------------------------------------------------
    def prepare(self, gid: str) -> None:
        self.session.sql(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)).as_string())

    def is_prepared(self, gid: str) -> bool:
        return self.session.sql("SELECT 1 FROM pg_catalog.pg_prepared_xacts WHERE gid = $1",
                                [gid.encode()]).ntuples > 0

    def finish_prepared(self, gid: str, commit: bool) -> None:
        verb = "COMMIT PREPARED {}" if commit else "ROLLBACK PREPARED {}"
        self.session.sql(sql.SQL(verb).format(sql.Literal(gid)).as_string())


