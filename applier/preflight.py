"""Read-only checks before a command creates anything, so that a failed start leaves nothing behind.

Owns what ``applier sync`` must know of both servers before its first write, and what
``applier run --create-slot`` must know of the source before it creates its slot: the connections
work (a refused password or a missing database is reported, not retried); the source has
``wal_level = logical``, a role that may replicate, every publication, and either a pgoutput slot
of this database or room for a new one (a free replication slot and a free WAL sender); the
copy's role can read every published column and the sequences of the published tables (which
sync sets on the target once its copy is done, ``applier.lifecycle.sequences``); the target can
hold the ``applier`` bookkeeping schema, lets the role set ``session_replication_role`` (as every
copy and apply session does), has every published table with every published column and the
privileges the copy (or the apply) needs, or with ``--create-tables`` can create the missing
ones, and lets the role set the sequences it has. ``applier run --create-slot`` runs the same
checks of both servers (``check_start``) before it creates its bookkeeping schema or its slot.
Also whether the target has recorded anything for a slot (``applier skip`` refuses a slot
nothing knows). Each check returns every
problem it finds, each saying what is wrong and what to do, so that one run lists everything to
fix.

Must never create or change anything on either server: it only reads catalogs and settings. Must
never retry either: a failure retrying may cure (a refused or lost connection) is raised to the
caller, which owns the retrying.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from . import connections
from .config import ConfigError
from .errors import ApplierError, Cause, Directive, decide
from .lifecycle.sequences import published_sequences
from .lifecycle.servers import LifecycleError
from .progress.bookkeeping import SqlBookkeeping
from .quoting import ident
from .source.options import UnsupportedOption
from .source.slots import failover_slot as choose_failover
from .source.slots import publications_missing, slot_info
from .sync.catalog import CatalogError, PublishedTable, published_tables

__all__ = ["PreflightFailed", "connect", "check_source", "check_copy", "check_sequences",
           "check_target", "check_start", "slot_recorded"]

#: What the copy does to an existing target table: reads it (is it empty?), truncates it (a
#: restarted copy, --truncate-target) and loads it.
_COPY_PRIVILEGES = ("SELECT", "INSERT", "TRUNCATE")
#: What applying changes does to a target table (SELECT: the key columns an UPDATE or DELETE
#: reads, and INSERT ... ON CONFLICT).
_APPLY_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE")


class PreflightFailed(ApplierError):
    """The checks found problems; nothing has been created. ``problems``: one message each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(f"  - {problem}" for problem in problems),
                         cause=Cause.NEEDS_OPERATOR)
        self.problems = problems


def connect(dsn: str, side: str) -> psycopg.Connection[Any]:
    """An autocommit connection to the ``side`` ('source' or 'target') server.

    Raises ``PreflightFailed`` when retrying cannot help (authentication, a missing role or
    database, pg_hba.conf), and the psycopg error itself when it can (a refused connection).
    """
    try:
        return connections.connect(dsn, autocommit=True, application_name="applier preflight")
    except psycopg.OperationalError as exc:
        if decide(exc, side=side) is not Directive.STOP:
            raise
        reason = " ".join(str(exc).split())
        raise PreflightFailed([f"{side}: cannot connect: {reason}. Fix --{side} (user, password, "
                               "database) or the server's pg_hba.conf"]) from None


