"""The change feed as a Structured Streaming source: a streaming DataFrame of a table's changes,
read by micro-batches of commit LSNs, exactly once with a checkpointed query.

Usage::

    with open_snapshot(replica_dsn) as snap:          # optional: a table read, then its changes
        read_table(spark, "public.orders", snap).write.parquet(base)
        since = snap.position.positions[0].commit_lsn
    changes = read_change_stream(spark, replica_dsn, "public.orders", starting_lsn=since)
    (changes.writeStream.format("parquet").option("path", out)
        .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())

Offsets are commit LSNs: a micro-batch holds every change committed after its start and up to
its end, the position the replica had applied when Spark planned it (the slot's
``applier.progress`` row; changes up to it are committed and never change afterwards, so a batch
read again after a crash gives the same rows). With a checkpoint and a sink Spark writes exactly
once (files, ``foreachBatch`` keyed by batch id), each change reaches the output once. A start
older than the feed's retained history fails (``HistoryNotRetained``), when the query starts and
whenever a stopped query resumes after retention dropped what it had not read: never a silently
partial stream.

Owns: the Python data source ``applier_changes`` (Spark 4.2 or later, with pyarrow) and
:func:`read_change_stream`, which checks the table and the start on the driver and fixes the
stream's columns: those of :func:`read_changes` (same names and Spark types, taken from a JDBC
read of the change table), as the table is when the query starts: a column added later reaches
the stream when the query starts again, and a value that no longer fits its column's type (a
type widened since) stops the query with ``ColumnDoesNotFit``, saying to start it again.
Spark runs a Python source's reads in its Python workers, where the JDBC reader does not exist:
each range is read there with psycopg, in a snapshot that holds the feed's history lock, through
the same query :func:`read_changes` sends over JDBC, into Arrow batches. While no change comes,
the applied position is polled on one connection. Must never write to the replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StringType, StructType

from ..connections import connect
from ..protocol.lsn import LSN
from ..quoting import ident
from ..units import parse_size
from .changes import PLAN_SETTINGS, ChangeRange, change_queries, change_range, feed_history, lsn_bounds
from .reader import DEFAULT_FETCHSIZE, jdbc_options
from .snapshot import Snapshot, open_snapshot

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["SOURCE_NAME", "ChangeFeedSource", "ColumnDoesNotFit", "read_change_stream"]

SOURCE_NAME = "applier_changes"


class ColumnDoesNotFit(ValueError):
    """A value read does not fit the type the stream fixed for its column when it started."""


@dataclass(frozen=True)
class _Range(InputPartition):
    """Changes committed in ``(start, end]`` (LSNs as text)."""

    start: str
    end: str


class _Options:
    """The source's options, as Spark hands them over (strings)."""

    def __init__(self, options: dict[str, str]) -> None:
        missing = [name for name in ("dsn", "table", "slot", "starting_lsn") if not options.get(name)]
        if missing:
            raise ValueError(f"the {SOURCE_NAME} source needs {', '.join(missing)}: create it with "
                             "applier.spark.stream.read_change_stream()")
        self.dsn = options["dsn"]
        self.table = options["table"]
        self.slot = options["slot"]
        self.starting_lsn = options["starting_lsn"]
        self.partitions = int(options.get("partitions") or 1)
        self.fetchsize = int(options.get("fetchsize") or DEFAULT_FETCHSIZE)
        self.text_columns = self.columns_as_text(options.get("text_columns") or "")
        self.max_wal_per_batch = int(options.get("max_wal_per_batch") or 0)

    @staticmethod
    def columns_as_text(option: str) -> Any:
        """``"*"``, or the column names joined by NUL (no identifier holds one)."""
        return "*" if option == "*" else [c for c in option.split("\0") if c]


def _applied_span(snap: Snapshot, table: str, start: str | None) -> ChangeRange:
    """The changes of ``table`` after ``start`` (default: all retained) up to how far its feed
    goes in ``snap``: the slot's applied position, or where the feed stopped."""
    return change_range(snap, table, start or feed_history(snap, table)[1].retained_after)


