"""Target indexes rebuilt after the data, for a table copied whole in one transaction.

Owns deciding whether a target table's indexes (constraint ones included) may be dropped before
its COPY and built again after it, and doing both. Building an index from the finished table (one
sort) costs far less than maintaining it row by row. Both happen inside the copy's own
transaction, which holds the table's ACCESS EXCLUSIVE lock from the first DROP on: no other
session ever sees the table without its indexes, and a failure or crash rolls the drops back with
the rows (the table is then redone whole, as any unfinished copy). Tables where dropping could
touch anything else are left alone: referenced by a foreign key, part of an inheritance or
partition tree, owned by a role the session cannot act as, or with an index that is invalid,
in its own tablespace or commented. Must never run outside the copy's transaction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg

from ..quoting import ident
from .catalog import PublishedTable

__all__ = ["RebuiltIndex", "drop_indexes", "rebuild_indexes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebuiltIndex:
    drop: str                   # the statement that drops it (or its constraint)
    create: list[str]           # the statements that build it again, with its table-level flags


def drop_indexes(target: psycopg.Connection, table: PublishedTable) -> list[RebuiltIndex]:
    """Drop ``table``'s indexes in the caller's transaction; what ``rebuild_indexes`` needs to
    build them again. Nothing is dropped (and [] returned) when the table does not qualify."""
    assert target.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    row = target.execute(
        "SELECT c.relkind = 'r' AND NOT c.relispartition AND NOT c.relhassubclass "
        "AND pg_catalog.pg_has_role(c.relowner, 'USAGE') "
        "AND NOT EXISTS (SELECT FROM pg_catalog.pg_inherits WHERE inhrelid = c.oid) "
        "AND NOT EXISTS (SELECT FROM pg_catalog.pg_constraint WHERE confrelid = c.oid), "
        "c.relreplident FROM pg_catalog.pg_class c WHERE c.oid = %s::pg_catalog.regclass",
        (table.sql_name,)).fetchone()
    if row is None or not row[0]:
        return []
    identity_by_index = row[1] == "i"
    indexes = target.execute(
        "SELECT i.relname, con.conname, pg_catalog.pg_get_indexdef(x.indexrelid), "
        "pg_catalog.pg_get_constraintdef(con.oid), x.indisreplident, x.indisclustered, "
        "x.indisvalid AND x.indisready AND i.reltablespace = 0 "
        "AND pg_catalog.obj_description(i.oid, 'pg_class') IS NULL "
        "AND (con.oid IS NULL OR pg_catalog.obj_description(con.oid, 'pg_constraint') IS NULL) "
        "FROM pg_catalog.pg_index x JOIN pg_catalog.pg_class i ON i.oid = x.indexrelid "
        "LEFT JOIN pg_catalog.pg_constraint con ON con.conindid = x.indexrelid "
        "AND con.conrelid = x.indrelid AND con.contype IN ('p', 'u', 'x') "
        "WHERE x.indrelid = %s::pg_catalog.regclass ORDER BY i.relname",
        (table.sql_name,)).fetchall()
    if not indexes or not all(simple for *_, simple in indexes):
        return []
    rebuilt = []
    for name, constraint, indexdef, constraintdef, replident, clustered, _ in indexes:
        if constraint is not None:
            drop = f"ALTER TABLE {table.sql_name} DROP CONSTRAINT {ident(constraint)}"
            create = [f"ALTER TABLE {table.sql_name} ADD CONSTRAINT {ident(constraint)} "
                      f"{constraintdef}"]
            built_as = constraint  # ADD CONSTRAINT names the new index after the constraint
        else:
            drop = f"DROP INDEX {ident(table.schema)}.{ident(name)}"
            create = [indexdef]  # schema-qualified: the session's search_path is empty
            built_as = name
        if replident and identity_by_index:
            create.append(f"ALTER TABLE {table.sql_name} REPLICA IDENTITY USING INDEX "
                          f"{ident(built_as)}")
        if clustered:
            create.append(f"ALTER TABLE {table.sql_name} CLUSTER ON {ident(built_as)}")
        rebuilt.append(RebuiltIndex(drop, create))
    try:
        with target.transaction():  # a savepoint: an unforeseen dependency leaves the indexes be
            for dropped in rebuilt:
                target.execute(dropped.drop)
    except psycopg.Error as exc:
        log.info("keeping the indexes of %s during the copy: %s", table.sql_name, str(exc).strip())
        return []
    return rebuilt


def rebuild_indexes(target: psycopg.Connection, rebuilt: list[RebuiltIndex]) -> None:
    """Build the indexes ``drop_indexes`` dropped, in the same transaction, after the data."""
    for index in rebuilt:
        for statement in index.create:
            target.execute(statement)