def check_source(conn: psycopg.Connection[Any], *, slot: str, publications: Sequence[str],
                 create_slot: bool) -> list[str]:
    """Problems that keep ``slot`` from streaming ``publications`` from this source database.

    ``create_slot``: a missing slot is to be created (``run --create-slot``, ``sync``), so the
    source needs room for it; otherwise a missing slot is itself the problem.
    """
    row = conn.execute(
        "SELECT pg_catalog.current_setting('wal_level'), "
        "pg_catalog.current_setting('max_replication_slots')::int, "
        "(SELECT count(*) FROM pg_catalog.pg_replication_slots), "
        "pg_catalog.current_setting('max_wal_senders')::int, "
        # Every WAL sender has a row here, whatever the role may see of it.
        "(SELECT count(*) FROM pg_catalog.pg_stat_replication), "
        "r.rolsuper OR r.rolreplication "
        "FROM pg_catalog.pg_roles r WHERE r.rolname = current_user").fetchone()
    assert row is not None
    wal_level, max_slots, slots, max_senders, senders, may_replicate = row
    who = _role(conn).as_string(conn)
    database = conn.info.dbname
    problems = []
    if wal_level != "logical":
        problems.append(f"source: wal_level is {wal_level!r}; logical decoding needs wal_level = "
                        "logical: set it (ALTER SYSTEM SET wal_level = logical) and restart the "
                        "source server")
    if not may_replicate:
        problems.append(f"source: role {who} may not replicate (it has neither "
                        f"REPLICATION nor SUPERUSER): ALTER ROLE {who} REPLICATION, as a "
                        "superuser")
    info = slot_info(conn, slot)
    if info is None and not create_slot:
        problems.append(f"source: replication slot {slot!r} does not exist; create it with "
                        "--create-slot (or applier sync)")
    elif info is None:
        if slots >= max_slots:
            problems.append(f"source: all {max_slots} replication slots are in use "
                            f"(max_replication_slots), so slot {slot!r} cannot be created: drop "
                            "one that nothing reads any more (pg_drop_replication_slot, or "
                            "applier drop for a retired replica), or raise max_replication_slots "
                            "and restart the source server")
        if senders >= max_senders:
            problems.append(f"source: all {max_senders} WAL senders are in use (max_wal_senders), "
                            f"so nothing could stream from slot {slot!r}: stop a replication "
                            "client, or raise max_wal_senders and restart the source server")
    elif info.plugin != "pgoutput":
        what = f"uses plugin {info.plugin!r}" if info.plugin else "is a physical slot"
        problems.append(f"source: slot {slot!r} {what}; applier needs a pgoutput slot: choose "
                        "another --slot, or drop this one (pg_drop_replication_slot) if nothing "
                        "else reads it")
    elif info.database != database:
        problems.append(f"source: slot {slot!r} belongs to database {info.database!r}, not "
                        f"{database!r}: point --source at that database, or choose another --slot")
    missing = publications_missing(conn, list(publications))
    if missing:
        problems.append(f"source: publication(s) {', '.join(map(repr, missing))} do not exist in "
                        f"database {database!r}: create them (CREATE PUBLICATION) or fix "
                        "--publication")
    return problems


def check_copy(conn: psycopg.Connection[Any], tables: Sequence[PublishedTable]) -> list[str]:
    """Problems reading the published columns of ``tables`` on the source, as the copy does."""
    pairs = [(table.oid, column) for table in tables for column in table.columns]
    denied: dict[int, list[str]] = {}
    for oid, column in conn.execute(
            "SELECT u.rel, u.col FROM unnest(%s::int8[], %s::text[]) AS u(rel, col) "
            "WHERE NOT pg_catalog.has_column_privilege(u.rel::oid, u.col, 'SELECT')",
            ([oid for oid, _ in pairs], [column for _, column in pairs])):
        denied.setdefault(oid, []).append(column)
    role = _role(conn)
    problems = []
    for table in tables:
        columns = denied.get(table.oid)
        if not columns:
            continue
        which = ("" if len(columns) == len(table.columns)
                 else f"column(s) {', '.join(map(ident, columns))} of ")
        grant = sql.SQL("GRANT SELECT ON {} TO {}").format(
            sql.Identifier(table.schema, table.name), role).as_string(conn)
        problems.append(f"source: role {role.as_string(conn)} may not read {which}"
                        f"{table.sql_name}, which the copy reads: {grant}")
    return problems


_TARGET_ROLE = """
    SELECT r.rolsuper, pg_catalog.has_database_privilege(pg_catalog.current_database(), 'CREATE'),
           n.oid IS NOT NULL, COALESCE(pg_catalog.has_schema_privilege(n.oid, 'USAGE'), false)
    FROM pg_catalog.pg_roles r
    LEFT JOIN pg_catalog.pg_namespace n ON n.nspname = 'applier'
    WHERE r.rolname = current_user
"""
_TARGET_TABLES = """
    SELECT n.oid IS NOT NULL, COALESCE(pg_catalog.has_schema_privilege(n.oid, 'CREATE'), false),
           c.oid IS NOT NULL,
           ARRAY(SELECT a.attname::text FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid
                 AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''),
           ARRAY(SELECT a.attname::text FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid
                 AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated <> ''),
           ARRAY(SELECT g.privilege FROM unnest(%(privileges)s::text[]) WITH ORDINALITY
                 AS g(privilege, i)
                 WHERE NOT pg_catalog.has_table_privilege(c.oid, g.privilege) ORDER BY g.i)
    FROM unnest(%(schemas)s::text[], %(names)s::text[]) WITH ORDINALITY AS u(schema_name, table_name, i)
    LEFT JOIN pg_catalog.pg_namespace n ON n.nspname = u.schema_name
    LEFT JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = u.table_name
                                       AND c.relkind IN ('r', 'p')
    ORDER BY u.i
"""


