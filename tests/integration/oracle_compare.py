"""Comparing the oracle's databases: every table's rows as text, and what differs.

A row is the text of each of its columns, in the source's column order (the target's may differ),
large values as their md5; rows are compared as multisets (a table without a key may hold
identical rows). Every comparing session has the same settings (``oracle_servers.COMPARE_SETUP``),
so text forms do not depend on the database.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from oracle_schema import MARKER, Schema
from oracle_values import TYPES, ident, qualified

__all__ = ["Contents", "contents", "difference", "has_marker"]

#: Table (schema.name) -> its rows.
Contents = dict[str, Counter[tuple]]


def contents(query: Callable[[str], list[tuple]], schema: Schema) -> Contents:
    """Every table that holds rows (leaf partitions, the marker), through ``query``."""
    found: Contents = {}
    by_leaf = {(t.schema, leaf): t for t in schema.tables for leaf in t.leaves()}
    for space, name in schema.leaf_tables():
        table = by_leaf.get((space, name))
        if table is None:
            columns = "n::text"
        else:
            columns = ", ".join(f"md5({ident(c.name)}::text)" if TYPES[c.type].toast
                                else f"{ident(c.name)}::text" for c in table.columns)
        found[f"{space}.{name}"] = Counter(query(f"SELECT {columns} FROM {qualified(space, name)}"))
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
