"""The fast apply path: row changes of one or more source transactions, folded and sent in bulk.

Owns turning a sequence of row changes into few statements with a known outcome:
- repeated updates of one row within the batch are folded into the last one (the earlier ones
  are overwritten anyway; only a superset of their columns may replace them, and never across a
  key change, a delete or a truncate of that table): ``Batch.update`` as changes come, and
  ``fold_key_run`` for a run the lane filled (every column, so the last always replaces), the
  one place that rule is written;
- an insert followed by updates of the same row becomes one insert of the final row;
- the changes of independent tables are gathered per table (see ``statements``);
- runs of inserts (same table, same columns) become one COPY (``copy.py``) when long and all in
  one format (text, or binary: COPY binary), else multi-row INSERTs; runs of deletes by key one
  ``DELETE ... WHERE (key) IN (...)``, runs of updates by key one ``UPDATE ... FROM (VALUES ...)``;
- an independent table may also hold an open *run* (the lane, ``lane.py``, writes into it
  straight from the received payloads): inserts as COPY text or binary (``Run``), or updates of
  every column or deletes, by key (``KeyRun``, folded before it is sent), each run in one value
  format.
  It is sent where it began, as one COPY or as multi-row UPDATEs or DELETEs, so a change that
  must follow its rows (another kind
  of change of that table, a barrier) closes it first;
- a table the change feed records (``--change-feed``) has runs of inserts and updates, whose
  change rows the lane keeps in the run (``Run.feed``), sent after the run's data; the change
  row of each insert and of each update that sent every column (and the old key of a moved row)
  on the ordinary path is kept from the values the source sent, per table (``FeedRows``), and
  written as one COPY or multi-row INSERT before the next barrier or the part's end, so its
  data folds as any other table's; an update
  that left a TOAST value unchanged, an update of a table that is not independent and every
  delete instead record their change rows from the target's rows (``RETURNING``, ``Op.meta``),
  are never folded, and end folding for their key; the commit and end LSNs of the source
  transactions that wrote change rows go last, as rows of applier.change_commits;
- every statement carries the exact number of rows it must affect. With the idempotent policy a
  conflict (an existing key on insert, a missing row on update or delete) shows up as a different
  count (a COPY meeting an existing key fails with a unique violation instead); the caller then
  rolls the batch back and redoes that stretch on the careful, row-by-row path, which resolves,
  counts and logs each conflict.

Must never send anything itself (the pipeline does) or decide batch boundaries (``fast.path``);
the ops become SQL in ``fast.sql``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from operator import itemgetter

from ...progress.feed import ChangeTable, commits_copy_sql, commits_rows, lsn_element
from ...protocol.lsn import LSN
from ...protocol.messages import KIND_UNCHANGED, TupleData
from ..copy import copy_binary, copy_text
from ..feed.meta import Meta
from ..mapping import RelationMapping
from ..statements import NEW, OLD
from .sql import (
    COPY,
    COPY_MIN_ROWS,
    DELETE,
    DELETES,
    FEED_ROWS,
    INSERT,
    MOVED,
    SQL_TEXT,
    UPDATE,
    UPDATES,
    BatchStatement,
    Emitter,
    FeedRows,
    KeyRun,
    Op,
    Run,
    in_format,
    present_columns,
)

__all__ = ["Batch", "BatchStatement", "KeyRun", "Run", "fold_key_run"]

#: A run's kind (the type byte of the changes it takes) -> its op kind.
_RUN_OPS = {"I": COPY, "U": UPDATES, "D": DELETES}


def fold_key_run(run: KeyRun) -> None:
    """The folding rule on a run of changes by key, in place: of a key's updates (each of every
    column, so a later one replaces an earlier one) only the last is kept, where the first was;
    of its deletes, one. A run holds one table's changes of one kind, nothing between them."""
    rows = run.rows
    if run.whole_rows:
        key = itemgetter(*run.keys)
        folded = list({key(row): row for row in rows}.values())
    else:
        folded = list(dict.fromkeys(rows))
    if len(folded) != len(rows):
        rows[:] = folded