class _Poller:
    """Questions the driver asks the replica between batches, on one connection kept for the
    query's life: while no change comes, Spark asks for the latest offset many times a second,
    and a snapshot opened each time cost the replica 45 new sessions a second. Only about rows
    already committed (up to the applied position), which no snapshot is needed for."""

    def __init__(self, dsn: str, slot: str) -> None:
        self.dsn, self.slot = dsn, slot
        self.conn: psycopg.Connection[Any] | None = None

    def _row(self, query: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self.conn is None or self.conn.closed:
            self.conn = connect(self.dsn, autocommit=True, application_name="applier change stream")
        try:
            return self.conn.execute(query, params).fetchone()
        except psycopg.Error:
            self.close()  # a new connection next time
            raise

    def applied(self) -> str | None:
        """The slot's applied commit LSN, as text."""
        row = self._row("SELECT commit_lsn::text FROM applier.progress WHERE slot_name = %s", (self.slot,))
        return None if row is None else str(row[0])

    def first_change(self, change_table: str, lo: LSN, hi: LSN) -> LSN | None:
        """The commit LSN of the first change in ``change_table`` committed in ``(lo, hi]``."""
        row = self._row(f"SELECT min(change_commit_lsn)::text FROM {change_table} WHERE "
                        "change_commit_lsn > %s::pg_lsn AND change_commit_lsn <= %s::pg_lsn",
                        (str(lo), str(hi)))
        return None if row is None or row[0] is None else LSN.parse(row[0])

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class _ChangeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: _Options, schema: StructType) -> None:
        self.options = options
        self.target: LSN | None = None  # Trigger.AvailableNow: what was applied when it began
        self.poller = _Poller(options.dsn, options.slot)
        # The applied position at the last full check (a snapshot), and the end it gave.
        self.checked: tuple[str | None, LSN] | None = None
        self.change_table = ""  # set by that check
        # Each column as the read delivers it: a string column as PostgreSQL's text of it (uuid,
        # json and jsonb too, which psycopg would otherwise return as objects).
        self.projection = ", ".join(
            f"applier_changes.{ident(f.name)}{'::text' if isinstance(f.dataType, StringType) else ''}"
            for f in schema.fields)
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")  # as Spark checks batches

    def initialOffset(self) -> dict[str, str]:
        return {"lsn": self.options.starting_lsn}

    def _applied(self, start: str | None) -> LSN:
        # Every change committed up to the applied position is on the replica for good; the
        # check fails when retention dropped changes after ``start`` while the query was stopped.
        with open_snapshot(self.options.dsn, slot=self.options.slot) as snap:
            span = _applied_span(snap, self.options.table, start)
        self.change_table = span.qualified
        return span.end

    def prepareForTriggerAvailableNow(self) -> None:
        # Not checked against the starting LSN: a query resumed from its checkpoint may be far past it.
        self.target = self._applied(None)

    def latestOffset(self, start: dict[str, str], limit: Any) -> dict[str, str]:
        applied = self.poller.applied()
        if self.checked is None or self.checked[0] != applied:
            # Something was applied since the last check (or this is the first): check the
            # history and find the end in a snapshot, once for each new position.
            self.checked = (applied, self._applied(start["lsn"]))
        lo = LSN.parse(start["lsn"])
        end = max(lo, self.checked[1])
        if self.target is not None:
            end = max(lo, min(end, self.target))
        if isinstance(limit, ReadMaxBytes) and int(end) - int(lo) > limit.max_bytes:
            end = self._cut(lo, end, limit.max_bytes)
        return {"lsn": str(end)}

    def getDefaultReadLimit(self) -> ReadLimit:
        wal = self.options.max_wal_per_batch
        return ReadMaxBytes(wal) if wal else ReadAllAvailable()

    def _cut(self, lo: LSN, hi: LSN, wal: int) -> LSN:
        """The end of a batch from ``lo`` (at most ``hi``) that spans at most ``wal`` bytes of
        source WAL from its first change: past a stretch of WAL where the table has none, the
        batch starts at its next change rather than come out empty."""
        cut = LSN(int(lo) + wal)
        if self.poller.first_change(self.change_table, lo, cut) is not None:
            return cut
        first = self.poller.first_change(self.change_table, cut, hi)
        return hi if first is None else LSN(min(int(hi), int(first) + wal))

    def partitions(self, start: dict[str, str], end: dict[str, str]) -> list[_Range]:
        lo, hi = LSN.parse(start["lsn"]), LSN.parse(end["lsn"])
        if hi <= lo:
            return []
        return [_Range(str(a), str(b)) for a, b in lsn_bounds(lo, hi, self.options.partitions)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, _Range)
        with open_snapshot(self.options.dsn, slot=self.options.slot) as snap:
            span = change_range(snap, self.options.table, partition.start, partition.end)
            query = change_queries(snap, span, text_columns=self.options.text_columns)[0]
            snap.connection.execute(PLAN_SETTINGS)
            with snap.connection.cursor(name="applier_change_stream") as cursor:
                cursor.execute(f"SELECT {self.projection} FROM {query}")
                # Arrow batches built a column at a time in C: handing Spark tuples would
                # convert each value in Python.
                while rows := cursor.fetchmany(self.options.fetchsize):
                    yield self._batch(rows)

    def _batch(self, rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
        arrays = []
        for values, field in zip(zip(*rows), self.arrow_schema):
            try:
                arrays.append(pa.array(values, type=field.type))
            except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
                raise ColumnDoesNotFit(
                    f"a value of column {field.name} of {self.options.table} does not fit the "
                    f"stream's type for it, {field.type} ({exc}). If the column's type changed on "
                    "the replica after the query started, start the query again "
                    "(read_change_stream) to read the columns as they are now; a value Spark "
                    "cannot represent (NaN, infinity) reads as text (text_columns)") from exc
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)

    def commit(self, end: dict[str, str]) -> None:
        """Nothing to release: the replica keeps the history for its retention, not for us."""

    def stop(self) -> None:
        self.poller.close()


