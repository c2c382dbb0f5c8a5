"""The fast path's change rows (``--change-feed``): SQL and COPY data for a run of changes of a
table the change feed records.

Owns the statements that record a run's changes in the table's change table, each with the
same row count as the data it records, so the fast path's exact counts still hold:

* inserts: a second multi-row INSERT of the same values (each row preceded by its meta) into
  the change table, or, when the data went as one COPY, a second COPY in the same format;
* updates and deletes by key: one statement, ``WITH c AS (UPDATE t ... FROM (VALUES ...)`` (or
  ``DELETE FROM t USING (VALUES ...)``) ``RETURNING`` each row's meta from its VALUES row and the
  whole new (or old) row, ``INSERT INTO <change table> SELECT ... FROM c``;
* single-row statements (REPLICA IDENTITY FULL) wrapped the same way, the meta as parameters.

Must never record, fold or send anything (``batch`` records, ``batch_sql`` turns runs into
statements and calls this, the pipeline sends).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from psycopg import sql

from ..progress import feed as layout
from ..progress.feed import META_TYPES
from ..protocol.messages import TupleData
from .batch_ops import UPDATE, BatchStatement, Op, collect
from .copy import copy_binary, copy_binary_data, copy_text
from .feed import Meta, binary_meta, text_meta
from .mapping import RelationMapping
from .statements import OLD, column, delete_sql, placeholder, table, update_sql

__all__ = ["META_PARAMS", "insert_copy", "insert_rows_sql", "update_rows_sql", "delete_rows_sql",
           "single_sql", "recorded_inserts", "recorded", "moved"]

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


def insert_rows_sql(mapping: RelationMapping, present: tuple[int, ...], rows: int, op: str = "I") -> str:
    """``INSERT INTO <change table> VALUES (<meta>, <op>, <values>), ...``; parameters per row:
    the four meta values, then the values of ``present``."""
    change_table = mapping.feed
    assert change_table is not None
    width = len(present) + META_PARAMS
    groups = []
    for r in range(rows):
        base = r * width + 1
        groups.append(sql.SQL("({})").format(sql.SQL(", ").join(
            [*_meta(base), sql.Literal(op),
             *(placeholder(mapping, i, base + META_PARAMS + n) for n, i in enumerate(present))])))
    return sql.SQL("{} VALUES {}").format(layout.insert_prefix(change_table, _columns(mapping, present)),
                                         sql.SQL(", ").join(groups)).as_string()


def insert_copy(mapping: RelationMapping, rows: Sequence[tuple[Meta, TupleData]],
                binary: bool) -> tuple[str, bytes]:
    """A COPY of the change rows of inserts of every column, in the format of their values."""
    change_table = mapping.feed
    assert change_table is not None
    if binary:
        data = copy_binary_data(copy_binary([(*binary_meta(meta), b"I", *row.values)  # type: ignore[arg-type]
                                             for meta, row in rows]))
    else:
        data = copy_text([(*text_meta(meta), b"I", *row.values)  # type: ignore[arg-type]
                          for meta, row in rows])
    columns = [c.name for c in mapping.target_columns]
    return layout.copy_sql(change_table, columns, binary), data


def update_rows_sql(mapping: RelationMapping, assigned: tuple[int, ...],
                    key_positions: tuple[int, ...], rows: int, guard: str | None) -> str:
    """``rows`` updates by key recording their change rows; parameters per row: the assigned
    values, the key values, the four meta values."""
    change_table = mapping.feed
    assert change_table is not None
    positions = assigned + key_positions
    aliases = [sql.SQL(f"v{n}") for n in range(len(positions))]
    metas = [sql.SQL(f"m{n}") for n in range(META_PARAMS)]
    sets = sql.SQL(", ").join(sql.SQL("{} = v.{}").format(column(mapping, i), aliases[n])
                              for n, i in enumerate(assigned))
    where = sql.SQL(" AND ").join(
        sql.SQL("t.{} = v.{}").format(column(mapping, i), aliases[len(assigned) + n])
        for n, i in enumerate(key_positions))
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
    the four meta values."""
    change_table = mapping.feed
    assert change_table is not None
    aliases = [sql.SQL(f"v{n}") for n in range(len(positions))]
    metas = [sql.SQL(f"m{n}") for n in range(META_PARAMS)]
    where = sql.SQL(" AND ").join(sql.SQL("t.{} = v.{}").format(column(mapping, i), aliases[n])
                                  for n, i in enumerate(positions))
    columns = [c.name for c in mapping.target_columns]
    data = sql.SQL("DELETE FROM {} AS t USING (VALUES {}) AS v({}) WHERE {}{}").format(
        table(mapping), _values(mapping, positions, rows),
        sql.SQL(", ").join([*aliases, *metas]), where,
        layout.returning([sql.SQL(f"v.m{n}") for n in range(META_PARAMS)], columns, "t"))
    return layout.wrap_sql(change_table, data, columns, "D")


def single_sql(mapping: RelationMapping, data_sql: str, params: int, op: str) -> str:
    """A single-row UPDATE or DELETE (``data_sql``, ``params`` parameters) recording its change
    row; the four meta values follow its parameters."""
    change_table = mapping.feed
    assert change_table is not None
    columns = [c.name for c in mapping.target_columns]
    return layout.wrap_sql(change_table, sql.SQL("{}{}").format(
        sql.SQL(data_sql), layout.returning(_meta(params + 1), columns)), columns, op)


# -- runs of ops (batch_sql.Emitter) ----------------------------------------------------------------

def recorded_inserts(chunk: list[Op], cache: dict[tuple, str]) -> BatchStatement:
    """The change rows of a chunk of inserts: the same values, each row after its meta."""
    first = chunk[0]
    mapping = first.mapping
    assert mapping is not None
    present = first.shape[2]
    values: list[bytes | None] = []
    formats: list[int] = []
    for op in chunk:
        values.extend(text_meta(op.meta))  # type: ignore[arg-type]
        formats.extend((0, 0, 0, 0))
        collect(op.row, present, values, formats)
    key = (first.shape, len(chunk), "feed")
    text = cache.get(key)
    if text is None:
        text = cache[key] = insert_rows_sql(mapping, present, len(chunk))
    return BatchStatement(key, text, values, formats, len(chunk))


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
    """The change row of the delete of the key an update moved its row from."""
    mapping = op.mapping
    assert mapping is not None and op.meta is not None
    positions = op.shape[2]
    values: list[bytes | None] = text_meta(op.meta)
    formats = [0, 0, 0, 0]
    collect(op.row, positions, values, formats)
    key = (op.shape, 1, "feed")
    text = cache.get(key)
    if text is None:
        text = cache[key] = insert_rows_sql(mapping, positions, 1, "D")
    return BatchStatement(key, text, values, formats, 1)
