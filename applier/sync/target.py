"""Target tables for the initial copy: created when missing (``--create-tables``) and planned.

Owns creating missing target tables from the source definitions (``definition``), the check that
a table is empty (or ``--truncate-target`` allows emptying it, or it holds our own unfinished
copy), the choice of COPY format per table, building secondary indexes after the data is in, and
the CHECK and foreign key constraints once the data of every table of the round is. That every published
table and column is there (or can be created) is checked before anything is created, by
``applier.preflight``. Must never copy rows or write sync state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg

from ..apply.mapping import MissingTargetTable, TargetTable, reflect_table
from ..connections import connect
from ..errors import ApplierError, Cause
from ..quoting import ident
from .catalog import PublishedTable, SourceColumn, source_column_types
from .definition import TableDefinition, table_definition
from .schema import read_table_schema

if TYPE_CHECKING:
    from sqlalchemy import Connection, Engine

__all__ = ["TargetCheckError", "TargetPlan", "prepare_targets", "target_session", "is_empty",
           "build_secondary_indexes", "add_constraints", "definitions"]

log = logging.getLogger(__name__)


class TargetCheckError(ApplierError):
    """A target table cannot receive the copy; nothing has been copied."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.NEEDS_OPERATOR)


@dataclass(frozen=True)
class TargetPlan:
    table: PublishedTable
    binary: bool                          # binary COPY: every column of identical built-in type
    definition: TableDefinition | None    # with --create-tables: its secondary indexes follow the data


def target_session(dsn: str, application_name: str) -> psycopg.Connection:
    """A target connection set up as the apply session is: replica role (user triggers and foreign
    keys stay quiet, as in the stream's apply), empty search_path, ISO dates."""
    conn = connect(dsn, autocommit=True, application_name=application_name)
    for setting in ("SET session_replication_role = replica",
                    "SELECT pg_catalog.set_config('search_path', '', false)",
                    "SET datestyle = ISO", "SET intervalstyle = postgres"):
        conn.execute(setting)
    return conn


def prepare_targets(source: psycopg.Connection, target: psycopg.Connection, engine: Engine,
                    tables: list[PublishedTable], *, create_tables: bool) -> list[TargetPlan]:
    """Create the missing target tables (with ``create_tables``; ``applier.preflight`` has
    checked that the others exist with every published column) and pick each COPY format."""
    # One catalog connection for every table (the engine opens a new one on each connect()); at
    # read committed it also sees the tables ``_create`` commits on ``target``.
    with engine.connect() as catalog:
        return _plan(source, target, catalog, tables, create_tables=create_tables)


def _plan(source: psycopg.Connection, target: psycopg.Connection, catalog: Connection,
          tables: list[PublishedTable], *, create_tables: bool) -> list[TargetPlan]:
    plans = []
    for table in tables:
        definition = (table_definition(read_table_schema(source, table.oid), table.columns)
                      if create_tables else None)
        try:
            existing = reflect_table(catalog, table.schema, table.name)
        except MissingTargetTable:
            if definition is None:
                raise  # dropped since the preflight saw it
            _create(target, table, definition)
            existing = reflect_table(catalog, table.schema, table.name)
        columns = source_column_types(source, table)
        plans.append(TargetPlan(table, _binary_safe(table, columns, existing), definition))
    return plans


def _create(target: psycopg.Connection, table: PublishedTable, definition: TableDefinition) -> None:
    with target.transaction():
        target.execute(f"CREATE SCHEMA IF NOT EXISTS {ident(table.schema)}")
        statements = (*definition.sequences, definition.create_table, *definition.key_indexes)
        try:
            for statement in statements:
                target.execute(statement)
        except psycopg.Error as exc:
            raise TargetCheckError(f"cannot create target table {table.sql_name}: "
                                   f"{str(exc).strip()}\n" + ";\n".join(statements)) from exc
    left_out = ", ".join(definition.left_out)
    log.info("created target table %s%s", table.sql_name,
             f" without {left_out}, which name(s) columns the publication leaves out"
             if left_out else "")


def _binary_safe(table: PublishedTable, source: dict[str, SourceColumn], target: TargetTable) -> bool:
    # Binary COPY carries type OIDs inside arrays and composites, and binary formats are per type:
    # only identical built-in types (same OIDs on every server) are safe. Anything else goes as
    # text. (A column dropped since the preflight: text too, and the COPY names it.)
    return all(source[name].builtin and name in target.columns
               and source[name].type_sql == target.columns[name].type_sql for name in table.columns)


def is_empty(target: psycopg.Connection, table: PublishedTable) -> bool:
    row = target.execute(f"SELECT NOT EXISTS (SELECT FROM {table.sql_name})").fetchone()
    return bool(row and row[0])


def _exists(target: psycopg.Connection, table: PublishedTable, name: str) -> bool:
    """A relation (an index) or a constraint of the table named ``name`` is there."""
    found = target.execute(
        "SELECT FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %(schema)s AND c.relname = %(name)s UNION ALL "
        "SELECT FROM pg_catalog.pg_constraint WHERE conrelid = %(table)s::pg_catalog.regclass "
        "AND conname = %(name)s",
        {"schema": table.schema, "name": name, "table": table.sql_name}).fetchone()
    return found is not None


def build_secondary_indexes(target: psycopg.Connection, plan: TargetPlan) -> None:
    """The source's other indexes and its unique and exclusion constraints, built after the
    copy so it did not maintain them. Idempotent: one of that name already there (a table redone
    after a crash, or made by hand) is kept."""
    assert plan.definition is not None
    for name, statement in plan.definition.secondary_indexes:
        if _exists(target, plan.table, name):
            continue
        try:
            target.execute(statement)
        except psycopg.Error as exc:
            # Not needed for correctness (the key exists): say so and carry on.
            log.warning("could not build %s on %s: %s (%s)", ident(name),
                        plan.table.sql_name, str(exc).strip(), statement)


def definitions(source: psycopg.Connection, tables: list[PublishedTable]) -> list[TargetPlan]:
    """Plans carrying only the definitions of ``tables`` (for ``add_constraints`` when nothing
    is copied)."""
    return [TargetPlan(table, False, table_definition(read_table_schema(source, table.oid),
                                                      table.columns)) for table in tables]


def add_constraints(target: psycopg.Connection, plans: list[TargetPlan]) -> None:
    """The source's CHECK and foreign key constraints on the tables of ``plans``, once every one
    of them holds its data: added NOT VALID, then validated as on the source, each in its own
    transaction. Idempotent: one of that name already there is only validated if it is not yet.
    One that cannot be added (a foreign key to a table the target lacks, rows that break it) is
    a warning; ``applier cutover`` lists it as a difference."""
    for plan in plans:
        if plan.definition is None:
            continue
        for constraint in plan.definition.constraints:
            try:
                with target.transaction():
                    there = target.execute(
                        "SELECT convalidated FROM pg_catalog.pg_constraint WHERE conrelid = "
                        "%s::pg_catalog.regclass AND conname = %s",
                        (plan.table.sql_name, constraint.name)).fetchone()
                    if there is None:
                        target.execute(constraint.add)
                    if constraint.validate is not None and not (there and there[0]):
                        target.execute(constraint.validate)
            except psycopg.Error as exc:
                log.warning("could not add constraint %s to %s: %s (%s)", ident(constraint.name),
                            plan.table.sql_name, str(exc).strip(), constraint.add)
