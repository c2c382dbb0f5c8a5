"""The fast apply path: row changes of one or more source transactions, folded and sent in bulk.

Owns turning a sequence of row changes into few statements with a known outcome:
- repeated updates of one row within the batch are folded into the last one (the earlier ones
  are overwritten anyway; only a superset of their columns may replace them, and never across a
  key change, a delete or a truncate of that table);
- an insert followed by updates of the same row becomes one insert of the final row;
- the changes of independent tables are gathered per table (see ``statements``);
- runs of inserts (same table, same columns) become one COPY (``copy.py``) when long and all in
  one format (text, or binary: COPY binary), else multi-row INSERTs; runs of deletes by key one
  ``DELETE ... WHERE (key) IN (...)``, runs of updates by key one ``UPDATE ... FROM (VALUES ...)``;
- an independent table may also hold an open *run* (the lane, ``lane.py``, writes into it
  straight from the received payloads): inserts as COPY text or binary (``Run``), or updates of
  every column or deletes, by key and folded by key (``KeyRun``), each run in one value format. It is sent where it began, as one
  COPY or as multi-row UPDATEs or DELETEs, so a change that must follow its rows (another kind
  of change of that table, a barrier) closes it first;
- every statement carries the exact number of rows it must affect. With the idempotent policy a
  conflict (an existing key on insert, a missing row on update or delete) shows up as a different
  count (a COPY meeting an existing key fails with a unique violation instead); the caller then
  rolls the batch back and redoes that stretch on the careful, row-by-row path, which resolves,
  counts and logs each conflict.

Must never send anything itself (the pipeline does) or decide batch boundaries (the sink does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import Protocol

from ..protocol.messages import KIND_BINARY, KIND_TEXT, KIND_UNCHANGED, TupleData
from .copy import copy_binary, copy_binary_data, copy_sql, copy_text
from .relations import RelationMapping, quote_ident
from .statements import NEW, OLD, delete_sql, update_sql

__all__ = ["Batch", "BatchStatement"]

_INSERT, _UPDATE, _DELETE, _SQL, _COPY, _UPDATES, _DELETES = 0, 1, 2, 3, 4, 5, 6
#: A run's kind (the type byte of the changes it takes) -> its op kind.
_RUN_OPS = {"I": _COPY, "U": _UPDATES, "D": _DELETES}
#: Rows per multi-row statement: a small ladder keeps the number of prepared shapes small.
_LADDER = (1000, 100, 10, 1)
_MAX_PARAMS = 65_000
#: Runs of inserts at least this long go as one COPY: below it, leaving pipeline mode for the
#: COPY (one more round trip) costs more than the statements it replaces.
COPY_MIN_ROWS = 200


@dataclass(slots=True)
class _Op:
    kind: int
    mapping: RelationMapping | None
    row: TupleData | None          # new row (insert, update) or old row (delete)
    old: TupleData | None          # update: the old key/row when sent
    shape: tuple                   # what makes two ops share one statement
    sql: str = ""                  # _SQL ops: a statement sent as is (TRUNCATE)
    run: "Run | KeyRun | None" = None  # _COPY, _UPDATES and _DELETES ops: the run


@dataclass(slots=True)
class BatchStatement:
    """One statement to send: a cache key for its prepared form, SQL, values and the row count."""

    cache_key: tuple | None        # None: send unprepared (rare statements, COPY)
    sql: str
    values: list[bytes | None]
    formats: list[int]
    expected_rows: int | None
    copy_data: bytes | bytearray | None = None  # COPY ... FROM STDIN: its data (text or binary)


_ALL_COLUMNS: dict[int, tuple[int, ...]] = {}
#: Column kind bytes -> parameter formats (b -> 1 binary; t, n -> 0 text), one C call per row.
_FORMATS = bytes(1 if i == KIND_BINARY else 0 for i in range(256))


def _every_column(width: int) -> tuple[int, ...]:
    every = _ALL_COLUMNS.get(width)
    if every is None:
        every = _ALL_COLUMNS[width] = tuple(range(width))
    return every


def _in_format(kinds: bytes, binary: bool) -> bool:
    """Every value of a row is in the given format (binary, else text) or NULL, none unchanged."""
    return KIND_UNCHANGED not in kinds and (KIND_TEXT if binary else KIND_BINARY) not in kinds


def _present(row: TupleData) -> tuple[int, ...]:
    kinds = row.kinds
    if KIND_UNCHANGED not in kinds:  # the common case: every column was sent
        return _every_column(len(kinds))
    return tuple(i for i, kind in enumerate(kinds) if kind != KIND_UNCHANGED)


class Run(Protocol):
    """Inserts into one table as COPY text lines or (``binary``) COPY binary tuples, each with every
    column (``_lane.Run``)."""

    data: bytearray
    columns: int
    rows: int
    binary: bool


class KeyRun(Protocol):
    """Updates of every column (``whole_rows``) or deletes of one table by its key, folded by key
    (``_lane.KeyRun``), values in text or (``binary``) binary; ``len()`` is the rows they change."""

    columns: int
    keys: tuple[int, ...]
    whole_rows: bool
    binary: bool
    changes: int

    def __len__(self) -> int: ...

    def add(self, values: tuple[bytes | None, ...]) -> None: ...

    def params(self, start: int, stop: int) -> list[bytes | None]: ...


class Batch:
    def __init__(self, guard: Callable[[str], str] | None = None) -> None:
        # With update_origin_differs detection: ``guard(xmin)`` is the SQL test that this worker
        # wrote the row last; updates carry it, so another origin's row changes no row and the
        # count differs.
        self._guard = guard
        self._ops: list[_Op | None] = []
        self._last: dict[tuple, int] = {}    # (relation id, key values) -> index of its op
        self._key_getters: dict[int, Callable[[tuple], object]] = {}
        self._sql: dict[tuple, str] = {}     # (shape, rows) -> statement text
        #: Open runs by relation id; the lane holds this very dict, so it is only ever changed
        #: in place. ``_open`` has their ops.
        self.runs: dict[int, Run | KeyRun] = {}
        self._open: dict[int, _Op] = {}
        self.rows = 0
        self.inserts = 0  # of ``rows``: parts are cut by inserts and by other rows apart
        self.bytes = 0

    def __bool__(self) -> bool:
        return bool(self._ops)

    def clear(self) -> None:
        self._ops.clear()
        self._last.clear()
        self._close_every_run()
        self.rows = self.inserts = self.bytes = 0

    def forget(self, relation_id: int) -> None:
        """A relation's definition changed: drop what was derived from the old one."""
        self._key_getters.pop(relation_id, None)
        self._close_run(relation_id)
        self._sql = {k: v for k, v in self._sql.items() if k[0][1] != relation_id}

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
        kind = _RUN_OPS[kind]
        op = _Op(kind, mapping, None, None, (kind, relation_id, False), run=run)
        self._open[relation_id] = op
        self.runs[relation_id] = run
        self._ops.append(op)

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

    def insert(self, mapping: RelationMapping, new: TupleData) -> None:
        self._count(new)
        self.inserts += 1
        if self._open:
            op = self._open.get(mapping.relation.relation_id)
            if op is not None and op.kind == _COPY:
                run: Run = op.run  # type: ignore[assignment]
                if _in_format(new.kinds, run.binary):
                    encode = copy_binary if run.binary else copy_text
                    run.data.extend(encode([new.values]))  # type: ignore[list-item]
                    run.rows += 1
                    return
            self._close_runs(mapping)
        present = _present(new)
        op = _Op(_INSERT, mapping, new, None, (_INSERT, mapping.relation.relation_id, present, True, True))
        if mapping.key_positions and not mapping.full_identity:
            self._last[self._key(mapping, new)] = len(self._ops)
        self._ops.append(op)

    def update(self, mapping: RelationMapping, new: TupleData, old: TupleData | None) -> None:
        self._count(new)
        if self._open:
            op = self._open.get(mapping.relation.relation_id)
            if (op is not None and op.kind == _UPDATES and old is None
                    and _in_format(new.kinds, op.run.binary)):  # type: ignore[union-attr]
                op.run.add(new.values)  # type: ignore[union-attr, arg-type]
                return
            self._close_runs(mapping)
        assigned = _present(new)
        relation_id = mapping.relation.relation_id
        if mapping.full_identity or not mapping.key_positions or old is not None:
            # No key to fold on, or the key itself changed (the server sent the old key): this
            # change stands alone and ends folding for both keys.
            if old is not None and mapping.key_positions and not mapping.full_identity:
                self._last.pop(self._key(mapping, old), None)
                self._last.pop(self._key(mapping, new), None)
            by_key = not mapping.full_identity
            match = mapping.key_positions if by_key else _present(old)  # FULL always sends the old row
            source = OLD if old is not None else NEW
            self._ops.append(_Op(_UPDATE, mapping, new, old,
                                 (_UPDATE, relation_id, assigned, source, match, by_key, False)))
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
                    or set(_present(previous.row)) <= set(assigned)):
                if previous.kind == _INSERT and len(assigned) == len(new.kinds):
                    # Insert then update: insert the final row instead.
                    previous.row = new
                    previous.shape = (_INSERT, relation_id, assigned, True, True)
                    return
                if previous.kind == _UPDATE:
                    ops[previous_index] = None  # overwritten by this one
        self._last[key] = len(ops)
        ops.append(_Op(_UPDATE, mapping, new, None,
                       (_UPDATE, relation_id, assigned, NEW, mapping.key_positions, True, True)))

    def delete(self, mapping: RelationMapping, old: TupleData) -> None:
        self._count(old)
        if self._open:
            op = self._open.get(mapping.relation.relation_id)
            if (op is not None and op.kind == _DELETES
                    and _in_format(old.kinds, op.run.binary)):  # type: ignore[union-attr]
                op.run.add(old.values)  # type: ignore[union-attr, arg-type]
                return
            self._close_runs(mapping)
        relation_id = mapping.relation.relation_id
        if mapping.full_identity:
            self._ops.append(_Op(_DELETE, mapping, old, None,
                                 (_DELETE, relation_id, _present(old), False, False)))
            return
        self._last.pop(self._key(mapping, old), None)
        self._ops.append(_Op(_DELETE, mapping, old, None,
                             (_DELETE, relation_id, mapping.key_positions, True, True)))

    def statement(self, sql: str) -> None:
        """A statement that must run in order and ends all folding (TRUNCATE)."""
        self._last.clear()
        self._close_every_run()
        self._ops.append(_Op(_SQL, None, None, None, (_SQL, False), sql))

    # -- emitting -------------------------------------------------------------------------------
    def statements(self) -> Iterator[BatchStatement]:
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
        tables: dict[int, list[_Op]] = {}  # independent tables' changes, per table
        in_order: list[_Op] = []            # other changes, since the last independent one
        for op in self._ops:
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

    def _gathered(self, tables: dict[int, list[_Op]]) -> Iterator[BatchStatement]:
        for ops in sorted(tables.values(), key=lambda ops: ops[0].kind != _COPY):
            yield from self._runs(ops)

    def _runs(self, ops: list[_Op]) -> Iterator[BatchStatement]:
        run: list[_Op] = []
        for op in ops:
            # shape[-1]: whether ops of that shape may share one multi-row statement.
            if run and (op.shape != run[0].shape or not op.shape[-1]):
                yield from self._emit(run)
                run = []
            run.append(op)
        if run:
            yield from self._emit(run)

    def _emit(self, run: list[_Op]) -> Iterator[BatchStatement]:
        first = run[0]
        if first.kind == _SQL:
            yield BatchStatement(None, first.sql, [], [], None)
            return
        if first.kind == _COPY:
            copy_run: Run = first.run  # type: ignore[assignment]
            assert first.mapping is not None
            if copy_run.rows:
                data = copy_binary_data(copy_run.data) if copy_run.binary else copy_run.data
                yield BatchStatement(None, _copy_sql(first.mapping, copy_run.binary), [], [],
                                     copy_run.rows, data)
            return
        if first.kind == _UPDATES or first.kind == _DELETES:
            yield from self._by_key(first)
            return
        if first.kind == _INSERT and len(run) >= COPY_MIN_ROWS:
            copy = self._copy(run)
            if copy is not None:
                yield copy
                return
        for position, size in _chunks(len(run), self._params_per_row(first)):
            yield self._chunk(run[position:position + size])

    def _by_key(self, op: _Op) -> Iterator[BatchStatement]:
        """A KeyRun as multi-row UPDATEs or DELETEs by key, shaped (and so prepared) as the
        ordinary path's updates of every column and deletes by key."""
        run: KeyRun = op.run  # type: ignore[assignment]
        mapping = op.mapping
        assert mapping is not None
        keys = mapping.key_positions
        relation_id = mapping.relation.relation_id
        if op.kind == _UPDATES:
            shape: tuple = (_UPDATE, relation_id, _every_column(run.columns), NEW, keys, True, True)
            per_row = run.columns + len(keys)
        else:
            shape = (_DELETE, relation_id, keys, True, True)
            per_row = len(keys)
        for position, size in _chunks(len(run), per_row):
            values = run.params(position, position + size)
            sql = (self._update_text if op.kind == _UPDATES else self._delete_text)(mapping, shape, size)
            yield BatchStatement((shape, size), sql, values, [int(run.binary)] * len(values), size)

    @staticmethod
    def _copy(run: list[_Op]) -> BatchStatement | None:
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
            if not _in_format(row.kinds, binary):
                return None
            rows.append(row.values)
        data = copy_binary_data(copy_binary(rows)) if binary else copy_text(rows)  # type: ignore[arg-type]
        return BatchStatement(None, _copy_sql(mapping, binary), [], [], len(rows), data)

    @staticmethod
    def _params_per_row(op: _Op) -> int:
        shape = op.shape
        if op.kind == _INSERT:
            return len(shape[2])
        if op.kind == _UPDATE:
            return len(shape[2]) + len(shape[4])
        return len(shape[2])

    def _chunk(self, chunk: list[_Op]) -> BatchStatement:
        first = chunk[0]
        mapping = first.mapping
        assert mapping is not None
        values: list[bytes | None] = []
        formats: list[int] = []
        rows = len(chunk)
        sql_key = (first.shape, rows)
        sql = self._sql.get(sql_key)
        if first.kind == _INSERT:
            present = first.shape[2]
            for op in chunk:
                _collect(op.row, present, values, formats)
            if sql is None:
                sql = self._sql[sql_key] = _insert_sql(mapping, present, rows)
        elif first.kind == _UPDATE:
            _, _, assigned, source, key_positions, by_key, _ = first.shape
            for op in chunk:
                _collect(op.row, assigned, values, formats)
                _collect(op.old if source == OLD else op.row, key_positions, values, formats)
            if sql is None:
                sql = self._update_text(mapping, first.shape, rows)
        else:
            positions = first.shape[2]
            for op in chunk:
                _collect(op.row, positions, values, formats)
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


