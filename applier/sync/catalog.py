"""Source catalog reads for the initial copy: what is published, and how each table is defined.

Owns the list of published tables with the columns and row filter the stream applies to each
(PostgreSQL 15+ column lists and row filters, from ``pg_publication_tables``), their size
estimates, and their columns' types (``schema`` reads the whole definition). Must never write to the
source or the target. Every query runs with an empty ``search_path`` so expressions and type names
come back schema-qualified.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from ..errors import ApplierError, Cause
from ..protocol.messages import FIRST_NORMAL_OID
from ..quoting import qualified

__all__ = ["PublishedTable", "SourceColumn", "CatalogError", "published_tables",
           "source_column_types"]



class CatalogError(ApplierError):
    """The publication asks for something the copy cannot honour the way the stream does."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.NEEDS_OPERATOR)


@dataclass(frozen=True)
class PublishedTable:
    schema: str
    name: str
    oid: int
    relkind: str                 # 'r' table, 'p' partitioned table (published via its root)
    columns: tuple[str, ...]     # the published columns, in table order
    row_filter: str | None       # OR of the publications' filters; None when any has none
    size_bytes: int              # main fork size: what block ranges are cut from
    estimated_rows: int | None   # reltuples, None when never analyzed

    @property
    def key(self) -> tuple[str, str]:
        return (self.schema, self.name)

    @property
    def sql_name(self) -> str:
        return qualified(self.schema, self.name)


_PUBLISHED_18 = """
    SELECT p.schemaname, p.tablename, c.oid, c.relkind, p.pubname, p.attnames, p.rowfilter,
           pg_catalog.pg_relation_size(c.oid), c.reltuples
    FROM pg_catalog.pg_publication_tables p
    JOIN pg_catalog.pg_namespace n ON n.nspname = p.schemaname
    JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename
    WHERE p.pubname = ANY(%s)
    ORDER BY 1, 2, 5
"""
# PostgreSQL 15-17 list generated columns in attnames, but pgoutput never sends them.
_PUBLISHED_15 = _PUBLISHED_18.replace("p.attnames,", """
           ARRAY(SELECT u.name FROM unnest(p.attnames) WITH ORDINALITY AS u(name, n)
                 JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attname = u.name
                 WHERE a.attgenerated = '' ORDER BY u.n),""")
# Before PostgreSQL 15 there are no column lists or row filters: every column, every row.
_PUBLISHED_14 = """
    SELECT p.schemaname, p.tablename, c.oid, c.relkind, p.pubname,
           ARRAY(SELECT a.attname FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid
                 AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' ORDER BY a.attnum),
           NULL::text, pg_catalog.pg_relation_size(c.oid), c.reltuples
    FROM pg_catalog.pg_publication_tables p
    JOIN pg_catalog.pg_namespace n ON n.nspname = p.schemaname
    JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename
    WHERE p.pubname = ANY(%s)
    ORDER BY 1, 2, 5
"""


def published_tables(conn: psycopg.Connection, publications: list[str]) -> list[PublishedTable]:
    """Every table of the publications, once, with what the stream sends for it.

    Row filters of several publications are OR'ed and a publication without a filter disables
    filtering, as pgoutput does. Different column lists for one table are refused, as pgoutput
    refuses them.
    """
    version = conn.info.server_version
    query = _PUBLISHED_18 if version >= 180000 else _PUBLISHED_15 if version >= 150000 else _PUBLISHED_14
    grouped: dict[tuple[str, str], list[tuple]] = {}
    for row in conn.execute(query, (publications,)):
        grouped.setdefault((row[0], row[1]), []).append(row)
    tables = []
    for (schema, name), rows in grouped.items():
        column_lists = {tuple(row[5]) for row in rows}
        if len(column_lists) > 1:
            pubs = ", ".join(row[4] for row in rows)
            raise CatalogError(f"source table {qualified(schema, name)} has different column "
                               f"lists in publications {pubs}; pgoutput refuses to stream it, so "
                               "it cannot be copied either: make the column lists equal")
        filters = [row[6] for row in rows]
        row_filter = None if None in filters else " OR ".join(f"({f})" for f in sorted(set(filters)))
        first = rows[0]
        tables.append(PublishedTable(schema, name, first[2], first[3], tuple(first[5]), row_filter,
                                     int(first[7]), int(first[8]) if first[8] >= 0 else None))
    return tables


@dataclass(frozen=True)
class SourceColumn:
    name: str
    type_sql: str       # format_type() with an empty search_path: schema-qualified
    builtin: bool       # the type (and an array's element type) is built in: binary COPY is safe
    not_null: bool
    default: str | None
    identity: str       # '' | 'a' (ALWAYS) | 'd' (BY DEFAULT)


_COLUMNS = """
    SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod),
           a.atttypid < %(first)s AND COALESCE(NULLIF(t.typelem, 0), a.atttypid) < %(first)s,
           a.attnotnull, pg_catalog.pg_get_expr(d.adbin, d.adrelid), a.attidentity
    FROM pg_catalog.pg_attribute a
    JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
    LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE a.attrelid = %(oid)s AND a.attnum > 0 AND NOT a.attisdropped
    ORDER BY a.attnum
"""


def source_column_types(conn: psycopg.Connection, table: PublishedTable) -> dict[str, SourceColumn]:
    rows = conn.execute(_COLUMNS, {"first": FIRST_NORMAL_OID, "oid": table.oid}).fetchall()
    return {r[0]: SourceColumn(r[0], r[1], bool(r[2]), bool(r[3]), r[4], r[5]) for r in rows}
