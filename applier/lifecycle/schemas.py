"""Is the target's schema the source's, for the published tables? ``applier cutover``'s check.

Owns comparing the definitions of every published table on both servers, as PostgreSQL's
catalog functions print them (``sync.schema.read_table_schema``): columns (type, collation, NOT
NULL, default, identity, generation), constraints and indexes by name, the sequences the columns
own or use (their options; their values are the sequences check's), and the replica identity,
and saying each difference in a line. A partitioned source table may be a plain target table (as
``--create-tables`` makes it); that alone is no difference. Must never write to either server.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from ..quoting import ident, qualified
from ..sync.catalog import PublishedTable
from ..sync.schema import Column, SequenceDefinition, TableSchema, read_table_schema

__all__ = ["schema_differences"]

_COLUMN_FIELDS = (("type_sql", "type"), ("collation", "collation"), ("not_null", "NOT NULL"),
                  ("default", "default"), ("identity", "identity"), ("generated", "generated"),
                  ("expression", "generation expression"))
_IDENTITY = {"": "none", "a": "ALWAYS", "d": "BY DEFAULT"}
_GENERATED = {"": "no", "s": "STORED", "v": "VIRTUAL"}
_REPLICA_IDENTITY = {"d": "DEFAULT", "n": "NOTHING", "f": "FULL", "i": "USING INDEX"}


def schema_differences(source: Any, target: Any, tables: Iterable[PublishedTable]) -> list[str]:
    """Every difference between the two servers' definitions of ``tables``, one line each."""
    found: list[str] = []
    for table in tables:
        row = target.execute("SELECT pg_catalog.to_regclass(%s)::pg_catalog.oid::int8",
                             (table.sql_name,)).fetchone()
        if row is None or row[0] is None:
            found.append(f"{table.sql_name}: the table is not on the target")
            continue
        found += _table(read_table_schema(source, table.oid), read_table_schema(target, int(row[0])),
                        table)
    return found


def _shown(name: str, value: object) -> str:
    if name == "identity":
        return _IDENTITY.get(str(value), str(value))
    if name == "generated":
        return _GENERATED.get(str(value), str(value))
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "none" if value is None else str(value)


def _table(source: TableSchema, target: TableSchema, table: PublishedTable) -> list[str]:
    name = qualified(source.schema, source.name)
    out: list[str] = []
    for column in source.columns:
        theirs = target.column(column.name)
        if theirs is None:
            why = "" if column.name in table.columns or column.generated else \
                " (the publication's column list leaves it out)"
            out.append(f"{name}: column {ident(column.name)} is not on the target{why}")
        else:
            out += _column(name, column, theirs, published=column.name in table.columns)
    out += [f"{name}: column {ident(c.name)} is only on the target" for c in target.columns
            if source.column(c.name) is None]
    for kind, mine, others in (("constraint", source.constraints, target.constraints),
                               ("index", source.indexes, target.indexes)):
        for key in sorted(mine.keys() | others.keys()):
            a, b = mine.get(key), others.get(key)
            if a is not None and b is None:
                out.append(f"{name}: {kind} {ident(key)} is not on the target ({a.definition})")
            elif b is not None and a is None:
                out.append(f"{name}: {kind} {ident(key)} is only on the target ({b.definition})")
            elif a is not None and b is not None and a.definition != b.definition:
                out.append(f"{name}: {kind} {ident(key)} is {a.definition} on the source, "
                           f"{b.definition} on the target")
    out += _sequences(name, source.sequences, target.sequences)
    if source.replica_identity != target.replica_identity:
        out.append(f"{name}: replica identity {_REPLICA_IDENTITY[source.replica_identity]} on the "
                   f"source, {_REPLICA_IDENTITY[target.replica_identity]} on the target")
    return out


def _column(table: str, source: Column, target: Column, *, published: bool) -> list[str]:
    out = []
    for field, label in _COLUMN_FIELDS:
        mine, theirs = getattr(source, field), getattr(target, field)
        if source.generated and published and field in ("generated", "expression"):
            continue  # the stream sends its values: a plain column on the target takes them
        if mine != theirs:
            out.append(f"{table}: column {ident(source.name)}: {label} {_shown(field, mine)} on "
                       f"the source, {_shown(field, theirs)} on the target")
    return out


def _sequences(table: str, source: tuple[SequenceDefinition, ...],
               target: tuple[SequenceDefinition, ...]) -> list[str]:
    mine, others = {s.name: s for s in source}, {s.name: s for s in target}
    out = []
    for key in sorted(mine.keys() | others.keys()):
        a, b = mine.get(key), others.get(key)
        if b is None:
            out.append(f"{table}: sequence {key} is not on the target")
        elif a is None:
            out.append(f"{table}: sequence {key} is only on the target")
        else:
            out += [f"{table}: sequence {key}: {f.name} {getattr(a, f.name)} on the source, "
                    f"{getattr(b, f.name)} on the target" for f in fields(SequenceDefinition)
                    if getattr(a, f.name) != getattr(b, f.name)]
    return out
