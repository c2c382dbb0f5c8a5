"""SQL for each row shape, built once per (relation, operation, columns present) and cached.

Every value is a parameter (``$n``) sent in the format it arrived in (text or binary) and cast by
the target column's type (``format_type()`` of the target, trusted server output); no value is
ever spliced into SQL, and every identifier is composed with ``psycopg.sql``. A statement records
where each parameter comes from, so applying a row is a tuple lookup, not SQL building. Must
never run anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

from psycopg import sql

from .mapping import RelationMapping

__all__ = ["Statement", "NEW", "OLD", "insert_statement", "update_statement", "delete_statement",
           "update_sql", "delete_sql", "delete_in_sql", "truncate_sql", "placeholder", "value_rows",
           "row_filter", "column", "overriding", "assignments", "identity_assigned", "identity_sql"]

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


def named(text: str, params: list[tuple[int, int]] | tuple[tuple[int, int], ...] = (),
          conflict_key: tuple[int, ...] = (), prefix: str = "applier") -> Statement:
    """A statement under a name never used before in this process."""
    return Statement(f"{prefix}_{next(_names)}".encode(), text, tuple(params), conflict_key)


def placeholder(mapping: RelationMapping, position: int, number: int) -> sql.Composable:
    """``$number`` cast to the target type of the source column at ``position``."""
    return sql.SQL("${}::{}").format(sql.SQL(str(number)),
                                     sql.SQL(mapping.target_columns[position].type_sql))


def value_rows(mapping: RelationMapping, positions: tuple[int, ...], rows: int,
               stride: int | None = None) -> sql.Composable:
    """``($1::t, ..), ...``: ``rows`` rows of the placeholders of ``positions``, row r's numbered
    from ``r * stride + 1`` (``stride``: parameters per row, by default one per position)."""
    width = len(positions) if stride is None else stride
    return sql.SQL(", ").join(
        sql.SQL("({})").format(sql.SQL(", ").join(
            placeholder(mapping, i, r * width + n) for n, i in enumerate(positions, 1)))
        for r in range(rows))


def delete_in_sql(mapping: RelationMapping, positions: tuple[int, ...], rows: int,
                  stride: int | None = None) -> sql.Composable:
    """``DELETE FROM t WHERE (key) IN (<value_rows>)``: one index scan finds every key of a
    single-column key (PostgreSQL sorts the list), where a join with the keys would descend the
    index once per key."""
    return sql.SQL("DELETE FROM {} WHERE ({}) IN ({})").format(
        table(mapping), sql.SQL(", ").join(column(mapping, i) for i in positions),
        value_rows(mapping, positions, rows, stride))


def column(mapping: RelationMapping, position: int) -> sql.Identifier:
    """The target column of the source column at ``position``."""
    return sql.Identifier(mapping.target_columns[position].name)


def table(mapping: RelationMapping) -> sql.Identifier:
    return sql.Identifier(mapping.table.schema, mapping.table.name)


def on_conflict(mapping: RelationMapping, names: list[str]) -> sql.Composable:
    """``ON CONFLICT (key) DO NOTHING`` when the target's unique key is among ``names``, else nothing."""
    key = mapping.table.unique_key
    if key and set(key) <= set(names):
        return sql.SQL(" ON CONFLICT ({}) DO NOTHING").format(
            sql.SQL(", ").join(map(sql.Identifier, key)))
    return sql.SQL("")


def overriding(mapping: RelationMapping, present: tuple[int, ...]) -> sql.Composable:
    """`` OVERRIDING SYSTEM VALUE`` when a column inserted is GENERATED ALWAYS AS IDENTITY on the
    target: the source's value is written, as PostgreSQL's subscriber and COPY write it (without
    the clause the INSERT fails)."""
    if any(mapping.target_columns[i].identity_always for i in present):
        return sql.SQL(" OVERRIDING SYSTEM VALUE")
    return sql.SQL("")


def identity_assigned(mapping: RelationMapping, assigned: tuple[int, ...]) -> tuple[int, ...]:
    """The positions among ``assigned`` of GENERATED ALWAYS AS IDENTITY target columns."""
    return tuple(i for i in assigned if mapping.target_columns[i].identity_always)


def assignments(mapping: RelationMapping, assigned: tuple[int, ...],
                value: Callable[[int, int], sql.Composable], target: str | None = None,
                set_identity: bool = False) -> tuple[sql.Composable, list[sql.Composable]]:
    """An UPDATE's SET list for the columns ``assigned`` (``value(n, position)``: the value of
    the n-th of them) and the conditions it adds to its WHERE clause.

    No UPDATE may set a GENERATED ALWAYS AS IDENTITY column (PostgreSQL admits no OVERRIDING
    clause there), so such a column is left out of the SET list and becomes a condition: the
    row changes only if it holds the source's value already, as it does whenever the source did
    not change that value (the usual case: it is the key). An update that did change it changes
    no row, so its count differs, and the careful path applies it with the column's identity
    made BY DEFAULT for the moment (``CarefulPath.update``, ``set_identity``: set it too).
    ``target``: the updated table's alias in the statement, if any."""
    sets: list[sql.Composable] = []
    conditions: list[sql.Composable] = []
    for n, i in enumerate(assigned):
        name = column(mapping, i)
        if mapping.target_columns[i].identity_always and not set_identity:
            qualified = sql.SQL("{}.{}").format(sql.Identifier(target), name) if target else name
            conditions.append(sql.SQL("{} IS NOT DISTINCT FROM {}").format(qualified, value(n, i)))
        else:
            sets.append(sql.SQL("{} = {}").format(name, value(n, i)))
    if not sets:  # every column assigned is an identity ALWAYS one: the careful path's to apply
        sets.append(sql.SQL("{} = DEFAULT").format(column(mapping, assigned[0])))
        conditions.append(sql.SQL("false"))
    return sql.SQL(", ").join(sets), conditions