def check_target(conn: psycopg.Connection[Any], tables: Sequence[PublishedTable], *,
                 create_tables: bool, copy: bool = True) -> list[str]:
    """Problems the target has with holding the bookkeeping schema and receiving ``tables``
    (creating the missing ones with ``create_tables``), by a copy (``copy``) or by applying
    changes."""
    privileges, needs = (_COPY_PRIVILEGES, "the copy needs") if copy else (
        _APPLY_PRIVILEGES, "applying changes needs")
    row = conn.execute(_TARGET_ROLE).fetchone()
    assert row is not None
    superuser, create_in_database, schema_exists, schema_usage = row
    role = _role(conn)
    who = role.as_string(conn)
    grant_create = sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
        sql.Identifier(conn.info.dbname), role).as_string(conn)
    problems = []
    if schema_exists and not schema_usage:
        owner = sql.SQL("ALTER SCHEMA applier OWNER TO {}").format(role).as_string(conn)
        problems.append(f"target: role {who} may not use the bookkeeping schema applier: {owner}")
    elif not schema_exists and not create_in_database:
        create = sql.SQL("CREATE SCHEMA applier AUTHORIZATION {}").format(role).as_string(conn)
        problems.append(f"target: role {who} may not create the bookkeeping schema applier: "
                        f"{grant_create}, or have a superuser run {create}")
    if not superuser and not _may_set_replication_role(conn):
        grant = sql.SQL("GRANT SET ON PARAMETER session_replication_role TO {}").format(
            role).as_string(conn)
        problems.append(f"target: role {who} may not set session_replication_role, which keeps "
                        f"triggers and foreign keys quiet while rows are copied and applied: {grant}"
                        " (PostgreSQL 15+; before that only a superuser may)")
    rows = conn.execute(_TARGET_TABLES, {"privileges": list(privileges),
                                         "schemas": [t.schema for t in tables],
                                         "names": [t.name for t in tables]}).fetchall()
    schemas_to_create: list[str] = []
    for table, (schema_found, create_in_schema, found, columns, generated, lacking) in zip(tables, rows):
        if found:
            problems.extend(_column_problems(table, set(columns), set(generated)))
            if lacking:
                grant = sql.SQL("GRANT {} ON {} TO {}").format(
                    sql.SQL(", ").join(map(sql.SQL, lacking)),
                    sql.Identifier(table.schema, table.name), role).as_string(conn)
                problems.append(f"target: role {who} lacks {', '.join(lacking)} on "
                                f"{table.sql_name}, which {needs}: {grant}")
        elif not create_tables:
            problems.append(f"target table {table.sql_name} does not exist (create it, or use "
                            "--create-tables)")
        elif not schema_found:
            if not create_in_database and table.schema not in schemas_to_create:
                schemas_to_create.append(table.schema)
        elif not create_in_schema:
            grant = sql.SQL("GRANT CREATE ON SCHEMA {} TO {}").format(
                sql.Identifier(table.schema), role).as_string(conn)
            problems.append(f"target: role {who} may not create table {table.sql_name} for "
                            f"--create-tables: {grant}")
    for schema in schemas_to_create:
        problems.append(f"target: schema {ident(schema)} does not exist, and role {who} may "
                        f"not create it for --create-tables: {grant_create}, or create the schema "
                        "for it")
    return problems


def _column_problems(table: PublishedTable, columns: set[str], generated: set[str]) -> list[str]:
    problems = []
    for name in table.columns:
        if name not in columns:
            what = "has only a generated column" if name in generated else "has no column"
            problems.append(f"target table {table.sql_name} {what} {ident(name)} that the "
                            "source publishes: add it (with the source's type), or leave it out "
                            "of the publication's column list")
    return problems