class Batch:
    def __init__(self, guard: Callable[[str], str] | None = None) -> None:
        self._emitter = Emitter(guard)
        self._ops: list[Op | None] = []
        self._last: dict[tuple, int] = {}    # (relation id, key values) -> index of its op
        self._key_getters: dict[int, Callable[[tuple], object]] = {}
        #: Open runs by relation id; the lane holds this very dict, so it is only ever changed
        #: in place. ``_open`` has their ops.
        self.runs: dict[int, Run | KeyRun] = {}
        self._open: dict[int, Op] = {}
        self._key_runs: list[KeyRun] = []   # folded before the batch is sent
        self.rows = 0
        self.inserts = 0  # of ``rows``: parts are cut by inserts and by other rows apart
        self.bytes = 0
        #: Change rows (--change-feed) kept since the last barrier, per relation id.
        self._feed: dict[int, FeedRows] = {}
        #: The commit and end LSNs of the source transactions that wrote change rows, as the
        #: elements of one row of applier.change_commits (``add_commits``), and the slot's name.
        self._commit_lsns = bytearray()
        self._end_lsns = bytearray()
        self._commit_slot = ""

    def __bool__(self) -> bool:
        return bool(self._ops)

    def clear(self) -> None:
        self._ops.clear()
        self._feed = {}
        self._commit_lsns.clear()
        self._end_lsns.clear()
        self._last.clear()
        self._key_runs.clear()
        self._close_every_run()
        self.rows = self.inserts = self.bytes = 0

    def forget(self, relation_id: int) -> None:
        """A relation's definition changed: drop what was derived from the old one."""
        self._flush_feed()
        self._key_getters.pop(relation_id, None)
        self._close_run(relation_id)
        self._emitter.forget(relation_id)

    # -- recording ------------------------------------------------------------------------------
    def _count(self, row: TupleData) -> None:
        self.rows += 1
        self.bytes += row.size

    def open_run(self, mapping: RelationMapping, run: Run | KeyRun, kind: str) -> None:
        """Start a run for an independent table's changes of one kind (``kind``: "I" inserts,
        "U" updates, "D" deletes) here, in the order of changes; one open before for that table
        ends."""
        assert mapping.table.independent and run.columns == len(mapping.target_columns)
        relation_id = mapping.relation.relation_id
        op_kind = _RUN_OPS[kind]
        op = Op(op_kind, mapping, None, None, (op_kind, relation_id, False), run=run)
        self._open[relation_id] = op
        self.runs[relation_id] = run
        self._ops.append(op)
        if kind != "I":
            self._key_runs.append(run)  # type: ignore[arg-type]

    def recorded_runs(self) -> list[ChangeTable]:
        """The change tables of the recorded tables with an open run (the lane writes their
        change rows)."""
        return [op.mapping.feed for op in self._open.values()  # type: ignore[union-attr]
                if op.mapping.feed is not None]  # type: ignore[union-attr]

    def _close_run(self, relation_id: int) -> None:
        if self._open.pop(relation_id, None) is not None:
            del self.runs[relation_id]

    def _close_every_run(self) -> None:
        self._open.clear()
        self.runs.clear()

    def _close_runs(self, mapping: RelationMapping) -> None:
        """A change of ``mapping``'s table that joins no run: what follows it must not join a
        run begun before it (a barrier's change ends every run)."""
        if mapping.table.independent:
            self._close_run(mapping.relation.relation_id)
        else:
            self._close_every_run()

    def _key(self, mapping: RelationMapping, row: TupleData) -> tuple:
        relation_id = mapping.relation.relation_id
        getter = self._key_getters.get(relation_id)
        if getter is None:
            getter = self._key_getters[relation_id] = itemgetter(*mapping.key_positions)
        return (relation_id, getter(row.values))

    def _feed_row(self, mapping: RelationMapping, meta: Meta, op: str, row: TupleData) -> None:
        rows = self._feed.get(mapping.relation.relation_id)
        if rows is None:
            rows = self._feed[mapping.relation.relation_id] = FeedRows(mapping)
        rows.rows.append((meta, op, row))

    def _flush_feed(self) -> None:
        """The change rows kept so far go here, in order with the ops around them."""
        if self._feed:
            for rows in self._feed.values():
                self._ops.append(Op(FEED_ROWS, None, None, None, (FEED_ROWS, False), run=rows))
            self._feed = {}

    def insert(self, mapping: RelationMapping, new: TupleData, meta: Meta | None = None) -> None:
        self._count(new)
        self.inserts += 1
        if meta is not None:
            self._feed_row(mapping, meta, "I", new)
        if self._open:
            op = self._open.get(mapping.relation.relation_id)
            if op is not None and op.kind == COPY:
                run: Run = op.run  # type: ignore[assignment]
                if in_format(new.kinds, run.binary):
                    encode = copy_binary if run.binary else copy_text
                    run.data.extend(encode([new.values]))  # type: ignore[list-item]
                    run.rows += 1
                    return
            self._close_runs(mapping)
        present = present_columns(new)
        op = Op(INSERT, mapping, new, None, (INSERT, mapping.relation.relation_id, present, True, True))
        if mapping.key_positions and not mapping.full_identity:
            self._last[self._key(mapping, new)] = len(self._ops)
        self._ops.append(op)

    def update(self, mapping: RelationMapping, new: TupleData, old: TupleData | None,
               meta: Meta | None = None, moved: tuple[tuple[int, ...], Meta] | None = None) -> None:
        """``meta``: the table is recorded (``moved``: the update moves its row to another key,
        whose delete is recorded first, from these positions of the old row)."""
        self._count(new)
        if self._open:
            op = self._open.get(mapping.relation.relation_id)
            if (op is not None and op.kind == UPDATES and old is None
                    and in_format(new.kinds, op.run.binary)):  # type: ignore[union-attr]
                op.run.add(new.values)  # type: ignore[union-attr, arg-type]
                if meta is not None:  # a recorded table's run (of every column, by key)
                    self._feed_row(mapping, meta, "U", new)
                return
            self._close_runs(mapping)
        assigned = present_columns(new)
        relation_id = mapping.relation.relation_id
        if meta is not None:
            if (KIND_UNCHANGED in new.kinds or not mapping.table.independent
                    or (moved is not None and KIND_UNCHANGED in old.kinds)):  # type: ignore[union-attr]
                self._recorded_update(mapping, new, old, meta, assigned, moved)
                return
            if moved is not None:
                assert old is not None
                self._feed_row(mapping, moved[1], "D", old)
            self._feed_row(mapping, meta, "U", new)
        if mapping.full_identity or not mapping.key_positions or old is not None:
            # No key to fold on, or the key itself changed (the server sent the old key): this
            # change stands alone and ends folding for both keys.
            if old is not None and mapping.key_positions and not mapping.full_identity:
                self._last.pop(self._key(mapping, old), None)
                self._last.pop(self._key(mapping, new), None)
            by_key = not mapping.full_identity
            # FULL identity always sends the old row: it is what a row is matched by.
            match = mapping.key_positions if by_key or old is None else present_columns(old)
            source = OLD if old is not None else NEW
            self._ops.append(Op(UPDATE, mapping, new, old,
                                 (UPDATE, relation_id, assigned, source, match, by_key, False)))
            return
        key = self._key(mapping, new)
        ops = self._ops
        previous_index = self._last.get(key)
        if previous_index is not None:
            previous = ops[previous_index]
            # Only a superset of the earlier change's columns replaces it (every column, the
            # common case, always does).
            if previous is not None and previous.row is not None and (
                    len(assigned) == len(new.kinds)
                    or set(present_columns(previous.row)) <= set(assigned)):
                if previous.kind == INSERT and len(assigned) == len(new.kinds):
                    # Insert then update: insert the final row instead.
                    previous.row = new
                    previous.shape = (INSERT, relation_id, assigned, True, True)
                    return
                if previous.kind == UPDATE:
                    ops[previous_index] = None  # overwritten by this one
        self._last[key] = len(ops)
        ops.append(Op(UPDATE, mapping, new, None,
                       (UPDATE, relation_id, assigned, NEW, mapping.key_positions, True, True)))

    def _recorded_update(self, mapping: RelationMapping, new: TupleData, old: TupleData | None,
                         meta: Meta, assigned: tuple[int, ...],
                         moved: tuple[tuple[int, ...], Meta] | None) -> None:
        """An update whose change row comes from the target's row (RETURNING): never folded, and
        no later change of its keys folds across it; by key in multi-row statements unless it
        moves the row to another key."""
        by_key = not mapping.full_identity
        if mapping.key_positions and by_key:
            self._last.pop(self._key(mapping, new), None)
            if old is not None:
                self._last.pop(self._key(mapping, old), None)
        if moved is not None:
            assert old is not None
            self._ops.append(Op(MOVED, mapping, old, None,
                                (MOVED, mapping.relation.relation_id, moved[0], False), meta=moved[1]))
        match = mapping.key_positions if by_key or old is None else present_columns(old)
        source = OLD if old is not None else NEW
        self._ops.append(Op(UPDATE, mapping, new, old,
                            (UPDATE, mapping.relation.relation_id, assigned, source, match, by_key,
                             by_key and old is None), meta=meta))

    def delete(self, mapping: RelationMapping, old: TupleData, meta: Meta | None = None) -> None:
        self._count(old)
        if self._open:
            op = self._open.get(mapping.relation.relation_id)
            if (op is not None and op.kind == DELETES and meta is None
                    and in_format(old.kinds, op.run.binary)):  # type: ignore[union-attr]
                op.run.add(old.values)  # type: ignore[union-attr, arg-type]
                return
            self._close_runs(mapping)
        relation_id = mapping.relation.relation_id
        if mapping.full_identity:
            self._ops.append(Op(DELETE, mapping, old, None,
                                 (DELETE, relation_id, present_columns(old), False, False), meta=meta))
            return
        self._last.pop(self._key(mapping, old), None)
        self._ops.append(Op(DELETE, mapping, old, None,
                             (DELETE, relation_id, mapping.key_positions, True, True), meta=meta))

    def statement(self, sql: str, savepoint: str | None = None) -> None:
        """A statement that must run in order and ends all folding (TRUNCATE, SAVEPOINT: then
        ``savepoint`` names it)."""
        self._flush_feed()
        self._last.clear()
        self._close_every_run()
        self._ops.append(Op(SQL_TEXT, None, None, None, (SQL_TEXT, False), sql, savepoint=savepoint))

    def add_commits(self, slot: str, commit_lsns: bytes, end_lsns: bytes) -> None:
        """Source transactions of ``slot`` that wrote change rows, in commit order: their commit
        and end LSNs as array elements (``progress.feed.lsn_element``), sent with the batch."""
        self._commit_slot = slot
        self._commit_lsns += commit_lsns
        self._end_lsns += end_lsns

    def add_commit(self, slot: str, commit_lsn: LSN, end_lsn: LSN) -> None:
        """One source transaction of ``slot`` that wrote change rows (``add_commits``)."""
        self.add_commits(slot, lsn_element(commit_lsn), lsn_element(end_lsn))

    def statements(self, change_rows_copy: bool = False) -> Iterator[BatchStatement]:
        """The batch as statements (``fast.sql.Emitter.statements``), then the rows of
        applier.change_commits of the transactions that wrote change rows, if any.
        ``change_rows_copy``: change rows written from the values the source sent go as COPYs
        however few (the feed's spool holds them back: no round trip is saved by INSERTs)."""
        self._flush_feed()
        for run in self._key_runs:
            fold_key_run(run)
        self._emitter.change_rows_copy_min = 1 if change_rows_copy else COPY_MIN_ROWS
        yield from self._emitter.statements(self._ops)
        if self._commit_lsns:
            data, rows = commits_rows(self._commit_slot, self._commit_lsns, self._end_lsns)
            yield BatchStatement(None, commits_copy_sql(), [], [], rows, data)
