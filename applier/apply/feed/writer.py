"""The change feed in the apply stage: each row change of a recorded table leaves a change row in
the same target transaction (``--change-feed``).

Owns, for one target session (``FeedWriter``, reached as ``TargetTransaction.feed``):

* the *stamp* of the source transaction being applied (commit LSN, commit time and xid;
  ``feed.meta`` encodes them) and the order of its changes (``change_seq``, counted as they are
  dispatched). A transaction whose commit is not known yet (applied as it streams, or prepared
  on the target) is stamped ``PENDING``; its rows are moved to the commit LSN in the target
  transaction that records the commit (``fix_pending``, ``fix_prepared``);
* the change table of each mapped table kept fit for the rows written to it (a column the
  target gained is added, a widened type widened), in the open target transaction, as
  ``schema_follow.SchemaFollower`` does for the target table (and with its rules for sessions that must
  not take such locks);
* partitions: one is created in the open target transaction when a commit LSN passes the
  newest (forgotten again if that transaction rolls back);
* the careful path's statements wrapped so that one statement changes a row and records it
  (``WITH ... RETURNING`` the whole new row, unchanged TOAST values included, or the whole old
  one); the delete row of an update that moved a row to another key; truncate markers;
* whether the source transaction being applied wrote change rows, so that its commit and end LSN
  go to ``applier.change_commits`` (``wrote_rows``; ``commit_sql`` outside the fast path);
* in the early session, the spool (``feed.spool``) that holds the COPYs of change rows of the
  transaction applied as it streams until its commit (``holds_back``, ``spooled``), so that they
  are written once, with the commit LSN, instead of as ``PENDING`` and then moved.

The fast path builds its change rows itself (``feed.rows``). Must never decide what is applied
or when a transaction begins or ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Protocol

from psycopg import pq, sql

from ...assembler import TransactionEnd, TransactionStart
from ...progress import feed as layout
from ...progress.feed import PENDING, ChangeTable, Partition
from ...progress.records import TableName
from ...protocol.lsn import LSN, to_pg_timestamp
from ...protocol.messages import KIND_UNCHANGED, TupleData
from ..ddl import after_ddl, before_ddl
from ..mapping import RelationMapping
from ..statements import Statement, named, placeholder
from .meta import META, Meta, Stamp, text_meta
from .spool import FeedSpool, Spooled

__all__ = ["FeedWriter", "moved_key"]

log = logging.getLogger(__name__)

def moved_key(mapping: RelationMapping, new: TupleData, old: TupleData | None) -> tuple[int, ...] | None:
    """An update that moved its row to another key: the positions of the old row to record as
    the delete of that key (key columns; the whole sent row under REPLICA IDENTITY FULL), else
    None. Under FULL identity the key is the target's unique key (none: nothing to record)."""
    if old is None:
        return None
    if mapping.full_identity:
        names = [c.name for c in mapping.target_columns]
        if not mapping.table.unique_key or not set(mapping.table.unique_key) <= set(names):
            return None
        keys: Sequence[int] = [names.index(name) for name in mapping.table.unique_key]
        recorded = tuple(i for i, kind in enumerate(old.kinds) if kind != KIND_UNCHANGED)
    else:
        keys = recorded = mapping.key_positions
    if all(old.values[i] == new.values[i] and old.kinds[i] == new.kinds[i] for i in keys):
        return None
    return recorded


class FeedSession(Protocol):
    """What the writer needs of its session's target transaction (``TargetTransaction``)."""

    current: TransactionStart | None
    on_end: list[Callable[[bool], None]]
    schema_changes: str

    def sql(self, text: str, values: Sequence[bytes | None] | None = None) -> pq.abc.PGresult: ...

    def execute_row(self, statement: Statement, new: TupleData | None, old: TupleData | None,
                    mapping: RelationMapping, meta: Sequence[bytes | None] = ()) -> pq.abc.PGresult: ...

    def begin(self) -> None: ...

    def rollback(self) -> None: ...

    def commit_alone(self) -> None: ...


class FeedBatch(Protocol):
    """What the writer needs of the fast path's batch at a commit (``FastPath``)."""

    def send_part(self) -> None: ...

    def send_copy(self, sql: str, data: bytes, rows: int) -> None: ...

    def statement(self, sql: str) -> None: ...

    def add_commit(self, slot: str, commit_lsn: LSN, end_lsn: LSN) -> None: ...