def _may_set_replication_role(conn: psycopg.Connection[Any]) -> bool:
    if conn.info.server_version < 150000:
        return False  # no parameter privileges yet: superusers only
    row = conn.execute("SELECT pg_catalog.has_parameter_privilege("
                       "'session_replication_role', 'SET')").fetchone()
    return bool(row and row[0])


def check_sequences(source: psycopg.Connection[Any], target: psycopg.Connection[Any] | None,
                    publications: Sequence[str]) -> list[str]:
    """Problems reading the published tables' sequences on the source, and setting the ones the
    target has (sync sets them once its copy is done)."""
    try:
        sequences = published_sequences(source, publications)
    except LifecycleError:
        return []  # a missing publication: check_source names it
    names = [sequence.identifier.as_string(source) for sequence in sequences]
    # CASE: has_sequence_privilege raises for any other relation, and the planner may evaluate
    # a WHERE clause on pg_class rows before the join and relkind conditions have filtered them.
    find = ("SELECT u.i::int - 1 FROM unnest(%s::text[]) WITH ORDINALITY AS u(name, i) "
            "JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(u.name) "
            "WHERE CASE WHEN c.relkind = 'S' "
            "THEN NOT pg_catalog.has_sequence_privilege(c.oid, %s) ELSE false END")
    problems = []
    for conn, side, privilege, what in ((source, "source", "SELECT", "read"),
                                        (target, "target", "UPDATE", "set")):
        if conn is None:
            continue
        role = _role(conn)
        for (index,) in conn.execute(find, (names, privilege)):
            sequence = sequences[index]
            grant = sql.SQL("GRANT {} ON SEQUENCE {} TO {}").format(
                sql.SQL(privilege), sequence.identifier, role).as_string(conn)
            problems.append(f"{side}: role {role.as_string(conn)} may not {what} sequence "
                            f"{names[index]}, which sync sets on the target after its copy: {grant}")
    return problems


def check_start(source: str, target: str, *, slot: str, publications: Sequence[str],
                create_tables: bool, copy: bool, failover_slot: bool | None = None,
                two_phase: bool = False) -> list[str]:
    """Every problem ``applier sync`` (``copy``) or ``applier run --create-slot`` would meet,
    from the DSNs ``source`` and ``target``. A slot they would create as a failover slot when
    the source cannot have one (``--failover-slot`` on PostgreSQL 16, say) is a usage error:
    ``ConfigError``, as every option the source's version cannot honour is.

    A failure retrying may cure (a refused connection) is raised as the psycopg error.
    """
    problems: list[str] = []
    connections: list[psycopg.Connection[Any]] = []
    try:
        source_conn = _connect_into(source, "source", connections, problems)
        target_conn = _connect_into(target, "target", connections, problems)
        tables: list[PublishedTable] = []
        if source_conn is not None:
            problems.extend(check_source(source_conn, slot=slot, publications=publications,
                                         create_slot=True))
            if slot_info(source_conn, slot) is None:
                try:
                    choose_failover(failover_slot, source_conn.info.server_version, two_phase)
                except UnsupportedOption as exc:
                    raise ConfigError(str(exc)) from None
            try:
                tables = published_tables(source_conn, list(publications))
            except CatalogError as exc:
                problems.append(f"source: {exc}")
            if copy:
                problems.extend(check_copy(source_conn, tables))
                problems.extend(check_sequences(source_conn, target_conn, publications))
        if target_conn is not None:
            problems.extend(check_target(target_conn, tables, create_tables=create_tables,
                                         copy=copy))
        return problems
    finally:
        for conn in connections:
            conn.close()


def _connect_into(dsn: str, side: str, connections: list[psycopg.Connection[Any]],
                  problems: list[str]) -> psycopg.Connection[Any] | None:
    try:
        conn = connect(dsn, side)
    except PreflightFailed as exc:
        problems.extend(exc.problems)
        return None
    connections.append(conn)
    return conn


def slot_recorded(conn: psycopg.Connection[Any], slot: str) -> bool:
    """The target's bookkeeping names ``slot``: a worker or a sync has run for it (a schema not
    created yet names nothing)."""
    return SqlBookkeeping(conn).slot_recorded(slot)


def _role(conn: psycopg.Connection[Any]) -> sql.Identifier:
    row = conn.execute("SELECT current_user::text").fetchone()
    assert row is not None
    return sql.Identifier(row[0])
