"""``sized_copy_sql``: a short COPY loads every row, one at a time; a long one in multi-row inserts.

The premise of ``sized_copy_sql`` is PostgreSQL's choice: a volatile WHERE clause makes COPY FROM
insert row by row. Its trace is in the WAL: a heap insert record a row, against one record a page
of rows for a multi-row insert. This checks that choice on each server version, with the text
and the binary format, and that no row is lost to the clause.
"""

from __future__ import annotations

import struct

import psycopg
import pytest
from psycopg import sql

from applier.apply.copy import ROW_BY_ROW_BELOW, copy_sql, sized_copy_sql
from applier.embedded import Database

ROWS = 2000
assert ROWS < ROW_BY_ROW_BELOW


def _text_data(first: int) -> bytes:
    return b"".join(f"{i}\tnote {i}\n".encode() for i in range(first, first + ROWS))


def _binary_data(first: int) -> bytes:
    rows = [struct.pack("!hi", 2, 4) + struct.pack("!i", i) + struct.pack("!i", len(note)) + note
            for i in range(first, first + ROWS) for note in [f"note {i}".encode()]]
    return b"PGCOPY\n\xff\r\n\x00" + bytes(8) + b"".join(rows) + b"\xff\xff"


def _wal_records(conn: psycopg.Connection) -> int:
    conn.execute("SELECT pg_catalog.pg_stat_force_next_flush()")  # flushed once this session idles
    return int(conn.execute("SELECT wal_records FROM pg_catalog.pg_stat_wal").fetchone()[0])


def _load(conn: psycopg.Connection, statement: str, data: bytes) -> int:
    """WAL records written while ``statement`` loads ``data`` (and the commit)."""
    before = _wal_records(conn)
    with conn.cursor().copy(statement) as copy:
        copy.write(data)
    return _wal_records(conn) - before


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_a_short_copy_loads_row_by_row_and_keeps_every_row(target_db: Database, binary: bool) -> None:
    target_db.execute("CREATE TABLE notes (id int, note text)")
    plain = copy_sql(sql.Identifier("notes"), [sql.Identifier("id"), sql.Identifier("note")], binary)
    data = _binary_data if binary else _text_data
    with psycopg.connect(target_db.dsn, autocommit=True) as conn:
        one_by_one = _load(conn, sized_copy_sql(plain, ROWS), data(0))
        in_pages = _load(conn, sized_copy_sql(plain, ROW_BY_ROW_BELOW), data(ROWS))
    # Other processes write a few records meanwhile; a row a record is far above a page a record.
    assert one_by_one >= ROWS > 4 * in_pages
    assert target_db.query("SELECT count(*), count(DISTINCT id), min(id), max(id) FROM notes "
                           "WHERE note = 'note ' || id") == [(2 * ROWS, 2 * ROWS, 0, 2 * ROWS - 1)]
