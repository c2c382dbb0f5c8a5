"""A table's definition as PostgreSQL's catalog gives it, in a form two servers can be compared by.

Owns reading one table's columns (type, collation, NOT NULL, default, identity, generation),
constraints (primary key, unique, exclusion, CHECK, foreign key), other indexes, the sequences
its columns own or their defaults use (with their options, not their values), and its replica
identity, each as PostgreSQL's own functions print it (``format_type``, ``pg_get_expr``,
``pg_get_constraintdef``, ``pg_get_indexdef``, ``pg_sequence``), with an empty ``search_path``
so every name comes back schema-qualified. ``--create-tables`` builds the target from the
source's (``definition``), and ``applier cutover`` compares the source's with the target's. Must
never write anything, nor decide what to build or what a difference means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..queries import rows

__all__ = ["Column", "Constraint", "Index", "SequenceDefinition", "TableSchema", "read_table_schema"]


@dataclass(frozen=True)
class Column:
    name: str
    type_sql: str              # format_type(): schema-qualified where it is not built in
    collation: str | None      # when not the type's own: its qualified, quoted name
    not_null: bool
    default: str | None        # pg_get_expr() of the default (not of a generation expression)
    identity: str              # '' | 'a' (ALWAYS) | 'd' (BY DEFAULT)
    generated: str             # '' | 's' (stored) | 'v' (virtual, PostgreSQL 18)
    expression: str | None     # a generated column's expression
    uses: tuple[str, ...]      # the columns a generated column is computed from


@dataclass(frozen=True)
class Constraint:
    name: str
    kind: str                  # p primary key, u unique, x exclusion, c check, f foreign key
    definition: str            # pg_get_constraintdef(): NOT VALID included when not validated
    validated: bool
    columns: tuple[str, ...]   # the columns of the table it names
    references: str | None     # a foreign key's referenced table, schema-qualified
    replica_identity: bool     # its index is the table's replica identity


@dataclass(frozen=True)
class Index:
    """An index that no constraint owns (those are the constraint's)."""

    name: str
    definition: str            # pg_get_indexdef(), ``ON ONLY`` (a partitioned table's) as ``ON``
    columns: tuple[str, ...]   # its key and included columns (expressions not counted)
    replica_identity: bool


@dataclass(frozen=True)
class SequenceDefinition:
    name: str                  # schema-qualified, quoted
    type_sql: str
    start: int
    increment: int
    minimum: int
    maximum: int
    cache: int
    cycle: bool
    owner: str | None          # the column that owns it (serial, OWNED BY, identity)
    identity: bool

    @property
    def options(self) -> str:
        """Its options as an identity column writes them (its type is the column's)."""
        return (f"INCREMENT BY {self.increment} MINVALUE {self.minimum} MAXVALUE {self.maximum} "
                f"START WITH {self.start} CACHE {self.cache} {'' if self.cycle else 'NO '}CYCLE")


@dataclass(frozen=True)
class TableSchema:
    schema: str
    name: str
    columns: tuple[Column, ...]                   # in the table's order
    constraints: dict[str, Constraint]
    indexes: dict[str, Index]
    sequences: tuple[SequenceDefinition, ...]
    replica_identity: str                         # d default, n nothing, f full, i index

    def column(self, name: str) -> Column | None:
        return next((c for c in self.columns if c.name == name), None)


_COLUMNS = """
    SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod),
           CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation THEN
                (SELECT pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(c.collname)
                 FROM pg_catalog.pg_collation c JOIN pg_catalog.pg_namespace n ON n.oid = c.collnamespace
                 WHERE c.oid = a.attcollation) END,
           a.attnotnull, pg_catalog.pg_get_expr(d.adbin, d.adrelid), a.attidentity::text,
           a.attgenerated::text,
           ARRAY(SELECT u.attname FROM pg_catalog.pg_depend dep
                 JOIN pg_catalog.pg_attribute u ON u.attrelid = dep.refobjid AND u.attnum = dep.refobjsubid
                 WHERE dep.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass AND dep.objid = d.oid
                   AND dep.refobjid = a.attrelid AND dep.refobjsubid > 0 AND dep.deptype = 'n'
                 ORDER BY u.attnum)
    FROM pg_catalog.pg_attribute a
    JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
    LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE a.attrelid = %(oid)s AND a.attnum > 0 AND NOT a.attisdropped
    ORDER BY a.attnum
"""
_CONSTRAINTS = """
    SELECT con.conname, con.contype::text, pg_catalog.pg_get_constraintdef(con.oid), con.convalidated,
           ARRAY(SELECT a.attname FROM pg_catalog.pg_attribute a WHERE a.attrelid = con.conrelid
                 AND a.attnum = ANY(con.conkey) ORDER BY a.attnum),
           CASE WHEN con.contype = 'f' THEN con.confrelid::pg_catalog.regclass::text END,
           con.contype IN ('p', 'u') AND EXISTS (SELECT FROM pg_catalog.pg_index i
                                                 WHERE i.indexrelid = con.conindid AND i.indisreplident)
    FROM pg_catalog.pg_constraint con
    WHERE con.conrelid = %(oid)s AND con.contype IN ('p', 'u', 'x', 'c', 'f')
    ORDER BY con.conname
"""
_INDEXES = """
    SELECT ci.relname, pg_catalog.pg_get_indexdef(i.indexrelid), i.indisreplident,
           ARRAY(SELECT a.attname FROM pg_catalog.pg_attribute a WHERE a.attrelid = i.indrelid
                 AND a.attnum = ANY(i.indkey) ORDER BY a.attnum)
    FROM pg_catalog.pg_index i
    JOIN pg_catalog.pg_class ci ON ci.oid = i.indexrelid
    WHERE i.indrelid = %(oid)s AND NOT EXISTS (
        SELECT FROM pg_catalog.pg_constraint con WHERE con.conindid = i.indexrelid
        AND con.conrelid = i.indrelid AND con.contype IN ('p', 'u', 'x'))
    ORDER BY ci.relname
"""
# Owned by a column (serial and OWNED BY 'a', identity 'i'), or named in a column's default.
_SEQUENCES = """
    WITH uses AS (
        SELECT d.objid AS seq, d.refobjsubid AS owner, d.deptype = 'i' AS identity
        FROM pg_catalog.pg_depend d
        WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.refobjid = %(oid)s
          AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.deptype IN ('a', 'i')
        UNION
        SELECT d.refobjid, NULL, false
        FROM pg_catalog.pg_depend d
        JOIN pg_catalog.pg_attrdef ad ON ad.oid = d.objid
        WHERE d.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass AND ad.adrelid = %(oid)s
          AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
    )
    SELECT s.seqrelid::pg_catalog.regclass::text, pg_catalog.format_type(s.seqtypid, NULL),
           s.seqstart, s.seqincrement, s.seqmin, s.seqmax, s.seqcache, s.seqcycle,
           max(a.attname), bool_or(u.identity)
    FROM uses u
    JOIN pg_catalog.pg_sequence s ON s.seqrelid = u.seq
    LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = %(oid)s AND a.attnum = u.owner
    GROUP BY 1, 2, 3, 4, 5, 6, 7, 8
    ORDER BY 1
"""


def read_table_schema(conn: Any, oid: int) -> TableSchema:
    """The definition of the table ``oid`` on ``conn`` (psycopg or SQLAlchemy), read in one
    snapshot when the caller's transaction is one. Empties the session's ``search_path``."""
    rows(conn, "SELECT pg_catalog.set_config('search_path', '', false)")
    params = {"oid": oid}
    schema, name, replident = rows(
        conn, "SELECT n.nspname, c.relname, c.relreplident::text FROM pg_catalog.pg_class c "
              "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %(oid)s",
        params)[0]
    columns = tuple(Column(r[0], r[1], r[2], bool(r[3]), None if r[6] else r[4], r[5] or "",
                           r[6] or "", r[4] if r[6] else None, tuple(r[7] or ()))
                    for r in rows(conn, _COLUMNS, params))
    constraints = {r[0]: Constraint(r[0], r[1], r[2], bool(r[3]), tuple(r[4] or ()), r[5], bool(r[6]))
                   for r in rows(conn, _CONSTRAINTS, params)}
    indexes = {r[0]: Index(r[0], r[1].replace(" ON ONLY ", " ON ", 1), tuple(r[3] or ()), bool(r[2]))
               for r in rows(conn, _INDEXES, params)}
    sequences = tuple(SequenceDefinition(r[0], r[1], int(r[2]), int(r[3]), int(r[4]), int(r[5]),
                                         int(r[6]), bool(r[7]), r[8], bool(r[9]))
                      for r in rows(conn, _SEQUENCES, params))
    return TableSchema(schema, name, columns, constraints, indexes, sequences, replident)
