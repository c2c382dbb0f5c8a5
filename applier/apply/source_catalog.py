"""What the schema follower reads of the source's catalog: how a column the source added fills
the rows its table already had.

A Relation message gives a column's name and type, not its default. PostgreSQL adds a column
with a default that is not volatile without touching the table: the default, evaluated once, is
stored as the column's missing value (``pg_attribute.attmissingval``), which every row written
before reads. A volatile default (``clock_timestamp()``, a sequence), an identity or a generated
column makes it rewrite the table instead, each row getting its own value; that rewrite is not in
the logical replication stream. A rewrite (``VACUUM FULL``, a type change) also clears the
missing values, storing them in the rows.

Owns reading, for a column of a source table (by the relation's OID, which is the source
table's), its missing value, current default and whether that is volatile, identity, generation
and NOT NULL, on a connection of its own to the source, opened when first needed (an added
column is rare) with an empty ``search_path`` (expressions come back schema-qualified) and fixed
text settings (the missing value comes back as text the target's input function reads alike).
Must never write to the source, nor decide what the target does (``schema_follow`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from ..connections import connect
from ..errors import Cause, SourceError

__all__ = ["AddedColumn", "SourceCatalog"]


@dataclass(frozen=True)
class AddedColumn:
    """A source column as its table's existing rows see it."""

    has_missing: bool        # existing rows read ``missing`` (not stored in them)
    missing: str | None      # the missing value's text form
    default: str | None      # the current default (pg_get_expr), None without one
    volatile_default: bool   # it calls a volatile function: adding it rewrote the table
    identity: str            # '' | 'a' (ALWAYS) | 'd' (BY DEFAULT)
    generated: str           # '' | 's' (stored)
    not_null: bool

    @property
    def rows_read_null(self) -> bool:
        """Rows older than the column hold NULL in it: it was added without a default, and
        nothing since gives them another value."""
        return not (self.has_missing or self.default is not None or self.identity
                    or self.generated or self.not_null)


# For the rows of the table (its own, or a partitioned table's leaves': it has none itself, and
# each leaf has its own missing value): how many leaves, and the missing values of those that have
# one (the one-element array attmissingval's element, as text). The default's volatility from the
# functions its expression tree calls (a function or an operator's).
_COLUMN = r"""
    WITH leaf AS (
        SELECT l.atthasmissing, (l.attmissingval::text::text[])[1] AS missing
        FROM pg_catalog.pg_class c
        JOIN pg_catalog.pg_attribute l ON l.attrelid = c.oid AND l.attname = %(name)s
        WHERE c.relkind <> 'p' AND c.oid IN (
            SELECT t.relid FROM pg_catalog.pg_partition_tree(%(relid)s::pg_catalog.oid) t
            UNION ALL SELECT %(relid)s::pg_catalog.oid))
    SELECT (SELECT count(*) FROM leaf), ARRAY(SELECT missing FROM leaf WHERE atthasmissing),
           pg_catalog.pg_get_expr(d.adbin, d.adrelid),
           EXISTS (SELECT FROM pg_catalog.regexp_matches(d.adbin::text, ':(?:op)?funcid (\d+)', 'g') f
                   JOIN pg_catalog.pg_proc p ON p.oid = f[1]::oid WHERE p.provolatile = 'v'),
           a.attidentity::text, a.attgenerated::text, a.attnotnull
    FROM pg_catalog.pg_attribute a
    LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE a.attrelid = %(relid)s::pg_catalog.oid AND a.attname = %(name)s AND NOT a.attisdropped
"""
_SETTINGS = ("SELECT pg_catalog.set_config('search_path', '', false)", "SET datestyle = ISO",
             "SET intervalstyle = postgres", "SET extra_float_digits = 3", "SET timezone = 'UTC'",
             "SET bytea_output = hex")


class SourceCatalog:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: psycopg.Connection[Any] | None = None

    def added_column(self, relation_id: int, name: str) -> AddedColumn | None:
        """Column ``name`` of the source table ``relation_id`` now; None when the source has it
        no more (dropped since)."""
        try:
            row = self._connection().execute(_COLUMN, {"relid": relation_id, "name": name}).fetchone()
        except psycopg.Error as exc:
            self.close()
            raise SourceError(f"source: cannot read column {name!r} of the table with OID "
                              f"{relation_id} from the catalog: {exc}",
                              cause=Cause.LOST_CONNECTION) from exc
        if row is None:
            return None
        leaves, missing = row[0], row[1]
        # The rows read one missing value when every leaf has the same (a table without rows
        # reads none: nothing to fill).
        has_missing = len(missing) == leaves and len(set(missing)) <= 1
        return AddedColumn(has_missing, missing[0] if has_missing and missing else None, row[2],
                           bool(row[3]), row[4] or "", row[5] or "", bool(row[6]))

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.dsn, autocommit=True, application_name="applier catalog")
            for setting in _SETTINGS:
                self._conn.execute(setting)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
