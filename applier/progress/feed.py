"""The change feed's storage: change tables, their names, columns and partitions, and the SQL of
every write to them.

A change table (schema ``applier_changes``, one per source table the feed records) holds one row
per row change the worker applied to that table: five meta columns, then the table's columns
(nullable, typed as the target table's). It is partitioned by range of the source commit LSN,
so old history goes with one ``DROP TABLE`` of a partition, and a read of an LSN range touches
only the partitions it covers:

* regular partitions are contiguous: ``[0/0, a)``, ``[a, b)``, ... each created (by the apply
  session, in the target transaction of the first change row that needs it) when a commit LSN
  reaches the newest one's upper bound, sized from the WAL rate seen so far to last about one
  seventh of the retention;
* the *pending* partition ``[FFFFFFFF/FFFFFFFF, MAXVALUE)`` holds rows whose commit LSN is not
  known yet (a transaction applied as it streams, or prepared on the target), written with the
  placeholder ``PENDING`` and moved to their commit LSN in the target transaction that records
  that commit (``fix_pending_sql``).

Each source transaction that wrote change rows also leaves its commit LSN and end LSN in
``applier.change_commits``, in the same target transaction: the end LSN is known only at the
Commit, after a large transaction's change rows may already be on the target, so it is kept once
per transaction rather than in every change row, and as arrays, a row for up to
``COMMITS_PER_ROW`` transactions a target transaction (or part of one) recorded. Readers join it
by commit LSN.

Owns the layout (``ChangeTable``, ``META_COLUMNS``, names within 63 bytes) and composes every
statement that writes change rows or changes change tables (psycopg.sql for identifiers and
literals), for the apply stage to send in its own target transaction; ``feed_registry`` runs
the rest (registration, partitions, pruning, reads). Pure: must never run anything, nor import
the apply stage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from psycopg import sql

from ..protocol.lsn import LSN

__all__ = ["SCHEMA", "META_COLUMNS", "META_TYPES", "PENDING", "OPS", "ChangeTable", "Partition",
           "change_table_name", "partition_name", "create_table_sql", "partition_sql",
           "add_column_sql", "alter_type_sql", "insert_prefix", "copy_sql", "wrap_sql",
           "marker_sql", "fix_pending_sql", "returning", "meta_placeholders", "fit", "next_partition",
           "partition_row_sql", "MIN_SPAN", "MAX_SPAN", "first_span", "lsn_element", "commits_rows", "COMMITS_PER_ROW",
           "commits_copy_sql", "commit_sql"]

SCHEMA = "applier_changes"
#: The meta columns, in table order: source commit LSN, commit time, xid, the change's order in
#: its transaction, and the operation. A source column of one of these names cannot be recorded.
META_COLUMNS = ("change_commit_lsn", "change_commit_time", "change_xid", "change_seq", "change_op")
META_TYPES = ("pg_catalog.pg_lsn", "pg_catalog.timestamptz", "pg_catalog.int8", "pg_catalog.int8",
              'pg_catalog."char"')
#: The commit LSN of rows whose transaction has not committed yet (the pending partition's).
PENDING = LSN(2**64 - 1)
#: Operations: insert, update, delete, truncate (one marker row per truncated table).
OPS = ("I", "U", "D", "T")
_NAME_BYTES = 63
#: Bounds of a partition's LSN span.
MIN_SPAN, MAX_SPAN = 64 * 1024, 1 << 40
#: Before any WAL rate is known, a partition is sized for 64kB of WAL a second, at most 16MB:
#: small, so that the next one, sized from a measured rate, comes soon.
_GUESSED_RATE, _FIRST_MAX = 64 * 1024, 16 * 1024**2


@dataclass
class Partition:
    """A regular partition: ``[from_lsn, to_lsn)``, created at ``created_at`` for a change
    committed at ``opened_lsn`` (the two give the WAL rate that sizes the next one)."""

    name: str
    from_lsn: LSN
    to_lsn: LSN
    opened_lsn: LSN
    created_at: datetime


@dataclass(eq=False)
class ChangeTable:
    """The change table of one source table, as the registry describes it."""

    id: int
    slot: str
    schema: str                  # the source (and target) table
    table: str
    name: str                    # the change table, in SCHEMA
    columns: dict[str, str]      # recorded column -> its type (format_type), in table order
    retained_after: LSN          # every change committed after this LSN is in the table
    newest: Partition            # the partition with the highest bounds
    partitions: int = 0          # regular partitions created so far (numbers their names)
    stopped_lsn: LSN | None = None

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(SCHEMA, self.name)

    @property
    def display(self) -> str:
        return f"{self.schema}.{self.table}"


def fit(text: str, limit: int = _NAME_BYTES) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8, never inside a character."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit].decode(errors="ignore")


def change_table_name(schema: str, table: str, slot: str, taken: set[str]) -> str:
    """``schema.table`` when it fits in 63 bytes and no other change table has it; else a cut
    form with a hash of slot, schema and table (unique whatever the names)."""
    plain = f"{schema}.{table}"
    if len(plain.encode()) <= _NAME_BYTES and plain not in taken:
        return plain
    digest = hashlib.sha256(f"{slot}\0{schema}\0{table}".encode()).hexdigest()[:10]
    return fit(plain, _NAME_BYTES - 11) + "~" + digest


def partition_name(change_table: ChangeTable, number: int | None) -> str:
    """``<id>.<number>:<change table>`` (``<id>.pending:...`` for the pending partition), cut to
    63 bytes: the prefix keeps it unique."""
    return fit(f"{change_table.id}.{'pending' if number is None else number}:{change_table.name}")


def first_span(interval: float) -> int:
    """The LSN span of a partition sized before any WAL rate is known."""
    return min(_FIRST_MAX, max(MIN_SPAN, int(_GUESSED_RATE * interval)))


def next_partition(change_table: ChangeTable, lsn: LSN, now: datetime,
                   interval: float) -> Partition:
    """The partition to create for a change committed at ``lsn``, beyond the newest one: from
    its upper bound to ``lsn`` plus the WAL the source wrote in ``interval`` seconds at the rate
    seen since the newest one was created (within MIN_SPAN and MAX_SPAN)."""
    newest = change_table.newest
    seconds = (now - newest.created_at).total_seconds()
    written = max(0, int(lsn) - int(newest.opened_lsn))
    # No rate without a position to measure from (a slot that had applied nothing yet).
    if seconds <= 0 or not newest.opened_lsn:
        span = first_span(interval)
    else:
        span = min(MAX_SPAN, max(MIN_SPAN, int(written / seconds * interval)))
    upper = LSN(min(int(PENDING), int(lsn) + span))
    return Partition(partition_name(change_table, change_table.partitions + 1), newest.to_lsn,
                     upper, lsn, now)


# -- the table and its partitions -------------------------------------------------------------------

def create_table_sql(name: str, columns: dict[str, str]) -> list[sql.Composable]:
    """The partitioned parent and its BRIN index on the commit LSN (partitions inherit it)."""
    ident = sql.Identifier(SCHEMA, name)
    meta = [sql.SQL("{} {}{}").format(sql.Identifier(column), sql.SQL(kind),
                                      sql.SQL("" if column == META_COLUMNS[1] else " NOT NULL"))
            for column, kind in zip(META_COLUMNS, META_TYPES)]
    data = [sql.SQL("{} {}").format(sql.Identifier(column), sql.SQL(kind))
            for column, kind in columns.items()]
    return [sql.SQL("CREATE TABLE {} ({}) PARTITION BY RANGE ({})").format(
                ident, sql.SQL(", ").join(meta + data), sql.Identifier(META_COLUMNS[0])),
            sql.SQL("CREATE INDEX ON {} USING brin ({})").format(ident, sql.Identifier(META_COLUMNS[0]))]


def partition_sql(change_table: ChangeTable, name: str, lower: LSN,
                  upper: LSN | None) -> list[sql.Composable]:
    """A partition ``[lower, upper)`` (``upper`` None: up to MAXVALUE): created apart, then
    attached, which takes only SHARE UPDATE EXCLUSIVE on the parent (CREATE TABLE ... PARTITION
    OF would take ACCESS EXCLUSIVE, and wait for every reader of the change table)."""
    ident = sql.Identifier(SCHEMA, name)
    bound = sql.SQL("MAXVALUE") if upper is None else sql.Literal(str(upper))
    return [sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS)").format(ident, change_table.ident),
            sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
                change_table.ident, ident, sql.Literal(str(lower)), bound)]


def partition_row_sql(change_table: ChangeTable, partition: Partition) -> str:
    """The registry row of a partition (``applier.change_partitions``)."""
    return sql.SQL("INSERT INTO applier.change_partitions (change_table, partition_name, from_lsn, "
                   "to_lsn, opened_lsn, created_at) VALUES ({}, {}, {}::pg_catalog.pg_lsn, "
                   "{}::pg_catalog.pg_lsn, {}::pg_catalog.pg_lsn, {}::pg_catalog.timestamptz)").format(
        sql.Literal(change_table.name), sql.Literal(partition.name),
        sql.Literal(str(partition.from_lsn)), sql.Literal(str(partition.to_lsn)),
        sql.Literal(str(partition.opened_lsn)), sql.Literal(partition.created_at.isoformat())
    ).as_string()


def add_column_sql(change_table: ChangeTable, column: str, type_sql: str) -> sql.Composable:
    return sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(
        change_table.ident, sql.Identifier(column), sql.SQL(type_sql))


def alter_type_sql(change_table: ChangeTable, column: str, type_sql: str) -> sql.Composable:
    return sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {}").format(
        change_table.ident, sql.Identifier(column), sql.SQL(type_sql))


# -- change rows --------------------------------------------------------------------------------

def meta_placeholders(first: int) -> list[sql.Composable]:
    """``$first::pg_lsn, ..`` for commit LSN, commit time, xid and order (the op is a literal)."""
    return [sql.SQL("${}::{}").format(sql.SQL(str(first + i)), sql.SQL(kind))
            for i, kind in enumerate(META_TYPES[:4])]


def insert_prefix(change_table: ChangeTable, columns: Sequence[str]) -> sql.Composable:
    """``INSERT INTO <change table> (<meta>, <columns>)``."""
    return sql.SQL("INSERT INTO {} ({})").format(
        change_table.ident, sql.SQL(", ").join(map(sql.Identifier, (*META_COLUMNS, *columns))))


def copy_sql(change_table: ChangeTable, columns: Sequence[str], binary: bool) -> str:
    """``COPY <change table> (<meta>, <columns>) FROM STDIN``: each row starts with the meta."""
    return sql.SQL("COPY {} ({}) FROM STDIN{}").format(
        change_table.ident, sql.SQL(", ").join(map(sql.Identifier, (*META_COLUMNS, *columns))),
        sql.SQL(" (FORMAT binary)" if binary else "")).as_string()


def returning(meta: Sequence[sql.Composable], columns: Sequence[str],
              qualifier: str | None = None) -> sql.Composable:
    """`` RETURNING <meta> AS <meta names>, <columns>`` for a data statement whose changed rows
    become change rows (``qualifier``: the table's alias in that statement)."""
    named = [sql.SQL("{} AS {}").format(expr, sql.Identifier(name))
             for expr, name in zip(meta, META_COLUMNS)]
    cols = [sql.Identifier(qualifier, c) if qualifier else sql.Identifier(c) for c in columns]
    return sql.SQL(" RETURNING {}").format(sql.SQL(", ").join([*named, *cols]))


def wrap_sql(change_table: ChangeTable, data: sql.Composable, columns: Sequence[str],
             op: str) -> str:
    """``WITH c AS (<data ... RETURNING>) INSERT INTO <change table> SELECT ... FROM c``: one
    statement that changes the rows and records a change row for each (so its row count is the
    data statement's). ``data`` ends with ``returning(...)`` of the same ``columns``."""
    assert op in OPS
    picked = [sql.Identifier(name) for name in META_COLUMNS[:4]]
    return sql.SQL("WITH applier_changed AS ({}) {} SELECT {}, {}{} FROM applier_changed").format(
        data, insert_prefix(change_table, columns), sql.SQL(", ").join(picked), sql.Literal(op),
        sql.SQL("").join(sql.SQL(", {}").format(sql.Identifier(c)) for c in columns)).as_string()


def marker_sql(change_table: ChangeTable, commit_lsn: LSN, commit_time: datetime | None, xid: int,
               seq: int, op: str = "T") -> str:
    """One change row with the meta only (a truncate's marker), values as literals."""
    return sql.SQL("{} VALUES ({}::pg_catalog.pg_lsn, {}::pg_catalog.timestamptz, {}, {}, {})").format(
        insert_prefix(change_table, ()), sql.Literal(str(commit_lsn)),
        sql.Literal(commit_time.isoformat() if commit_time else None), sql.Literal(xid),
        sql.Literal(seq), sql.Literal(op)).as_string()


def fix_pending_sql(change_table: ChangeTable, xid: int, commit_lsn: LSN,
                    commit_time: datetime | None) -> str:
    """Move the pending rows of source transaction ``xid`` to its commit LSN and time (into the
    partition of that LSN), in the target transaction that records its commit."""
    return sql.SQL("UPDATE {} SET {} = {}::pg_catalog.pg_lsn, {} = {}::pg_catalog.timestamptz "
                   "WHERE {} = {}::pg_catalog.pg_lsn AND {} = {}").format(
        change_table.ident, sql.Identifier(META_COLUMNS[0]), sql.Literal(str(commit_lsn)),
        sql.Identifier(META_COLUMNS[1]), sql.Literal(commit_time.isoformat() if commit_time else None),
        sql.Identifier(META_COLUMNS[0]), sql.Literal(str(PENDING)), sql.Identifier(META_COLUMNS[2]),
        sql.Literal(xid)).as_string()


# -- the source transactions that wrote change rows ------------------------------------------------

#: Columns of ``applier.change_commits`` (``commits_copy_sql``).
_COMMIT_COLUMNS = ("slot_name", "first_lsn", "last_lsn", "commit_lsns", "end_lsns")


def lsn_element(lsn: LSN) -> bytes:
    """``lsn`` as an element of ``commits_rows``' arrays, comma included (the C lane writes the
    same)."""
    return b"%X/%X," % (lsn >> 32, lsn & 0xFFFFFFFF)


#: Transactions per row of ``applier.change_commits``: two arrays of this many LSNs keep a row
#: under the size from which PostgreSQL compresses it and stores it out of line (TOAST, about
#: 2kB), which made a row of 625 transactions take 1.4 ms to write here.
COMMITS_PER_ROW = 96


def commits_rows(slot: str, commit_lsns: bytes | bytearray, end_lsns: bytes | bytearray) -> tuple[bytes, int]:
    """Rows of ``applier.change_commits`` as COPY text lines, and how many: the transactions whose
    commit LSNs (in commit order) and end LSNs are ``lsn_element``s in ``commit_lsns`` and
    ``end_lsns``. A slot name is made of lower-case letters, digits and underscores: it needs no
    escaping."""
    assert slot.replace("_", "").isalnum() and commit_lsns and end_lsns, slot
    name = slot.encode()
    commits, ends = bytes(commit_lsns[:-1]).split(b","), bytes(end_lsns[:-1]).split(b",")
    lines = [b"%s\t%s\t%s\t{%s}\t{%s}\n" % (name, commits[i], commits[min(i + COMMITS_PER_ROW, len(commits)) - 1],
                                            b",".join(commits[i:i + COMMITS_PER_ROW]),
                                            b",".join(ends[i:i + COMMITS_PER_ROW]))
             for i in range(0, len(commits), COMMITS_PER_ROW)]
    return b"".join(lines), len(lines)


def commits_copy_sql() -> str:
    """``COPY applier.change_commits (...) FROM STDIN``, for ``commits_rows``."""
    return sql.SQL("COPY applier.change_commits ({}) FROM STDIN").format(
        sql.SQL(", ").join(map(sql.Identifier, _COMMIT_COLUMNS))).as_string()


def commit_sql(slot: str, commit_lsn: LSN, end_lsn: LSN) -> str:
    """The row of one source transaction that wrote change rows, as an INSERT."""
    commit, end = sql.Literal(str(commit_lsn)), sql.Literal(str(end_lsn))
    return sql.SQL("INSERT INTO applier.change_commits ({}) VALUES ({}, {}::pg_catalog.pg_lsn, "
                   "{}::pg_catalog.pg_lsn, ARRAY[{}::pg_catalog.pg_lsn], ARRAY[{}::pg_catalog.pg_lsn])").format(
        sql.SQL(", ").join(map(sql.Identifier, _COMMIT_COLUMNS)), sql.Literal(slot), commit, commit,
        commit, end).as_string()
