"""Which tables ``applier verify`` compares: what the publications publish, as the source says.

Owns: reading the source's catalog for the tables of the publications (their published columns,
key and row filters, merged over several publications), optionally only a chosen list. Must
never write to the database.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from .report import TableSpec, VerifyError

__all__ = ["published_tables"]


def published_tables(conn: psycopg.Connection[Any], publications: Sequence[str],
                     only: Sequence[str] = ()) -> list[TableSpec]:
    """The tables of ``publications`` (PostgreSQL 15+ catalog), optionally only ``only``."""
    known = {r[0] for r in conn.execute("SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)",
                                        (list(publications),))}
    if unknown := [p for p in publications if p not in known]:
        raise VerifyError(f"no publication {', '.join(map(repr, unknown))} on the source")
    rows = conn.execute(
        "SELECT c.oid::int8, pt.schemaname::text, pt.tablename::text, pt.attnames::text[], pt.rowfilter "
        "FROM pg_publication_tables pt JOIN pg_namespace n ON n.nspname = pt.schemaname "
        "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename "
        "WHERE pt.pubname = ANY(%s) ORDER BY 2, 3", (list(publications),)).fetchall()
    # A table in several publications: the union of their columns, and any row passes that
    # passes one of their filters (no filter at all wins).
    merged: dict[int, tuple[str, str, set[str], list[str | None]]] = {}
    for oid, schema, name, attnames, rowfilter in rows:
        entry = merged.setdefault(oid, (schema, name, set(), []))
        entry[2].update(attnames or ())
        entry[3].append(rowfilter)
    wanted = None
    if only:
        wanted = set()
        for table in only:
            found = conn.execute("SELECT to_regclass(%s)::oid::int8", (table,)).fetchone()
            if not found or found[0] is None or found[0] not in merged:
                raise VerifyError(f"table {table!r} is not in publication(s) {', '.join(publications)}")
            wanted.add(found[0])
    specs = []
    for oid, (schema, name, attnames, filters) in merged.items():
        if wanted is not None and oid not in wanted:
            continue
        columns = conn.execute(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = %s::oid AND attnum > 0 "
            "AND NOT attisdropped AND attgenerated = '' ORDER BY attnum", (oid,)).fetchall()
        key = conn.execute(
            "SELECT a.attname::text, t.typname::text FROM pg_index i "
            "CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, n) "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            "JOIN pg_type t ON t.oid = a.atttypid "
            "WHERE i.indexrelid = (SELECT indexrelid FROM pg_index WHERE indrelid = %s::oid AND "
            "indisvalid AND (indisprimary OR indisreplident) ORDER BY indisprimary DESC LIMIT 1) "
            "ORDER BY k.n", (oid,)).fetchall()
        published = tuple(c for (c,) in columns if not attnames or c in attnames)
        row_filter = None if None in filters else " OR ".join(f"({f})" for f in filters)
        specs.append(TableSpec(schema, name, published, tuple(k for k, _ in key),
                               len(key) == 1 and key[0][1] in ("int2", "int4", "int8"), row_filter))
    return specs
