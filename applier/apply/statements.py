"""SQL for each row shape, built once per (relation, operation, columns present) and cached.

Every value is a parameter sent in the format it arrived in (text or binary) and cast by the
target column's type; no value is ever spliced into SQL, every identifier is quoted. A statement
records where each parameter comes from, so applying a row is a tuple lookup, not SQL building.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from .relations import RelationMapping, quote_ident

__all__ = ["Statement", "NEW", "OLD", "insert_statement", "update_statement", "delete_statement",
           "update_sql", "delete_sql", "truncate_sql"]

NEW, OLD = 0, 1

_names = count(1)


@dataclass(frozen=True, slots=True)
class Statement:
    name: bytes                            # server-side prepared statement name
    sql: str
    params: tuple[tuple[int, int], ...]    # (NEW|OLD, source column position) per $n
    # Inserts into a table with a unique key: source positions of that key. The insert does
    # nothing on a conflict (0 rows) and the caller then updates the existing row by this key.
    conflict_key: tuple[int, ...] = ()


def _statement(sql: str, params: list[tuple[int, int]], conflict_key: tuple[int, ...] = ()) -> Statement:
    return Statement(f"applier_{next(_names)}".encode(), sql, tuple(params), conflict_key)


def _placeholder(mapping: RelationMapping, position: int, number: int) -> str:
    return f"${number}::{mapping.target_columns[position].type_sql}"


def insert_statement(mapping: RelationMapping, present: tuple[int, ...]) -> Statement:
    """INSERT of the columns present. With a unique key on the target it does nothing on a
    conflict, so the caller can count the conflict and resolve it (update by key, by default)."""
    table = mapping.table
    names = [mapping.target_columns[i].name for i in present]
    values = ", ".join(_placeholder(mapping, i, n) for n, i in enumerate(present, 1))
    sql = (f"INSERT INTO {table.sql_name} ({', '.join(map(quote_ident, names))}) "
           f"VALUES ({values})")
    params = [(NEW, i) for i in present]
    if table.unique_key and set(table.unique_key) <= set(names):
        key = tuple(present[names.index(name)] for name in table.unique_key)
        sql += f" ON CONFLICT ({', '.join(map(quote_ident, table.unique_key))}) DO NOTHING"
        return _statement(sql, params, conflict_key=key)
    return _statement(sql, params)


def _row_filter(mapping: RelationMapping, source: int, positions: tuple[int, ...],
                first_number: int, by_key: bool) -> tuple[str, list[tuple[int, int]]]:
    """WHERE clause locating one row. A key match uses '='; otherwise (FULL identity) every sent
    column is matched NULL-safely and one physical row is picked, so of several identical rows
    exactly one changes, never all."""
    table = mapping.table
    params = [(source, i) for i in positions]
    if by_key:
        conditions = [f"{quote_ident(mapping.target_columns[i].name)} = {_placeholder(mapping, i, n)}"
                      for n, i in enumerate(positions, first_number)]
        return " AND ".join(conditions), params
    conditions = []
    for n, i in enumerate(positions, first_number):
        column = mapping.target_columns[i]
        if column.has_equality:
            conditions.append(f"{quote_ident(column.name)} IS NOT DISTINCT FROM {_placeholder(mapping, i, n)}")
        else:  # json, point, ...: no '=' of their own; identical values have identical text
            conditions.append(f"{quote_ident(column.name)}::text IS NOT DISTINCT FROM "
                              f"({_placeholder(mapping, i, n)})::text")
    match = " AND ".join(conditions) or "true"
    if table.partitioned:
        return (f"(tableoid, ctid) = (SELECT tableoid, ctid FROM {table.sql_name} WHERE {match} "
                "LIMIT 1)"), params
    return f"ctid = (SELECT ctid FROM ONLY {table.sql_name} WHERE {match} LIMIT 1)", params


def update_sql(mapping: RelationMapping, assigned: tuple[int, ...], key_positions: tuple[int, ...],
               by_key: bool) -> str:
    """UPDATE setting the columns sent (unchanged TOAST columns are left out, so kept); the
    parameters are the assigned values, then the key (or old row) values."""
    sets = ", ".join(f"{quote_ident(mapping.target_columns[i].name)} = {_placeholder(mapping, i, n)}"
                     for n, i in enumerate(assigned, 1))
    where, _ = _row_filter(mapping, NEW, key_positions, len(assigned) + 1, by_key)
    return f"UPDATE {mapping.table.sql_name} SET {sets} WHERE {where}"


def update_statement(mapping: RelationMapping, assigned: tuple[int, ...], key_source: int,
                     key_positions: tuple[int, ...], by_key: bool) -> Statement:
    return _statement(update_sql(mapping, assigned, key_positions, by_key),
                      [(NEW, i) for i in assigned] + [(key_source, i) for i in key_positions])


def delete_sql(mapping: RelationMapping, key_positions: tuple[int, ...], by_key: bool) -> str:
    where, _ = _row_filter(mapping, OLD, key_positions, 1, by_key)
    return f"DELETE FROM {mapping.table.sql_name} WHERE {where}"


def delete_statement(mapping: RelationMapping, key_positions: tuple[int, ...], by_key: bool) -> Statement:
    return _statement(delete_sql(mapping, key_positions, by_key), [(OLD, i) for i in key_positions])


def truncate_sql(table_names: list[str], restart_identity: bool) -> str:
    """One statement for every listed table. CASCADE is never sent: the source already listed every
    table it truncated, and cascading on the target could empty tables that only the target has."""
    return f"TRUNCATE {', '.join(table_names)}{' RESTART IDENTITY' if restart_identity else ''}"
