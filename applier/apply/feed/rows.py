"""The fast path's change rows (``--change-feed``): SQL and COPY data for a run of changes of a
table the change feed records.

Owns the statements that record changes in a table's change table, each with an exact row
count, so the fast path's checks still hold:

* change rows written from the values the source sent (``FeedRows``: inserts, updates of every
  column, old keys of moved rows), each after its meta: one COPY per table and value format from
  ``COPY_MIN_ROWS`` rows on (from one row on while ``feed.spool`` holds them back), else
  multi-row INSERTs; likewise the change rows the lane kept in a
  run (``run_rows``: COPY data already, meta included);
* updates and deletes recorded from the target's rows: one statement, ``WITH c AS (UPDATE t ...
  FROM (VALUES ...)`` ``RETURNING`` each row's meta from its VALUES row and the whole new row,
  ``INSERT INTO <change table> SELECT ... FROM c``, whose row count is the data's (deletes: ``WITH
  c AS (DELETE FROM t WHERE (key) IN (...) RETURNING <old row>)``, each old row joined to the
  VALUES row of its key for its meta); single-row statements (REPLICA IDENTITY FULL) wrapped the
  same way, the meta as parameters.

Must never record, fold or send anything (``batch`` records, ``fast.sql`` turns runs into
statements and calls this, the pipeline sends).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from psycopg import sql

from ...progress import feed as layout
from ...progress.feed import META_TYPES
from ...protocol.messages import KIND_BINARY
from ..copy import copy_binary, copy_binary_data, copy_binary_rows, copy_fields, copy_text, copy_text_rows
from ..fast.ops import (
    COPY_MIN_ROWS,
    FORMATS,
    UPDATE,
    BatchStatement,
    ChangeRowsCopy,
    FeedRows,
    Op,
    chunks,
    collect,
)
from ..mapping import RelationMapping
from ..statements import OLD, assignments, column, delete_in_sql, delete_sql, placeholder, table, update_sql
from .meta import binary_meta, text_meta

__all__ = ["META_PARAMS", "feed_rows", "run_rows", "run_deletes", "rows_sql", "update_rows_sql",
           "delete_rows_sql", "single_sql", "recorded", "moved"]

#: Parameters of a change row's meta (commit LSN, time, xid, order; the op is a literal).
META_PARAMS = 4


def _meta(number: int) -> list[sql.Composable]:
    return [sql.SQL("${}::{}").format(sql.SQL(str(number + i)), sql.SQL(kind))
            for i, kind in enumerate(META_TYPES[:META_PARAMS])]


def _columns(mapping: RelationMapping, positions: Sequence[int]) -> list[str]:
    return [mapping.target_columns[i].name for i in positions]


def _values(mapping: RelationMapping, positions: Sequence[int], rows: int) -> sql.Composable:
    """``(<values of positions>, <meta>), ...`` numbered from $1, each parameter cast by its type."""
    width = len(positions) + META_PARAMS
    groups = []
    for r in range(rows):
        base = r * width + 1
        values = [*(placeholder(mapping, i, base + n) for n, i in enumerate(positions)),
                  *_meta(base + len(positions))]
        groups.append(sql.SQL("({})").format(sql.SQL(", ").join(values)))
    return sql.SQL(", ").join(groups)


def rows_sql(mapping: RelationMapping, positions: tuple[int, ...], rows: int) -> str:
    """``INSERT INTO <change table> VALUES (<meta>, <op>, <values>), ...``; parameters per row:
    the four meta values, the op, then the values of ``positions``."""
    change_table = mapping.feed
    assert change_table is not None
    width = len(positions) + META_PARAMS + 1
    groups = []
    for r in range(rows):
        base = r * width + 1
        groups.append(sql.SQL("({})").format(sql.SQL(", ").join(
            [*_meta(base), sql.SQL("${}::{}").format(sql.SQL(str(base + META_PARAMS)),
                                                     sql.SQL(META_TYPES[META_PARAMS])),
             *(placeholder(mapping, i, base + META_PARAMS + 1 + n) for n, i in enumerate(positions))])))
    return sql.SQL("{} VALUES {}").format(layout.insert_prefix(change_table, _columns(mapping, positions)),
                                         sql.SQL(", ").join(groups)).as_string()


def feed_rows(rows: FeedRows, cache: dict[tuple, str], copy_min: int = COPY_MIN_ROWS) -> list[BatchStatement]:
    """Change rows written from the values the source sent, every column of each: a COPY per
    value format from ``copy_min`` rows on, else multi-row INSERTs."""
    mapping = rows.mapping
    change_table = mapping.feed
    assert change_table is not None
    statements = []
    binary = [r for r in rows.rows if KIND_BINARY in r[2].kinds]
    text = [r for r in rows.rows if KIND_BINARY not in r[2].kinds] if binary else rows.rows
    columns = [c.name for c in mapping.target_columns]
    for group, is_binary in ((text, False), (binary, True)):
        if len(group) >= copy_min:
            if is_binary:
                data = copy_binary_data(copy_binary([(*binary_meta(meta), op.encode(), *row.values)  # type: ignore[arg-type]
                                                     for meta, op, row in group]))
            else:
                data = copy_text([(*text_meta(meta), op.encode(), *row.values)  # type: ignore[arg-type]
                                  for meta, op, row in group])
            statements.append(BatchStatement(None, layout.copy_sql(change_table, columns, is_binary),
                                             [], [], len(group), data,
                                             ChangeRowsCopy(change_table, is_binary)))
            continue
        statements.extend(_inserts(mapping, [
            ([*text_meta(meta), op.encode(), *row.values],  # type: ignore[list-item]
             [0, 0, 0, 0, 0, *row.kinds.translate(FORMATS)]) for meta, op, row in group], cache))
    return statements


def run_rows(mapping: RelationMapping, data: bytes | bytearray, rows: int, binary: bool,
             cache: dict[tuple, str], copy_min: int = COPY_MIN_ROWS) -> list[BatchStatement]:
    """The change rows the lane kept in a run (COPY text lines or binary tuples, each its meta
    then every column): one COPY from ``copy_min`` rows on, else multi-row INSERTs."""
    change_table = mapping.feed
    assert change_table is not None
    if rows >= copy_min:
        columns = [c.name for c in mapping.target_columns]
        return [BatchStatement(None, layout.copy_sql(change_table, columns, binary), [], [], rows,
                               copy_binary_data(data) if binary else data,
                               ChangeRowsCopy(change_table, binary))]
    values = copy_binary_rows(data) if binary else copy_text_rows(data)
    return _inserts(mapping, [(list(row), [int(binary)] * len(row)) for row in values], cache)


def run_deletes(mapping: RelationMapping, data: bytes | bytearray, rows: int, binary: bool,
                cache: dict[tuple, str]) -> list[BatchStatement]:
    """The deletes the lane kept as change rows in a run (meta, then the key's columns): deleted
    by key and recorded from the target's old rows, as ``recorded`` does for the ordinary path's."""
    keys = mapping.key_positions
    width = len(keys) + META_PARAMS
    # Each change row is its meta, its op, then the key's columns: the parameters are the key's
    # values, then the meta.
    values = copy_fields(data, binary, tuple(META_PARAMS + 1 + i for i in keys) + tuple(range(META_PARAMS)))
    assert len(values) == rows * width
    statements = []
    for position, size in chunks(rows, width):
        params = values[position * width:(position + size) * width]
        key = (("feed deletes", mapping.relation.relation_id), size)
        text = cache.get(key)
        if text is None:
            text = cache[key] = delete_rows_sql(mapping, keys, size)
        statements.append(BatchStatement(key, text, params, [int(binary)] * len(params), size))
    return statements


def _inserts(mapping: RelationMapping, rows: list[tuple[list[bytes | None], list[int]]],
             cache: dict[tuple, str]) -> list[BatchStatement]:
    """Change rows (each its values, meta first, and their formats) as multi-row INSERTs."""
    every = tuple(range(len(mapping.target_columns)))
    statements = []
    for position, size in chunks(len(rows), len(every) + META_PARAMS + 1):
        values: list[bytes | None] = []
        formats: list[int] = []
        for row_values, row_formats in rows[position:position + size]:
            values.extend(row_values)
            formats.extend(row_formats)
        key = (("feed rows", mapping.relation.relation_id), size)
        statement = cache.get(key)
        if statement is None:
            statement = cache[key] = rows_sql(mapping, every, size)
        statements.append(BatchStatement(key, statement, values, formats, size))
    return statements


def update_rows_sql(mapping: RelationMapping, assigned: tuple[int, ...],
                    key_positions: tuple[int, ...], rows: int, guard: str | None) -> str:
    """``rows`` updates by key recording their change rows; parameters per row: the assigned
    values, the key values, the four meta values."""
    change_table = mapping.feed
    assert change_table is not None
    positions = assigned + key_positions
    aliases = [sql.SQL(f"v{n}") for n in range(len(positions))]
    metas = [sql.SQL(f"m{n}") for n in range(META_PARAMS)]
    sets, conditions = assignments(mapping, assigned, lambda n, i: sql.SQL("v.{}").format(aliases[n]), "t")
    where = sql.SQL(" AND ").join([*(
        sql.SQL("t.{} = v.{}").format(column(mapping, i), aliases[len(assigned) + n])
        for n, i in enumerate(key_positions)), *conditions])
    if guard:
        where = sql.SQL("{} AND {}").format(where, sql.SQL(guard))
    columns = [c.name for c in mapping.target_columns]
    data = sql.SQL("UPDATE {} AS t SET {} FROM (VALUES {}) AS v({}) WHERE {}{}").format(
        table(mapping), sets, _values(mapping, positions, rows),
        sql.SQL(", ").join([*aliases, *metas]), where,
        layout.returning([sql.SQL(f"v.m{n}") for n in range(META_PARAMS)], columns, "t"))
    return layout.wrap_sql(change_table, data, columns, "U")


def delete_rows_sql(mapping: RelationMapping, positions: tuple[int, ...], rows: int) -> str:
    """``rows`` deletes by key recording the whole old rows; parameters per row: the key values,
    the four meta values.

    The rows go by ``(key) IN (...)``, as without the feed: one index scan finds every key,
    where deleting through a join with the VALUES rows descended the index once per key and
    cost the target about twice as much. Each returned old row then takes its meta from the
    VALUES row of its key, joined in memory, and the change rows are written only if exactly
    ``rows`` rows were deleted: a missing row, or two keys that are one row on the target, give
    the statement a count of 0 and the batch goes the careful way, as a plain delete's would."""
    change_table = mapping.feed
    assert change_table is not None
    width = len(positions) + META_PARAMS
    aliases = [sql.SQL(f"v{n}") for n in range(len(positions))]
    metas = [sql.SQL(f"m{n}") for n in range(META_PARAMS)]
    columns = [c.name for c in mapping.target_columns]
    on = sql.SQL(" AND ").join(sql.SQL("c.{} = v.{}").format(column(mapping, i), aliases[n])
                               for n, i in enumerate(positions))
    return sql.SQL("WITH applier_changed AS ({}{}) {} SELECT {}, {}, {} FROM applier_changed AS c "
                   "JOIN (VALUES {}) AS v({}) ON {} "
                   "WHERE (SELECT pg_catalog.count(*) FROM applier_changed) = {}").format(
        delete_in_sql(mapping, positions, rows, width), layout.returning([], columns),
        layout.insert_prefix(change_table, columns),
        sql.SQL(", ").join(sql.SQL("v.{}").format(m) for m in metas), sql.Literal("D"),
        sql.SQL(", ").join(sql.Identifier("c", name) for name in columns),
        _values(mapping, positions, rows), sql.SQL(", ").join([*aliases, *metas]), on,
        sql.Literal(rows)).as_string()


def single_sql(mapping: RelationMapping, data_sql: str, params: int, op: str) -> str:
    """A single-row UPDATE or DELETE (``data_sql``, ``params`` parameters) recording its change
    row; the four meta values follow its parameters."""
    change_table = mapping.feed
    assert change_table is not None
    columns = [c.name for c in mapping.target_columns]
    return layout.wrap_sql(change_table, sql.SQL("{}{}").format(
        sql.SQL(data_sql), layout.returning(_meta(params + 1), columns)), columns, op)


# -- runs of ops (fast.sql.Emitter) ----------------------------------------------------------------

def recorded(chunk: list[Op], cache: dict[tuple, str],
             guard: Callable[[str], str] | None) -> BatchStatement:
    """Updates or deletes of a recorded table, the statement writing their change rows."""
    first = chunk[0]
    mapping = first.mapping
    assert mapping is not None
    rows = len(chunk)
    values: list[bytes | None] = []
    formats: list[int] = []
    key = (first.shape, rows, "feed")
    text = cache.get(key)
    if first.kind == UPDATE:
        _, _, assigned, source, key_positions, by_key, _ = first.shape
        for op in chunk:
            collect(op.row, assigned, values, formats)
            collect(op.old if source == OLD else op.row, key_positions, values, formats)
            values.extend(text_meta(op.meta))  # type: ignore[arg-type]
            formats.extend((0, 0, 0, 0))
        if text is None:
            test = guard("t.xmin" if by_key else "xmin") if guard else None
            if by_key:
                text = update_rows_sql(mapping, assigned, key_positions, rows, test)
            else:
                data = update_sql(mapping, assigned, key_positions, False)
                text = single_sql(mapping, data + (f" AND {test}" if test else ""),
                                  len(assigned) + len(key_positions), "U")
            cache[key] = text
    else:
        _, _, positions, by_key, _ = first.shape
        for op in chunk:
            collect(op.row, positions, values, formats)
            values.extend(text_meta(op.meta))  # type: ignore[arg-type]
            formats.extend((0, 0, 0, 0))
        if text is None:
            text = cache[key] = (delete_rows_sql(mapping, positions, rows) if by_key else
                                 single_sql(mapping, delete_sql(mapping, positions, False),
                                            len(positions), "D"))
    return BatchStatement(key, text, values, formats, rows)


def moved(op: Op, cache: dict[tuple, str]) -> BatchStatement:
    """The change row of the delete of the key an update moved its row from (the columns sent)."""
    mapping = op.mapping
    assert mapping is not None and op.meta is not None
    positions = op.shape[2]
    values: list[bytes | None] = [*text_meta(op.meta), b"D"]
    formats = [0, 0, 0, 0, 0]
    collect(op.row, positions, values, formats)
    key = (op.shape, 1, "feed")
    text = cache.get(key)
    if text is None:
        text = cache[key] = rows_sql(mapping, positions, 1)
    return BatchStatement(key, text, values, formats, 1)