def _chunks(count: int, per_row: int) -> Iterator[tuple[int, int]]:
    """(position, size) of the multi-row statements for ``count`` rows: the largest ladder step
    that fits, under PostgreSQL's limit on parameters per statement."""
    largest = max(1, min(_LADDER[0], _MAX_PARAMS // max(per_row, 1)))
    position = 0
    while position < count:
        size = next(step for step in (largest, *_LADDER) if step <= largest and step <= count - position)
        yield position, size
        position += size


def _copy_sql(mapping: RelationMapping, binary: bool) -> str:
    """COPY of every mapped column, in the source's column order (rows carry all of them)."""
    return copy_sql(mapping.table.sql_name, [quote_ident(column.name) for column in mapping.target_columns],
                    binary)


def _collect(row: TupleData | None, positions: tuple[int, ...], values: list[bytes | None],
             formats: list[int]) -> None:
    assert row is not None
    row_values, kinds = row.values, row.kinds
    if len(positions) == len(row_values):  # every column, in order
        values.extend(row_values)  # type: ignore[arg-type]
        formats.extend(kinds.translate(_FORMATS))
        return
    for i in positions:
        values.append(row_values[i])  # type: ignore[arg-type]
        formats.append(1 if kinds[i] == KIND_BINARY else 0)


def _cast(mapping: RelationMapping, position: int, number: int) -> str:
    return f"${number}::{mapping.target_columns[position].type_sql}"


def _rows_of(mapping: RelationMapping, positions: tuple[int, ...], rows: int) -> str:
    width = len(positions)
    return ", ".join(
        "(" + ", ".join(_cast(mapping, i, r * width + n) for n, i in enumerate(positions, 1)) + ")"
        for r in range(rows))


def _insert_sql(mapping: RelationMapping, present: tuple[int, ...], rows: int) -> str:
    table = mapping.table
    names = [mapping.target_columns[i].name for i in present]
    sql = (f"INSERT INTO {table.sql_name} ({', '.join(map(quote_ident, names))}) "
           f"VALUES {_rows_of(mapping, present, rows)}")
    if table.unique_key and set(table.unique_key) <= set(names):
        sql += f" ON CONFLICT ({', '.join(map(quote_ident, table.unique_key))}) DO NOTHING"
    return sql


def _update_sql(mapping: RelationMapping, assigned: tuple[int, ...], key_positions: tuple[int, ...],
                rows: int, by_key: bool) -> str:
    table = mapping.table
    if rows == 1:
        return update_sql(mapping, assigned, key_positions, by_key)
    columns = assigned + key_positions
    aliases = [f"v{n}" for n in range(len(columns))]
    sets = ", ".join(f"{quote_ident(mapping.target_columns[i].name)} = v.{aliases[n]}"
                     for n, i in enumerate(assigned))
    where = " AND ".join(f"t.{quote_ident(mapping.target_columns[i].name)} = v.{aliases[len(assigned) + n]}"
                         for n, i in enumerate(key_positions))
    return (f"UPDATE {table.sql_name} AS t SET {sets} FROM (VALUES {_rows_of(mapping, columns, rows)}) "
            f"AS v({', '.join(aliases)}) WHERE {where}")


def _delete_sql(mapping: RelationMapping, positions: tuple[int, ...], rows: int, by_key: bool) -> str:
    if rows == 1:
        return delete_sql(mapping, positions, by_key)
    table = mapping.table
    keys = ", ".join(quote_ident(mapping.target_columns[i].name) for i in positions)
    return f"DELETE FROM {table.sql_name} WHERE ({keys}) IN ({_rows_of(mapping, positions, rows)})"
