"""Target tables and the mapping of source relations onto them.

Owns reading a target table's definition (columns, types, key, whether its rows are independent
of other tables: catalog queries on a connection of its own, off the hot path) and binding a
source Relation to it, column by column by name (``RelationMapping``). Must never run a statement
on the apply session or cache anything (``relation_cache.RelationCache`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from ..connections import connect
from ..errors import ApplierError, Cause
from ..progress.feed import ChangeTable
from ..protocol.messages import FIRST_NORMAL_OID, Relation
from ..queries import rows
from ..quoting import ident, qualified

__all__ = ["TargetColumn", "TargetTable", "RelationMapping", "MappingError", "MissingTargetTable",
           "MissingTargetColumn", "Reflector", "reflect_table", "map_relation"]


class MappingError(ApplierError):
    """A source relation cannot be mapped onto the target."""

    #: What the error policy reads (a missing table or column needs the operator).
    kind = Cause.NEEDS_OPERATOR

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=self.kind)


class MissingTargetTable(MappingError):
    """The target has no table of the source relation's schema-qualified name."""


class MissingTargetColumn(MappingError):
    """The target table lacks a column the source relation replicates."""


@dataclass(frozen=True, slots=True)
class TargetColumn:
    name: str
    type_sql: str          # format_type(): the cast every incoming value goes through
    generated: bool
    has_equality: bool     # an '=' operator for exactly this type; else rows are matched as text
    type_oid: int = 0      # pg_type OID (0: not known)
    type_modifier: int = -1  # atttypmod: varchar's length, numeric's precision and scale
    not_null: bool = False
    has_default: bool = False
    #: GENERATED ALWAYS AS IDENTITY: an INSERT writes it only with OVERRIDING SYSTEM VALUE, and
    #: an UPDATE may not set it at all (``statements``).
    identity_always: bool = False


@dataclass(frozen=True, slots=True)
class TargetTable:
    schema: str
    name: str
    columns: dict[str, TargetColumn]
    unique_key: tuple[str, ...]   # primary key, else the replica identity index; () when none
    partitioned: bool
    #: Its rows live in no other table (neither partitioned nor a partition) and no trigger or
    #: rule fires on it in the replica role: within one target transaction its changes may be
    #: written before or after other such tables' changes with the same outcome.
    independent: bool

    @property
    def sql_name(self) -> str:
        return qualified(self.schema, self.name)

    @property
    def display(self) -> str:
        """``schema_follow.table`` as people read it (metrics labels, summaries), unquoted."""
        return f"{self.schema}.{self.name}"


_TABLE_SQL = """
    SELECT c.oid, c.relkind = 'p',
           c.relkind = 'r' AND NOT c.relispartition
           AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t
                           WHERE t.tgrelid = c.oid AND t.tgenabled IN ('A', 'R'))
           AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_rewrite r
                           WHERE r.ev_class = c.oid AND r.ev_enabled IN ('A', 'R'))
    FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = %(schema)s AND c.relname = %(name)s AND c.relkind IN ('r', 'p')
"""
_COLUMNS_SQL = """
    SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod), a.attgenerated <> '',
           EXISTS (SELECT 1 FROM pg_catalog.pg_operator o WHERE o.oprname = '='
                   AND o.oprleft = a.atttypid AND o.oprright = a.atttypid),
           a.atttypid::int8, a.atttypmod, a.attnotnull, a.atthasdef, a.attidentity = 'a'
    FROM pg_catalog.pg_attribute a
    WHERE a.attrelid = %(oid)s AND a.attnum > 0 AND NOT a.attisdropped
    ORDER BY a.attnum
"""
_KEY_SQL = """
    SELECT ARRAY(SELECT a.attname FROM unnest(i.indkey) WITH ORDINALITY k(attnum, ord)
                 JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                 ORDER BY k.ord)
    FROM pg_catalog.pg_index i
    WHERE i.indrelid = %(oid)s AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL
          AND 0 <> ALL (i.indkey)
    ORDER BY i.indisprimary DESC, i.indisreplident DESC, i.indexrelid
    LIMIT 1
"""


def reflect_table(conn: Any, schema: str, name: str) -> TargetTable:
    """Read a target table's columns and unique key, inside the transaction open on ``conn`` (a
    psycopg or a SQLAlchemy connection, ``queries.rows``)."""
    # With an empty search_path format_type() schema-qualifies every type, as the apply session
    # (which also runs with an empty search_path) needs.
    rows(conn, "SELECT pg_catalog.set_config('search_path', '', true)")
    found = rows(conn, _TABLE_SQL, {"schema": schema, "name": name})
    if not found:
        raise MissingTargetTable(
            f"target table {qualified(schema, name)} does not exist; create it on the target "
            "(same schema-qualified name) and restart")
    oid, partitioned, independent = found[0]
    columns = {row[0]: TargetColumn(row[0], row[1], bool(row[2]), bool(row[3]), int(row[4]),
                                    int(row[5]), bool(row[6]), bool(row[7]), bool(row[8]))
               for row in rows(conn, _COLUMNS_SQL, {"oid": oid})}
    keys = rows(conn, _KEY_SQL, {"oid": oid})
    return TargetTable(schema, name, columns, tuple(keys[0][0] or ()) if keys else (),
                       bool(partitioned), bool(independent))


class Reflector:
    """``reflect_table`` over one psycopg connection to the target ``dsn``, opened for the first
    table and kept until ``close``: a publication of many tables costs the target one connection
    (and the worker one connection set-up) instead of one per table. Each table is read in a
    transaction of its own; a failure drops the connection, and the next table opens another."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: psycopg.Connection[Any] | None = None

    def __call__(self, schema: str, name: str) -> TargetTable:
        if self._conn is None:
            self._conn = connect(self._dsn, autocommit=True)
        try:
            with self._conn.transaction():
                return reflect_table(self._conn, schema, name)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


@dataclass(frozen=True, slots=True)
class RelationMapping:
    """A source Relation bound to its target table: column i of the source tuple -> target column."""

    relation: Relation
    table: TargetTable
    target_columns: tuple[TargetColumn, ...]   # parallel to relation.columns
    key_positions: tuple[int, ...]             # source positions of the replica identity columns
    full_identity: bool                        # REPLICA IDENTITY FULL: match the old row on all columns
    feed: ChangeTable | None = None            # the change table recording its changes (--change-feed)

    @property
    def binary_safe(self) -> bool:
        """Binary values of this relation mean the same on the target: every column has the same
        built-in type on both sides. Binary formats are per type, and those of arrays and
        composites carry type OIDs, which only built-in types share between databases."""
        return all(column.type_oid < FIRST_NORMAL_OID and column.type_oid == target.type_oid
                   for column, target in zip(self.relation.columns, self.target_columns))


def map_relation(relation: Relation, table: TargetTable,
                 feed: ChangeTable | None = None) -> RelationMapping:
    mapped = []
    for column in relation.columns:
        target = table.columns.get(column.name)
        if target is None or target.generated:
            what = "has no column" if target is None else "has only a generated column"
            raise MissingTargetColumn(
                f"target table {table.sql_name} {what} {ident(column.name)} that the source "
                f"relation {qualified(relation.namespace, relation.name)} replicates; add the "
                "column on the target and restart")
        mapped.append(target)
    keys = tuple(i for i, column in enumerate(relation.columns) if column.is_key)
    return RelationMapping(relation, table, tuple(mapped), keys, relation.replica_identity == "f", feed)
