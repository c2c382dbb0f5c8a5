"""Comparing the oracle's databases: every table's rows as text, and what differs.

A row is the text of each of the columns the source table has when the example ends, in the
source's order (the target's order may differ, and the target may have more columns: one the
source dropped, or added in a transaction that rolled back), long values as their md5; rows are
compared as multisets (a table without a key may hold
identical rows). Every comparing session has the same settings (``oracle_servers.COMPARE_SETUP``),
so text forms do not depend on the database.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from oracle_schema import MARKER, Schema
from oracle_values import ident, literal, qualified

__all__ = ["Columns", "Contents", "columns", "contents", "difference", "has_marker"]

#: Table (schema.name) -> its rows.
Contents = dict[str, Counter[tuple]]
#: Table (schema, name) -> its columns' names.
Columns = dict[tuple[str, str], list[str]]


def columns(query: Callable[[str], list[tuple]], schema: Schema) -> Columns:
    """The columns each table has now (columns were added and dropped), in its order."""
    return {(space, name): _columns(query, space, name) for space, name in schema.leaf_tables()}


def _columns(query: Callable[[str], list[tuple]], space: str, name: str) -> list[str]:
    return [row[0] for row in query(
        "SELECT attname FROM pg_attribute WHERE attrelid = "
        f"{literal(qualified(space, name))}::regclass AND attnum > 0 AND NOT attisdropped "
        "ORDER BY attnum")]


def contents(query: Callable[[str], list[tuple]], tables: Columns) -> Contents:
    """The rows of every table, through ``query``: the text of each column ``tables`` names
    (a long one's md5). A column the database lacks reads as NULL: applier adds a column the
    source added only with the first row change that has it."""
    found: Contents = {}
    for (space, name), names in tables.items():
        present = set(_columns(query, space, name))
        texts = ", ".join(f"CASE WHEN length({ident(c)}::text) > 200 THEN 'md5 ' || "
                          f"md5({ident(c)}::text) ELSE {ident(c)}::text END" if c in present
                          else "NULL" for c in names)
        found[f"{space}.{name}"] = Counter(query(f"SELECT {texts or 'NULL'} "
                                                 f"FROM {qualified(space, name)}"))
    return found


def difference(expected: Contents, actual: Contents, expected_name: str, actual_name: str
               ) -> str | None:
    """What differs, table by table, with a few rows of each side; None: nothing."""
    lines = []
    for table, rows in expected.items():
        other = actual[table]
        if rows == other:
            continue
        missing = list((rows - other).elements())[:3]
        extra = list((other - rows).elements())[:3]
        lines.append(f"{table}: {sum(rows.values())} rows in {expected_name}, "
                     f"{sum(other.values())} in {actual_name}; missing there e.g. "
                     f"{_short(missing)}; extra there e.g. {_short(extra)}")
    return "\n".join(lines) or None


def has_marker(query: Callable[[str], list[tuple]]) -> bool:
    return bool(query(f"SELECT count(*) FROM {qualified(*MARKER)}")[0][0])


def _short(rows: list[tuple]) -> str:
    text = repr(rows)
    return text if len(text) < 600 else text[:600] + "..."
