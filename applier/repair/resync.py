"""``applier resync``: have the worker copy published tables again.

Owns the checks made before anything changes, every problem listed at once (each table is
published and has its target table; a target table has no column the source does not publish,
whose values the copy would lose, unless ``--keep-target-columns``; no other table's foreign key
references it, which the copy's TRUNCATE would refuse; a worker has run for the slot), and the
request: the tables marked ``resync`` in ``applier.publication_tables`` with its record in
``applier.repairs``, in one target transaction. A running worker notices within a second and
copies them beside its stream; with none running, the next ``applier run`` copies them before
streaming (``worker.publication``). ``verify --repair`` asks for a resync of the tables it cannot
repair by key the same way. Must never copy or empty a table itself.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from ..config import Settings, parse_table_name
from ..connections import connect
from ..exit_codes import ExitCode
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.lock import lock_holder
from ..progress.records import TableName
from ..progress.repairs import Repairs
from ..progress.schema import SchemaError, make_engine, upgrade_schema
from ..sync.catalog import PublishedTable, published_tables

__all__ = ["ResyncRefused", "request_resync", "resync_problems", "run_resync"]

log = logging.getLogger(__name__)


class ResyncRefused(Exception):
    """A resync cannot be asked for; the problems say why and what to do."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(f"- {p}" for p in problems))
        self.problems = problems


def resync_problems(published: Sequence[PublishedTable], target: psycopg.Connection[Any],
                    slot: str, tables: Sequence[TableName], *, keep_target_columns: bool) -> list[str]:
    """Why ``tables`` cannot be copied again (empty when they can); reads only."""
    problems = []
    by_key = {t.key: t for t in published}
    if not SqlBookkeeping(target).publication_tables(slot):
        problems.append(f"no worker has run for slot {slot!r} on this target: applier sync copies "
                        "every table (or check --slot)")
    for key in tables:
        table = by_key.get(key)
        name = f"{key[0]}.{key[1]}"
        if table is None:
            problems.append(f"{name} is not published by the publication(s): only published "
                            "tables are copied")
            continue
        found = target.execute("SELECT pg_catalog.to_regclass(%s)::oid", (table.sql_name,)).fetchone()
        if found is None or found[0] is None:
            problems.append(f"target table {table.sql_name} does not exist")
            continue
        columns = [r[0] for r in target.execute(
            "SELECT attname::text FROM pg_catalog.pg_attribute WHERE attrelid = %s AND attnum > 0 "
            "AND NOT attisdropped AND attgenerated = '' ORDER BY attnum", (found[0],))]
        own = [c for c in columns if c not in table.columns]
        if own and not keep_target_columns:
            problems.append(f"target table {table.sql_name} has column(s) the source does not "
                            f"publish ({', '.join(own)}): the copy empties the table and their "
                            "values would be lost; pass --keep-target-columns to copy it anyway")
        referencing = [r[0] for r in target.execute(
            "SELECT conrelid::regclass::text FROM pg_catalog.pg_constraint WHERE contype = 'f' "
            "AND confrelid = %s AND conrelid <> confrelid AND NOT conrelid = ANY(%s::regclass[])",
            (found[0], [by_key[k].sql_name for k in tables if k in by_key]))]
        if referencing:
            problems.append(f"target table {table.sql_name} is referenced by foreign keys of "
                            f"{', '.join(sorted(set(referencing)))}, so the copy could not empty "
                            "it: resync those tables with it, or drop the constraints")
    return problems


def request_resync(target_dsn: str, slot: str, tables: Sequence[TableName]) -> None:
    """Mark ``tables`` for the worker to copy again (the schema brought up to date first)."""
    engine = make_engine(target_dsn)
    try:
        upgrade_schema(engine)
    finally:
        engine.dispose()
    with connect(target_dsn) as conn:
        Repairs(conn).request_resync(slot, tables)


def run_resync(settings: Settings) -> int:
    """``applier resync``: 0 once requested, 1 when refused (nothing changed) or failed."""
    settings.require("source", "target", "slot", "publication", "table")
    slot, target_dsn = settings.required("slot"), settings.required("target")
    tables = list(dict.fromkeys(parse_table_name(name.strip(), "table")
                                for value in settings.table for name in value.split(",") if name.strip()))
    try:
        with connect(settings.required("source"), autocommit=True) as source:
            published = published_tables(source, settings.publication)
        with connect(target_dsn, autocommit=True) as target:
            problems = resync_problems(published, target, slot, tables,
                                       keep_target_columns=settings.keep_target_columns)
            running = lock_holder(target, slot) is not None
        if problems:
            raise ResyncRefused(problems)
        request_resync(target_dsn, slot, tables)
    except ResyncRefused as exc:
        print(f"applier resync: nothing was changed; fix {'this' if len(exc.problems) == 1 else 'these'}"
              f" and run it again:\n{exc}", file=sys.stderr)
        return ExitCode.FAILED
    except (psycopg.Error, SchemaError) as exc:
        print(f"applier resync: {' '.join(str(exc).split())}", file=sys.stderr)
        return ExitCode.FAILED
    names = ", ".join(f"{s}.{t}" for s, t in tables)
    print(f"{names}: marked to be copied again for slot {slot!r}. "
          + ("The running worker copies it within seconds, beside its stream"
             if running else "No worker is running: the next applier run copies it first")
          + "; applier status shows the copy and its record.")
    return ExitCode.OK