class FeedWriter:
    def __init__(self, tx: FeedSession, tables: dict[TableName, ChangeTable],
                 interval: float, slot: str, spool: FeedSpool | None = None) -> None:
        self.tx = tx
        self.tables = tables
        self.slot = slot
        #: The early session's: change rows of the transaction applied as it streams wait here.
        self.spool = spool
        #: Seconds of WAL a new partition is sized for (a seventh of the retention).
        self.interval = interval
        self._stamp: Stamp | None = None
        self._for: object = None            # the TransactionStart the stamp belongs to
        self._deferred: object = None       # a transaction stamped PENDING (prepared on the target)
        self._pending_written: set[ChangeTable] = set()
        #: Changes of the open target transaction to undo if it rolls back.
        self._undo: list[Callable[[], None]] = []
        self._wrapped: dict[tuple[int, bytes, str], Statement] = {}  # (relation id, name, op)
        tx.on_end.append(self._ended)

    def table_for(self, schema: str, name: str) -> ChangeTable | None:
        return self.tables.get((schema, name))

    # -- stamps -------------------------------------------------------------------------------
    def stamp(self) -> Stamp:
        current = self.tx.current
        if self._for is not current or self._stamp is None:
            assert current is not None, "a change outside a source transaction"
            pending = current.commit_lsn == PENDING or self._deferred is current
            self._stamp = Stamp(current.commit_lsn, current.commit_time, current.xid, pending)
            self._for = current
            self._pending_written.clear()
        return self._stamp

    def lane_stamp(self, recorded: Sequence[ChangeTable]) -> tuple[int, int | None, int, int] | None:
        """For the lane (``lane.LaneHost.lane_stamp``): the open transaction's stamp (commit LSN,
        commit time in microseconds since 2000-01-01, xid, change rows so far), or None when
        none is open. A transaction whose commit is not known yet has the PENDING LSN and no
        time: the change tables in ``recorded`` (those the lane may write to) are then fixed at
        its commit, as those of the rows written here."""
        if self.tx.current is None:
            return None
        stamp = self.stamp()
        if stamp.pending:
            self._pending_written.update(recorded)
        time = None if stamp.commit_time is None else to_pg_timestamp(stamp.commit_time)
        return int(stamp.commit_lsn), time, stamp.xid, stamp.seq

    def defer(self) -> None:
        """The transaction being applied is prepared on the target: its commit comes later."""
        self._deferred = self.tx.current
        self._stamp = None

    def meta(self, change_table: ChangeTable) -> Meta:
        """The next change's meta in ``change_table`` (its partition exists once this returns)."""
        stamp = self.stamp()
        stamp.seq += 1
        if stamp.pending:
            self._pending_written.add(change_table)
        elif stamp.commit_lsn >= change_table.newest.to_lsn:
            self._partition(change_table, stamp.commit_lsn)
        return stamp, stamp.seq

    # -- the careful path ---------------------------------------------------------------------------
    def forget(self, relation_id: int) -> None:
        """A relation's description changed: its statements are built again on next use."""
        self._wrapped = {k: v for k, v in self._wrapped.items() if k[0] != relation_id}

    def wrap(self, statement: Statement, mapping: RelationMapping, op: str) -> Statement:
        """``statement`` (an INSERT, UPDATE or DELETE of one row) recording a change row for the
        row it changes; its last four parameters are the change's meta (``META``)."""
        key = (mapping.relation.relation_id, statement.name, op)
        wrapped = self._wrapped.get(key)
        if wrapped is None:
            change_table = mapping.feed
            assert change_table is not None
            columns = [c.name for c in mapping.target_columns]
            meta = layout.meta_placeholders(len(statement.params) + 1)
            text = layout.wrap_sql(change_table, sql.SQL("{}{}").format(
                sql.SQL(statement.sql), layout.returning(meta, columns)), columns, op)
            params = statement.params + tuple((META, i) for i in range(4))
            wrapped = self._wrapped[key] = named(text, params, statement.conflict_key, "applier_feed")
        return wrapped

    def moved(self, mapping: RelationMapping, old: TupleData, positions: tuple[int, ...],
              meta: Meta) -> None:
        """Record the delete of the old key of an update that moved its row."""
        statement = self.moved_statement(mapping, positions)
        self.tx.execute_row(statement, None, old, mapping, text_meta(meta))

    def moved_statement(self, mapping: RelationMapping, positions: tuple[int, ...]) -> Statement:
        key = (mapping.relation.relation_id, b"moved:" + repr(positions).encode(), "D")
        statement = self._wrapped.get(key)
        if statement is None:
            change_table = mapping.feed
            assert change_table is not None
            values = [*layout.meta_placeholders(1), sql.Literal("D"),
                      *(placeholder(mapping, i, n) for n, i in enumerate(positions, 5))]
            text = sql.SQL("{} VALUES ({})").format(
                layout.insert_prefix(change_table, [mapping.target_columns[i].name for i in positions]),
                sql.SQL(", ").join(values)).as_string()
            params = tuple((META, i) for i in range(4)) + tuple((1, i) for i in positions)
            statement = self._wrapped[key] = named(text, params, (), "applier_feed")
        return statement

    def truncated(self, mappings: Sequence[RelationMapping]) -> list[str]:
        """A marker row for each recorded table a TRUNCATE emptied."""
        markers = []
        for mapping in mappings:
            change_table = mapping.feed
            if change_table is not None:
                stamp, seq = self.meta(change_table)
                markers.append(layout.marker_sql(change_table, stamp.commit_lsn, stamp.commit_time,
                                                 stamp.xid, seq))
        return markers

    # -- the spool (the early session) ---------------------------------------------------------------
    def holds_back(self) -> bool:
        """COPYs of change rows sent now wait in the spool until the open transaction's commit:
        it is applied as it streams (its commit LSN not known yet; never one prepared on the
        target, whose rows must be there before PREPARE TRANSACTION)."""
        current = self.tx.current
        return (self.spool is not None and current is not None and current.commit_lsn == PENDING
                and self._deferred is not current)

    def spooled(self, commit_lsn: LSN, commit_time: datetime) -> Iterator[Spooled]:
        """The COPYs the spool held for the transaction being applied, committing at
        ``commit_lsn``, with that LSN and time; each change table has its partition for it."""
        spool = self.spool
        if not spool:
            return
        assert spool is not None
        pending = self.stamp()
        for held in spool.restamped(pending, Stamp(commit_lsn, commit_time, pending.xid, False)):
            if commit_lsn >= held.change_table.newest.to_lsn:
                self._partition(held.change_table, commit_lsn)
            yield held

    # -- commits ----------------------------------------------------------------------------------
    def wrote_rows(self) -> bool:
        """The transaction being applied wrote change rows (the lane's included)."""
        return self._stamp is not None and self._for is self.tx.current and self._stamp.seq > 0

    def commit_sql(self, commit_lsn: LSN, end_lsn: LSN, wrote: bool = False) -> str | None:
        """The row of applier.change_commits of the transaction being applied, committing at
        ``commit_lsn``, if it wrote change rows (``wrote``: before, prepared on the target)."""
        return layout.commit_sql(self.slot, commit_lsn, end_lsn) if wrote or self.wrote_rows() else None

    def commit(self, txn: TransactionEnd, batch: FeedBatch | None) -> None:
        """The transaction being applied commits (in ``batch``, the fast path's, else in its own
        target transaction): change rows held back while it streamed are written with its commit
        LSN, those written before the commit was known move to it, and its row of
        applier.change_commits goes with it if it wrote change rows."""
        if batch is not None and self.holds_back():
            batch.send_part()  # the batch's last change rows join the held ones
        for held in self.spooled(txn.commit_lsn, txn.commit_time):
            assert batch is not None  # only the fast path holds change rows back
            batch.send_copy(held.copy_sql, held.data, held.rows)
        for fix in self.fix_pending(txn.commit_lsn, txn.commit_time):
            if batch is not None:
                batch.statement(fix)
            else:
                self.tx.sql(fix)
        if batch is not None:
            if self.wrote_rows():
                batch.add_commit(self.slot, txn.commit_lsn, txn.end_lsn)
        else:
            statement = self.commit_sql(txn.commit_lsn, txn.end_lsn)
            if statement is not None:
                self.tx.sql(statement)

    def fix_pending(self, commit_lsn: LSN, commit_time: datetime) -> list[str]:
        """The statements that move the rows the transaction being applied wrote with a PENDING
        stamp to its commit LSN (a transaction applied as it streams, at its Stream Commit)."""
        stamp = self._stamp
        if stamp is None or not stamp.pending or not self._pending_written or self._for is not self.tx.current:
            return []
        fixes = []
        for change_table in sorted(self._pending_written, key=lambda t: t.id):
            if commit_lsn >= change_table.newest.to_lsn:
                self._partition(change_table, commit_lsn)
            fixes.append(layout.fix_pending_sql(change_table, stamp.xid, commit_lsn, commit_time))
        self._pending_written.clear()
        return fixes

    def fix_prepared(self, xid: int, commit_lsn: LSN, commit_time: datetime) -> bool:
        """COMMIT PREPARED of a transaction prepared on the target: its rows, pending since its
        prepare, move to the commit LSN (in the open target transaction recording the commit).
        Whether it had any."""
        moved = False
        for change_table in self.tables.values():
            found = self.tx.sql(sql.SQL("SELECT 1 FROM {} WHERE {} = {}::pg_catalog.pg_lsn AND {} = {} "
                                        "LIMIT 1").format(
                change_table.ident, sql.Identifier(layout.META_COLUMNS[0]), sql.Literal(str(PENDING)),
                sql.Identifier(layout.META_COLUMNS[2]), sql.Literal(xid)).as_string())
            if found.ntuples:
                if commit_lsn >= change_table.newest.to_lsn:
                    self._partition(change_table, commit_lsn)
                self.tx.sql(layout.fix_pending_sql(change_table, xid, commit_lsn, commit_time))
                moved = True
        return moved

    # -- the change table's shape -----------------------------------------------------------------
    def align(self, mapping: RelationMapping) -> None:
        """Make the change table take every column of ``mapping`` with its target type."""
        change_table = mapping.feed
        assert change_table is not None
        changes: list[tuple[str, str, sql.Composable]] = []
        for column in mapping.target_columns:
            have = change_table.columns.get(column.name)
            if have is None:
                changes.append((column.name, column.type_sql,
                                layout.add_column_sql(change_table, column.name, column.type_sql)))
            elif have != column.type_sql:
                changes.append((column.name, column.type_sql,
                                layout.alter_type_sql(change_table, column.name, column.type_sql)))
        if not changes:
            return
        tx = self.tx
        subject = f"change table of {mapping.table.sql_name}"
        before_ddl(tx, subject)
        before = dict(change_table.columns)
        for name, type_sql, statement in changes:
            tx.sql(statement.as_string())
            change_table.columns[name] = type_sql
            log.info("change feed: %s", statement.as_string())
        self._undo.append(lambda: _restore(change_table.columns, before))
        after_ddl(tx, subject)

    def _partition(self, change_table: ChangeTable, lsn: LSN) -> None:
        """Create the partition for ``lsn`` in the open target transaction."""
        part = layout.next_partition(change_table, lsn, datetime.now(UTC), self.interval)
        for statement in layout.partition_sql(change_table, part.name, part.from_lsn, part.to_lsn):
            self.tx.sql(statement.as_string())
        self.tx.sql(layout.partition_row_sql(change_table, part))
        newest, count = change_table.newest, change_table.partitions
        change_table.newest, change_table.partitions = part, count + 1
        self._undo.append(lambda: _put_back(change_table, newest, count))
        log.info("change feed of %s: partition %s for commit LSNs [%s, %s)", change_table.display,
                 part.name, part.from_lsn, part.to_lsn)

    def _ended(self, committed: bool) -> None:
        if self.spool is not None:
            self.spool.clear()
        undo, self._undo = self._undo, []
        if not committed:
            for step in reversed(undo):
                step()
            self._stamp = None
            self._pending_written.clear()


def _restore(columns: dict[str, str], before: dict[str, str]) -> None:
    columns.clear()
    columns.update(before)


def _put_back(change_table: ChangeTable, newest: Partition, count: int) -> None:
    change_table.newest, change_table.partitions = newest, count
