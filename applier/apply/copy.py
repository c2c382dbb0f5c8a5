"""COPY data for runs of inserts: pgoutput values in, ``COPY ... FROM STDIN`` data out.

The fast path sends a long run of inserts into one table as one COPY rather than multi-row
INSERTs: the target parses and plans no statement per thousand rows and converts each value with
the column type's input function, exactly as the INSERT's cast of a text parameter does. The
values are the bytes received; only COPY's own escapes are added (backslash, tab, newline,
carriage return; ``\\N`` for NULL).

Values the source sent in binary (the stream's binary option) are already in their type's send
format, which is what COPY's binary format carries: a binary tuple is the field count, then each
value's length and bytes (-1 for NULL), and the data has a fixed header and trailer around the
tuples (``copy_binary_data``). A row mixing text and binary values fits neither format and stays
on multi-row INSERTs.

A run too short to be worth a COPY of its own goes back to rows (``copy_text_rows``,
``copy_binary_rows``: the inverse of the two above) for a multi-row INSERT in the batch's pipeline;
``copy_fields`` reads chosen fields of every row straight into one list of statement parameters.

``copy_text`` and ``copy_fields`` run in C when the accelerator is built (``_speedups``);
``copy_text_pure`` and ``copy_fields_pure`` are the references, and ``APPLIER_PURE_PYTHON=1``
selects them as it does for the decoder.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from types import ModuleType

from psycopg import sql

from ..implementation import accelerator

__all__ = ["copy_binary", "copy_binary_data", "copy_binary_rows", "copy_fields", "copy_fields_pure",
           "copy_sql", "copy_text", "copy_text_pure", "copy_text_rows", "ROW_BY_ROW_BELOW", "sized_copy_sql"]

Row = tuple[bytes | None, ...]


def _field(value: bytes | None) -> bytes:
    if value is None:
        return b"\\N"
    if b"\\" in value or b"\t" in value or b"\n" in value or b"\r" in value:
        value = (value.replace(b"\\", b"\\\\").replace(b"\t", b"\\t").replace(b"\n", b"\\n")
                 .replace(b"\r", b"\\r"))
    return value


def copy_text_pure(rows: list[Row]) -> bytes:
    """``rows`` (tuples of bytes or None) as COPY text format, one line per row."""
    return b"".join(b"\t".join(map(_field, row)) + b"\n" for row in rows)


_NULL_FIELD = b"\xff\xff\xff\xff"
#: COPY binary's signature, flags (no OIDs) and header extension length (none); the trailer is a
#: field count of -1.
_BINARY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)
_BINARY_TRAILER = b"\xff\xff"


_ESCAPED = re.compile(rb"\\(.)", re.DOTALL)
_UNESCAPED = {b"\\": b"\\", b"t": b"\t", b"n": b"\n", b"r": b"\r"}


def _unescape(match: re.Match[bytes]) -> bytes:
    return _UNESCAPED[match.group(1)]


def copy_text_rows(data: bytes | bytearray) -> list[Row]:
    """COPY text lines (as ``copy_text`` writes them) back to rows of values."""
    rows: list[Row] = []
    for line in bytes(data).split(b"\n")[:-1]:
        rows.append(tuple(None if field == b"\\N" else _ESCAPED.sub(_unescape, field) if b"\\" in field
                          else field for field in line.split(b"\t")))
    return rows


def copy_binary_rows(tuples: bytes | bytearray) -> list[Row]:
    """COPY binary tuples (as ``copy_binary`` writes them, without header or trailer) back to rows."""
    rows: list[Row] = []
    view = memoryview(tuples)
    position, end = 0, len(tuples)
    while position < end:
        fields = int.from_bytes(view[position:position + 2], "big")
        position += 2
        row: list[bytes | None] = []
        for _ in range(fields):
            length = int.from_bytes(view[position:position + 4], "big", signed=True)
            position += 4
            if length < 0:
                row.append(None)
            else:
                row.append(bytes(view[position:position + length]))
                position += length
        rows.append(tuple(row))
    return rows


def copy_binary(rows: list[Row]) -> bytes:
    """``rows`` (tuples of binary values or None) as COPY binary tuples, without header or trailer."""
    out = bytearray()
    for row in rows:
        out += len(row).to_bytes(2, "big")
        for value in row:
            if value is None:
                out += _NULL_FIELD
            else:
                out += len(value).to_bytes(4, "big")
                out += value
    return bytes(out)


def copy_binary_data(tuples: bytes | bytearray) -> bytes:
    """COPY binary tuples (``copy_binary``, or a binary run's) as the whole COPY data."""
    return b"".join((_BINARY_HEADER, tuples, _BINARY_TRAILER))


def copy_binary_tuples(data: bytes | bytearray) -> bytes:
    """The tuples of whole COPY binary data (``copy_binary_data``'s inverse)."""
    if not (data.startswith(_BINARY_HEADER) and data.endswith(_BINARY_TRAILER)):
        raise ValueError("not COPY binary data with its header and trailer")
    return bytes(data[len(_BINARY_HEADER):len(data) - len(_BINARY_TRAILER)])


def copy_fields_pure(data: bytes | bytearray, binary: bool, order: tuple[int, ...]) -> list[bytes | None]:
    """The values of COPY data (``copy_text`` lines, or binary tuples without header and trailer)
    in one list: for each row, its fields at the positions in ``order``."""
    rows = copy_binary_rows(data) if binary else copy_text_rows(data)
    return [row[i] for row in rows for i in order]


def _accelerated() -> ModuleType | None:
    return accelerator("protocol._speedups")


_speedups = _accelerated()
copy_text: Callable[[list[Row]], bytes] = (
    copy_text_pure if _speedups is None else _speedups.copy_text)
copy_fields: Callable[[bytes | bytearray, bool, tuple[int, ...]], list[bytes | None]] = (
    copy_fields_pure if _speedups is None else _speedups.copy_fields)


def copy_sql(table: sql.Composable, columns: Sequence[sql.Composable], binary: bool = False) -> str:
    return sql.SQL("COPY {} ({}) FROM STDIN{}").format(
        table, sql.SQL(", ").join(columns), sql.SQL(" (FORMAT binary)" if binary else "")).as_string()


#: A COPY of fewer rows than this loads them one at a time (``sized_copy_sql``).
ROW_BY_ROW_BELOW = 5000
#: True for every row, and volatile: PostgreSQL then inserts a COPY's rows one at a time.
_ROW_BY_ROW = " WHERE pg_catalog.clock_timestamp() IS NOT NULL"


def sized_copy_sql(copy: str, rows: int | None) -> str:
    """``copy`` (a ``COPY ... FROM STDIN`` of ``copy_sql`` or the change feed's) as sent for
    ``rows`` rows: below ``ROW_BY_ROW_BELOW``, with a WHERE clause that keeps every row and makes
    PostgreSQL insert them one at a time.

    Why: COPY FROM buffers rows for multi-row inserts in up to 1,000 tuple slots (a buffer is
    flushed at 1,000 rows or 64 kB), and every slot pins the table's row type in the resource
    owner. Those pins are identical, so they all hash to one place in the owner's open-addressing
    table, and adding and releasing them costs time quadratic in the slots, paid again by every
    COPY: a third of the target backend's time on COPYs of a few hundred rows (PostgreSQL 18;
    the same hashing on 15). A volatile WHERE clause makes COPY insert row by row through one
    slot, which costs a little more per row (a WAL record a row rather than a page): it wins
    below a few thousand rows and loses above (docs/performance.md, "The resource owner's
    quadratic")."""
    if rows is None or rows >= ROW_BY_ROW_BELOW:
        return copy
    return copy + _ROW_BY_ROW
