"""The fast path's recorded changes: ``Op``, the statements they become (``BatchStatement``), the
run protocols of the lane, the change feed's rows buffered per table (``FeedRows``), the sizes of
multi-row statements, and the helpers that read a row's values and formats.

Owns only these shapes and sizes. Must never build SQL (``fast.sql``, ``feed.rows``) or record
anything (``batch``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ...progress.feed import ChangeTable
from ...protocol.messages import KIND_BINARY, KIND_TEXT, KIND_UNCHANGED, TupleData
from ..feed.meta import Meta
from ..mapping import RelationMapping

__all__ = ["BatchStatement", "COPY", "ChangeRowsCopy", "COPY_MIN_ROWS", "DELETE", "DELETES", "FEED_ROWS", "FORMATS",
           "FeedRows", "INSERT", "KeyRun", "MOVED", "Op", "Run", "SQL_TEXT", "UPDATE", "UPDATES",
           "chunks", "collect", "every_column", "in_format", "present_columns"]

#: Op kinds. MOVED: the change row of the delete of a key an update moved its row from, when the
#: old row cannot go with ``FEED_ROWS``; FEED_ROWS: the change rows of one table written from the
#: values the source sent (``FeedRows``).
INSERT, UPDATE, DELETE, SQL_TEXT, COPY, UPDATES, DELETES, MOVED, FEED_ROWS = range(9)
#: Rows per multi-row statement: a small ladder keeps the number of prepared shapes small.
_LADDER = (1000, 100, 10, 1)
_MAX_PARAMS = 65_000
#: Runs of inserts at least this long go as one COPY: below it, leaving pipeline mode for the
#: COPY (two round trips of its own, and one more for what was queued before it) costs more than
#: the multi-row INSERTs it replaces, which join the batch's pipeline. The lane's runs are held as
#: COPY data; a short one is read back into rows for those INSERTs.
COPY_MIN_ROWS = 200


@dataclass(slots=True)
class Op:
    kind: int
    mapping: RelationMapping | None
    row: TupleData | None          # new row (insert, update) or old row (delete)
    old: TupleData | None          # update: the old key/row when sent
    shape: tuple                   # what makes two ops share one statement
    sql: str = ""                  # SQL_TEXT ops: a statement sent as is (TRUNCATE)
    run: Run | KeyRun | FeedRows | None = None  # COPY, UPDATES, DELETES, FEED_ROWS ops: the run
    meta: Meta | None = None       # a table the change feed records: the change's meta
    savepoint: str | None = None   # SQL_TEXT ops that make a savepoint: its name (quoted)


@dataclass(slots=True)
class FeedRows:
    """Change rows of one recorded table whose values the source sent whole (inserts, updates of
    every column, the old key of a moved row): (meta, op, row), written as they are."""

    mapping: RelationMapping
    rows: list[tuple[Meta, str, TupleData]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ChangeRowsCopy:
    """What a COPY of change rows writes: the change table, and whether its data is binary."""

    change_table: ChangeTable
    binary: bool


@dataclass(slots=True)
class BatchStatement:
    """One statement to send: a cache key for its prepared form, SQL, values and the row count."""

    cache_key: tuple | None        # None: send unprepared (rare statements, COPY)
    sql: str
    values: list[bytes | None]
    formats: list[int]
    expected_rows: int | None
    copy_data: bytes | bytearray | None = None  # COPY ... FROM STDIN: its data (text or binary)
    change_rows: ChangeRowsCopy | None = None   # a COPY of change rows (feed.spool may hold it)
    savepoint: str | None = None   # the statement makes this savepoint (its name, quoted)


_ALL_COLUMNS: dict[int, tuple[int, ...]] = {}
#: Column kind bytes -> parameter formats (b -> 1 binary; t, n -> 0 text), one C call per row.
FORMATS = bytes(1 if i == KIND_BINARY else 0 for i in range(256))


def every_column(width: int) -> tuple[int, ...]:
    every = _ALL_COLUMNS.get(width)
    if every is None:
        every = _ALL_COLUMNS[width] = tuple(range(width))
    return every


def in_format(kinds: bytes, binary: bool) -> bool:
    """Every value of a row is in the given format (binary, else text) or NULL, none unchanged."""
    return KIND_UNCHANGED not in kinds and (KIND_TEXT if binary else KIND_BINARY) not in kinds


def present_columns(row: TupleData) -> tuple[int, ...]:
    kinds = row.kinds
    if KIND_UNCHANGED not in kinds:  # the common case: every column was sent
        return every_column(len(kinds))
    return tuple(i for i, kind in enumerate(kinds) if kind != KIND_UNCHANGED)


class Run(Protocol):
    """Inserts into one table as COPY text lines or (``binary``) COPY binary tuples, each with every
    column (``_lane.Run``)."""

    data: bytearray
    columns: int
    rows: int
    binary: bool
    feed: bytearray | None   # a recorded table's change rows (meta, then the row), else None
    feed_rows: int


class KeyRun(Protocol):
    """Updates of every column (``whole_rows``) or deletes of one table by its key
    (``_lane.KeyRun``), values in text or (``binary``) binary: ``rows`` holds every change in
    order (a delete's key alone) until ``batch.fold_key_run`` folds them in place; ``len()`` is
    the rows held."""

    columns: int
    keys: tuple[int, ...]
    whole_rows: bool
    binary: bool
    rows: list[tuple[bytes | None, ...]]
    feed: bytearray | None   # a recorded table's change rows, one per change, else None
    feed_rows: int

    def __len__(self) -> int: ...

    def add(self, values: tuple[bytes | None, ...]) -> None: ...

    def params(self, start: int, stop: int) -> list[bytes | None]: ...


def collect(row: TupleData | None, positions: tuple[int, ...], values: list[bytes | None],
             formats: list[int]) -> None:
    assert row is not None
    row_values, kinds = row.values, row.kinds
    if len(positions) == len(row_values):  # every column, in order
        values.extend(row_values)  # type: ignore[arg-type]
        formats.extend(kinds.translate(FORMATS))
        return
    for i in positions:
        values.append(row_values[i])  # type: ignore[arg-type]
        formats.append(1 if kinds[i] == KIND_BINARY else 0)


def chunks(count: int, per_row: int) -> Iterator[tuple[int, int]]:
    """(position, size) of the multi-row statements for ``count`` rows: the largest ladder step
    that fits, under PostgreSQL's limit on parameters per statement."""
    largest = max(1, min(_LADDER[0], _MAX_PARAMS // max(per_row, 1)))
    position = 0
    while position < count:
        size = next(step for step in (largest, *_LADDER) if step <= largest and step <= count - position)
        yield position, size
        position += size