class ChangeFeedSource(DataSource):
    """``spark.readStream.format("applier_changes")``: see :func:`read_change_stream`."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        raise ValueError(f"the {SOURCE_NAME} source takes its columns from the change table: "
                         "create it with applier.spark.stream.read_change_stream()")

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _ChangeStreamReader(_Options(dict(self.options)), schema)


def read_change_stream(spark: SparkSession, dsn: str, table: str, *,
                       starting_lsn: str | int | LSN = "latest", slot: str | None = None,
                       num_partitions: int | None = None, fetchsize: int = DEFAULT_FETCHSIZE,
                       text_columns: Any = (), max_wal_per_batch: str | int | None = None) -> DataFrame:
    """A streaming DataFrame of the changes of ``table`` committed after ``starting_lsn``:
    ``"latest"`` (what the replica has applied now), ``"earliest"`` (the oldest change the feed
    retains) or an LSN (e.g. the position of a ``read_table`` snapshot). Columns as
    :func:`read_changes` gives them (``text_columns`` likewise). Raises ``HistoryNotRetained`` now
    if the feed does not hold every change after the start; a query restarted from its
    checkpoint resumes from there instead. ``max_wal_per_batch`` (e.g. ``"256MB"``) bounds a
    micro-batch by the source WAL its changes span (whole transactions; a backlog is then read in
    many batches); by default a batch reads all that was applied since the last."""
    if fetchsize <= 0:
        raise ValueError("fetchsize must be positive")
    wal = 0 if max_wal_per_batch is None else parse_size(max_wal_per_batch)
    if max_wal_per_batch is not None and wal <= 0:
        raise ValueError("max_wal_per_batch must be positive")
    text = "*" if text_columns == "*" else "\0".join(text_columns)
    with open_snapshot(dsn, slot=slot) as snap:
        history = feed_history(snap, table)[1]
        start: str | int | LSN = starting_lsn
        if starting_lsn == "earliest":
            start = history.retained_after
        elif starting_lsn == "latest":
            start = _applied_span(snap, table, None).end
        span = change_range(snap, table, start)
        # The columns and their Spark types as Spark's JDBC reader maps them for read_changes
        # (resolving a JDBC read's schema reads no row).
        url, properties = jdbc_options(dsn)
        properties |= {"sessionInitStatement": snap.session_init_statement, "preferTimestampNTZ": "true"}
        empty = change_queries(snap, replace(span, start=span.end),
                               text_columns=_Options.columns_as_text(text))[0]
        schema = spark.read.jdbc(url, empty, properties=properties).schema
    spark.dataSource.register(ChangeFeedSource)
    options = {"dsn": dsn, "table": table, "slot": history.slot, "starting_lsn": str(span.start),
               "partitions": str(num_partitions or spark.sparkContext.defaultParallelism),
               "fetchsize": str(fetchsize), "text_columns": text, "max_wal_per_batch": str(wal)}
    return spark.readStream.format(SOURCE_NAME).schema(schema).options(**options).load()