def insert_statement(mapping: RelationMapping, present: tuple[int, ...]) -> Statement:
    """INSERT of the columns present. With a unique key on the target it does nothing on a
    conflict, so the caller can count the conflict and resolve it (update by key, by default)."""
    names = [mapping.target_columns[i].name for i in present]
    text = sql.SQL("INSERT INTO {} ({}){} VALUES ({}){}").format(
        table(mapping), sql.SQL(", ").join(column(mapping, i) for i in present),
        overriding(mapping, present),
        sql.SQL(", ").join(placeholder(mapping, i, n) for n, i in enumerate(present, 1)),
        on_conflict(mapping, names)).as_string()
    params = [(NEW, i) for i in present]
    key = mapping.table.unique_key
    if key and set(key) <= set(names):
        return named(text, params, conflict_key=tuple(present[names.index(name)] for name in key))
    return named(text, params)


def row_filter(mapping: RelationMapping, source: int, positions: tuple[int, ...],
               first_number: int, by_key: bool) -> tuple[sql.Composable, list[tuple[int, int]]]:
    """WHERE clause locating one row. A key match uses '='; otherwise (FULL identity) every sent
    column is matched NULL-safely and one physical row is picked, so of several identical rows
    exactly one changes, never all."""
    params = [(source, i) for i in positions]
    numbered = list(enumerate(positions, first_number))
    if by_key:
        return sql.SQL(" AND ").join(
            sql.SQL("{} = {}").format(column(mapping, i), placeholder(mapping, i, n))
            for n, i in numbered), params
    conditions = []
    for n, i in numbered:
        if mapping.target_columns[i].has_equality:
            conditions.append(sql.SQL("{} IS NOT DISTINCT FROM {}").format(
                column(mapping, i), placeholder(mapping, i, n)))
        else:  # json, point, ...: no '=' of their own; identical values have identical text
            conditions.append(sql.SQL("{}::text IS NOT DISTINCT FROM ({})::text").format(
                column(mapping, i), placeholder(mapping, i, n)))
    match = sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("true")
    if mapping.table.partitioned:
        return sql.SQL("(tableoid, ctid) = (SELECT tableoid, ctid FROM {} WHERE {} LIMIT 1)").format(
            table(mapping), match), params
    return sql.SQL("ctid = (SELECT ctid FROM ONLY {} WHERE {} LIMIT 1)").format(
        table(mapping), match), params


def update_sql(mapping: RelationMapping, assigned: tuple[int, ...], key_positions: tuple[int, ...],
               by_key: bool, set_identity: bool = False) -> str:
    """UPDATE setting the columns sent (unchanged TOAST columns are left out, so kept); the
    parameters are the assigned values, then the key (or old row) values (``assignments`` for
    identity ALWAYS columns and ``set_identity``)."""
    sets, conditions = assignments(mapping, assigned, lambda n, i: placeholder(mapping, i, n + 1),
                                   set_identity=set_identity)
    where, _ = row_filter(mapping, NEW, key_positions, len(assigned) + 1, by_key)
    return sql.SQL("UPDATE {} SET {} WHERE {}").format(
        table(mapping), sets, sql.SQL(" AND ").join([where, *conditions])).as_string()


def update_statement(mapping: RelationMapping, assigned: tuple[int, ...], key_source: int,
                     key_positions: tuple[int, ...], by_key: bool, set_identity: bool = False) -> Statement:
    return named(update_sql(mapping, assigned, key_positions, by_key, set_identity),
                 [(NEW, i) for i in assigned] + [(key_source, i) for i in key_positions])


def identity_sql(mapping: RelationMapping, positions: tuple[int, ...], always: bool) -> list[str]:
    """``ALTER TABLE ... ALTER COLUMN ... SET GENERATED BY DEFAULT`` (or back ``ALWAYS``) for the
    identity columns at ``positions``: for the moment an update sets them (``assignments``)."""
    kind = sql.SQL("ALWAYS" if always else "BY DEFAULT")
    return [sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET GENERATED {}").format(
        table(mapping), column(mapping, i), kind).as_string() for i in positions]


def delete_sql(mapping: RelationMapping, key_positions: tuple[int, ...], by_key: bool) -> str:
    where, _ = row_filter(mapping, OLD, key_positions, 1, by_key)
    return sql.SQL("DELETE FROM {} WHERE {}").format(table(mapping), where).as_string()


def delete_statement(mapping: RelationMapping, key_positions: tuple[int, ...], by_key: bool) -> Statement:
    return named(delete_sql(mapping, key_positions, by_key), [(OLD, i) for i in key_positions])


def truncate_sql(tables: list[tuple[str, str]], restart_identity: bool) -> str:
    """One statement for every listed (schema, table). CASCADE is never sent: the source already
    listed every table it truncated, and cascading on the target could empty tables that only
    the target has."""
    return sql.SQL("TRUNCATE {}{}").format(
        sql.SQL(", ").join(sql.Identifier(schema, name) for schema, name in tables),
        sql.SQL(" RESTART IDENTITY" if restart_identity else "")).as_string()
