"""The fast path's ops and the SQL they become: multi-row statements, COPY runs, row counts.

Owns the representation of a recorded change (``Op``) and how runs of ops of one shape turn into
statements (``Emitter``): the changes of independent tables gathered per table, runs of inserts
as one COPY (text or binary) or multi-row INSERTs, runs of updates and deletes by key as
``UPDATE ... FROM (VALUES ...)`` and ``DELETE ... WHERE (key) IN (...)``, each statement with the
exact number of rows it must affect; runs of a table the change feed records also write its
change rows (``feed.rows``), a run of its updates never holding one key twice. Every identifier is
composed with ``psycopg.sql``. Must never record, fold or send anything (``batch.Batch`` records,
the pipeline sends).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from psycopg import sql

from ...protocol.messages import KIND_BINARY
from ..copy import copy_binary, copy_binary_data, copy_fields, copy_sql, copy_text
from ..feed import rows as feed_rows
from ..mapping import RelationMapping
from ..statements import (
    NEW,
    OLD,
    assignments,
    column,
    delete_in_sql,
    delete_sql,
    on_conflict,
    overriding,
    table,
    update_sql,
    value_rows,
)
from .ops import (
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
    FeedRows,
    KeyRun,
    Op,
    Run,
    chunks,
    collect,
    every_column,
    in_format,
    present_columns,
)

__all__ = ["BatchStatement", "COPY", "COPY_MIN_ROWS", "DELETE", "DELETES", "Emitter", "FEED_ROWS",
           "FeedRows", "INSERT", "KeyRun", "MOVED", "Op", "Run", "SQL_TEXT", "UPDATE", "UPDATES",
           "every_column", "in_format", "present_columns"]



class Emitter:
    """Turns a batch's ops into statements; keeps the SQL text of each shape and row count."""

    def __init__(self, guard: Callable[[str], str] | None = None) -> None:
        # With update_origin_differs detection: ``guard(xmin)`` is the SQL test that this worker
        # wrote the row last; updates carry it, so another origin's row changes no row and the
        # count differs.
        self._guard = guard
        self._sql: dict[tuple, str] = {}     # (shape, rows) -> statement text
        #: Change rows from this many on go as one COPY (1: every one, the spool holding them).
        self.change_rows_copy_min = COPY_MIN_ROWS

    def forget(self, relation_id: int) -> None:
        """A relation's definition changed: drop the SQL derived from the old one."""
        self._sql = {k: v for k, v in self._sql.items() if k[0][1] != relation_id}

    def statements(self, all_ops: list[Op | None]) -> Iterator[BatchStatement]:
        """The batch as statements, grouping consecutive ops of the same shape.

        The changes of independent tables (``TargetTable.independent``) are first gathered per
        table, each in its own order: source transactions that each touch several tables
        (pgbench writes four) then still make long runs instead of runs of one. The target
        transaction's outcome is the same, since only the order between such tables changes and
        nothing on the target observes it. Any other change (a partitioned table, a table with
        a replica trigger, TRUNCATE) is a barrier: everything recorded before it goes first.

        Among the gathered tables, those whose changes begin with an open run's COPY go first: a
        COPY cannot join the pipeline, so one after pipelined statements waits for all of them
        to finish, while one before them lets them run on while the next part is decoded."""
        tables: dict[int, list[Op]] = {}  # independent tables' changes, per table
        in_order: list[Op] = []            # other changes, since the last independent one
        for op in all_ops:
            if op is None:
                continue
            mapping = op.mapping
            if mapping is not None and mapping.table.independent:
                if in_order:
                    yield from self._runs(in_order)
                    in_order = []
                ops = tables.get(mapping.relation.relation_id)
                if ops is None:
                    tables[mapping.relation.relation_id] = [op]
                else:
                    ops.append(op)
                continue
            yield from self._gathered(tables)
            tables.clear()
            in_order.append(op)
        yield from self._runs(in_order)
        yield from self._gathered(tables)

    def _gathered(self, tables: dict[int, list[Op]]) -> Iterator[BatchStatement]:
        for ops in sorted(tables.values(), key=lambda ops: ops[0].kind != COPY):
            yield from self._runs(ops)

    def _runs(self, ops: list[Op]) -> Iterator[BatchStatement]:
        run: list[Op] = []
        keys: set[tuple] = set()  # updates of a recorded table in the run: none twice (unfolded)
        for op in ops:
            # shape[-1]: whether ops of that shape may share one multi-row statement.
            if run and (op.shape != run[0].shape or not op.shape[-1]
                        or (op.meta is not None and op.kind == UPDATE
                            and _key_of(op) in keys)):
                yield from self._emit(run)
                run = []
                keys.clear()
            run.append(op)
            if op.meta is not None and op.kind == UPDATE:
                keys.add(_key_of(op))
        if run:
            yield from self._emit(run)

    def _emit(self, run: list[Op]) -> Iterator[BatchStatement]:
        first = run[0]
        if first.kind == SQL_TEXT:
            yield BatchStatement(None, first.sql, [], [], None, savepoint=first.savepoint)
            return
        if first.kind == COPY:
            copy_run: Run = first.run  # type: ignore[assignment]
            assert first.mapping is not None
            if copy_run.rows >= COPY_MIN_ROWS:
                data = copy_binary_data(copy_run.data) if copy_run.binary else copy_run.data
                yield BatchStatement(None, _copy_sql(first.mapping, copy_run.binary), [], [],
                                     copy_run.rows, data)
            elif copy_run.rows:
                yield from self._short_run(first.mapping, copy_run)
            yield from self._run_feed(first.mapping, copy_run)
            return
        if first.kind == UPDATES or first.kind == DELETES:
            key_run: KeyRun = first.run  # type: ignore[assignment]
            assert first.mapping is not None
            if first.kind == DELETES and first.mapping.feed is not None and key_run.feed is not None:
                # One statement deletes and records each old row whole, as the ordinary path's.
                yield from feed_rows.run_deletes(first.mapping, key_run.feed, key_run.feed_rows,
                                                key_run.binary, self._sql)
                return
            yield from self._by_key(first)
            yield from self._run_feed(first.mapping, key_run)
            return
        if first.kind == FEED_ROWS:
            yield from feed_rows.feed_rows(first.run, self._sql,  # type: ignore[arg-type]
                                          self.change_rows_copy_min)
            return
        if first.kind == MOVED:
            yield feed_rows.moved(first, self._sql)
            return
        if first.kind == INSERT and len(run) >= COPY_MIN_ROWS:
            copy = self._copy(run)
            if copy is not None:
                yield copy
                return
        per_row = self._params_per_row(first) + (feed_rows.META_PARAMS if first.meta is not None else 0)
        for position, size in chunks(len(run), per_row):
            chunk = run[position:position + size]
            if first.meta is None:
                yield self._chunk(chunk)
            else:
                yield feed_rows.recorded(chunk, self._sql, self._guard)

    def _run_feed(self, mapping: RelationMapping, run: Run | KeyRun) -> list[BatchStatement]:
        """The change rows the lane kept in a recorded table's run."""
        if mapping.feed is None or run.feed is None or not run.feed_rows:
            return []
        return feed_rows.run_rows(mapping, run.feed, run.feed_rows, run.binary, self._sql,
                                 self.change_rows_copy_min)

    def _by_key(self, op: Op) -> Iterator[BatchStatement]:
        """A KeyRun as multi-row UPDATEs or DELETEs by key, shaped (and so prepared) as the
        ordinary path's updates of every column and deletes by key."""
        run: KeyRun = op.run  # type: ignore[assignment]
        mapping = op.mapping
        assert mapping is not None
        keys = mapping.key_positions
        relation_id = mapping.relation.relation_id
        if op.kind == UPDATES:
            shape: tuple = (UPDATE, relation_id, every_column(run.columns), NEW, keys, True, True)
            per_row = run.columns + len(keys)
        else:
            shape = (DELETE, relation_id, keys, True, True)
            per_row = len(keys)
        for position, size in chunks(len(run), per_row):
            values = run.params(position, position + size)
            sql = (self._update_text if op.kind == UPDATES else self._delete_text)(mapping, shape, size)
            yield BatchStatement((shape, size), sql, values, [int(run.binary)] * len(values), size)

    def _short_run(self, mapping: RelationMapping, run: Run) -> Iterator[BatchStatement]:
        """A run too short for a COPY as multi-row INSERTs, shaped (and so prepared) as the
        ordinary path's inserts of every column."""
        every = every_column(run.columns)
        width = run.columns
        every_value = copy_fields(run.data, run.binary, every)
        shape = (INSERT, mapping.relation.relation_id, every, True, True)
        for position, size in chunks(len(every_value) // width, width):
            values = every_value[position * width:(position + size) * width]
            sql_key = (shape, size)
            sql = self._sql.get(sql_key)
            if sql is None:
                sql = self._sql[sql_key] = _insert_sql(mapping, every, size)
            yield BatchStatement(sql_key, sql, values, [int(run.binary)] * len(values), size)

    @staticmethod
    def _copy(run: list[Op]) -> BatchStatement | None:
        """The run as one COPY, when every row has every column and all of them in one format
        (text, or binary for COPY binary)."""
        mapping = run[0].mapping
        assert mapping is not None
        if len(run[0].shape[2]) != len(mapping.target_columns):
            return None
        first = run[0].row
        assert first is not None
        binary = KIND_BINARY in first.kinds
        rows = []
        for op in run:
            row = op.row
            assert row is not None
            if not in_format(row.kinds, binary):
                return None
            rows.append(row.values)
        data = copy_binary_data(copy_binary(rows)) if binary else copy_text(rows)  # type: ignore[arg-type]
        return BatchStatement(None, _copy_sql(mapping, binary), [], [], len(rows), data)

    @staticmethod
    def _params_per_row(op: Op) -> int:
        shape = op.shape
        if op.kind == INSERT:
            return len(shape[2])
        if op.kind == UPDATE:
            return len(shape[2]) + len(shape[4])
        return len(shape[2])

    def _chunk(self, chunk: list[Op]) -> BatchStatement:
        first = chunk[0]
        mapping = first.mapping
        assert mapping is not None
        values: list[bytes | None] = []
        formats: list[int] = []
        rows = len(chunk)
        sql_key = (first.shape, rows)
        sql = self._sql.get(sql_key)
        if first.kind == INSERT:
            present = first.shape[2]
            for op in chunk:
                collect(op.row, present, values, formats)
            if sql is None:
                sql = self._sql[sql_key] = _insert_sql(mapping, present, rows)
        elif first.kind == UPDATE:
            _, _, assigned, source, key_positions, by_key, _ = first.shape
            for op in chunk:
                collect(op.row, assigned, values, formats)
                collect(op.old if source == OLD else op.row, key_positions, values, formats)
            if sql is None:
                sql = self._update_text(mapping, first.shape, rows)
        else:
            positions = first.shape[2]
            for op in chunk:
                collect(op.row, positions, values, formats)
            if sql is None:
                sql = self._delete_text(mapping, first.shape, rows)
        return BatchStatement(sql_key, sql, values, formats, rows)

    def _update_text(self, mapping: RelationMapping, shape: tuple, rows: int) -> str:
        sql_key = (shape, rows)
        sql = self._sql.get(sql_key)
        if sql is None:
            _, _, assigned, _, key_positions, by_key, _ = shape
            sql = _update_sql(mapping, assigned, key_positions, rows, by_key)
            if self._guard is not None:
                sql += " AND " + self._guard("t.xmin" if rows > 1 else "xmin")
            self._sql[sql_key] = sql
        return sql

    def _delete_text(self, mapping: RelationMapping, shape: tuple, rows: int) -> str:
        sql_key = (shape, rows)
        sql = self._sql.get(sql_key)
        if sql is None:
            _, _, positions, by_key, _ = shape
            sql = self._sql[sql_key] = _delete_sql(mapping, positions, rows, by_key)
        return sql


def _key_of(op: Op) -> tuple:
    """The key an update by key of a recorded table changes (to keep it once in a statement)."""
    _, _, _, source, key_positions, _, _ = op.shape
    row = op.old if source == OLD else op.row
    assert row is not None
    return tuple(row.values[i] for i in key_positions)


def _copy_sql(mapping: RelationMapping, binary: bool) -> str:
    """COPY of every mapped column, in the source's column order (rows carry all of them)."""
    return copy_sql(table(mapping), [column(mapping, i) for i in range(len(mapping.target_columns))],
                    binary)


def _insert_sql(mapping: RelationMapping, present: tuple[int, ...], rows: int) -> str:
    names = [mapping.target_columns[i].name for i in present]
    return sql.SQL("INSERT INTO {} ({}){} VALUES {}{}").format(
        table(mapping), sql.SQL(", ").join(column(mapping, i) for i in present),
        overriding(mapping, present), value_rows(mapping, present, rows),
        on_conflict(mapping, names)).as_string()


def _update_sql(mapping: RelationMapping, assigned: tuple[int, ...], key_positions: tuple[int, ...],
                rows: int, by_key: bool) -> str:
    if rows == 1:
        return update_sql(mapping, assigned, key_positions, by_key)
    columns = assigned + key_positions
    aliases = [sql.SQL(f"v{n}") for n in range(len(columns))]  # our own names: no quotes needed
    sets, conditions = assignments(mapping, assigned, lambda n, i: sql.SQL("v.{}").format(aliases[n]), "t")
    where = sql.SQL(" AND ").join([*(
        sql.SQL("t.{} = v.{}").format(column(mapping, i), aliases[len(assigned) + n])
        for n, i in enumerate(key_positions)), *conditions])
    return sql.SQL("UPDATE {} AS t SET {} FROM (VALUES {}) AS v({}) WHERE {}").format(
        table(mapping), sets, value_rows(mapping, columns, rows), sql.SQL(", ").join(aliases),
        where).as_string()


def _delete_sql(mapping: RelationMapping, positions: tuple[int, ...], rows: int, by_key: bool) -> str:
    if rows == 1:
        return delete_sql(mapping, positions, by_key)
    return delete_in_sql(mapping, positions, rows).as_string()
