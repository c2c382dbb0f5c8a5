"""The change feed read from Spark: exactly the changes committed in an LSN range, consistent with
``read_table`` in the same snapshot.

Usage::

    with open_snapshot(replica_dsn) as snap:
        changes = read_changes(spark, "public.orders", snap, start_lsn=last_run_lsn)
        latest = read_changes(spark, "public.orders", snap, start_lsn=last_run_lsn, net=True)
        ...  # every action inside the block, as with read_table
    next_start = snap.position.positions[0].commit_lsn   # what this round covered

Owns: checking a range against the history the feed retains (a ``start_lsn`` older than it
fails with a message saying what is retained, never a silently partial answer; an ``end_lsn``
past what the replica had applied in the snapshot fails too), reading the change table over
JDBC in LSN-range partitions with ``read_table``'s type mapping, and the net form (one row per
key: its last change in the range, with a truncate marker when the table was truncated; picked
by PostgreSQL in parts by a hash of the key, so Spark shuffles nothing). Must never write to the
replica.

Columns: ``change_op`` ('I' insert, 'U' update: the whole new row; 'D' delete: at least the key,
the whole old row where the target returned it, and the old key of an update that moved a row
to another key; 'T' truncate: meta only), ``change_commit_lsn`` (text, as PostgreSQL prints it),
``change_position`` (the commit LSN as decimal(20,0), for ordering), ``change_commit_time``,
``change_xid``, ``change_seq`` (the change's order in its transaction), then the table's
columns, then ``change_end_lsn`` (text: the end of the source transaction's commit record, where
a consumer resumes after it; NULL for a change recorded by a worker before bookkeeping revision
0007). Order by ``change_position, change_seq`` to replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..progress.feed import META_COLUMNS, SCHEMA
from ..progress.feed_registry import FeedRegistry, RetainedHistory
from ..protocol.lsn import LSN
from ..quoting import qualified
from .columns import TableInfo, describe_table, probe_columns, select_expression
from .reader import DEFAULT_FETCHSIZE, jdbc_options, with_position

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from .snapshot import Snapshot

__all__ = ["PLAN_SETTINGS", "ChangeRange", "HistoryNotRetained", "change_queries", "change_range",
           "feed_history", "lsn_bounds", "read_changes", "truncated"]

#: Run in the transaction of every read of change rows. Each read joins the change rows to their
#: transactions' end LSNs; the newest changes lie past the change table's statistics (or it has
#: none yet), so PostgreSQL estimates a few rows and may pick a nested loop that goes through
#: every end LSN of the range for each change row: 15 s instead of 1.1 s for 300,000 changes of
#: 300 transactions. A hash or merge join costs the same whatever the estimate.
PLAN_SETTINGS = "SET LOCAL enable_nestloop = off"


class HistoryNotRetained(LookupError):
    """The range asked for is not (or no longer) all in the change feed."""


@dataclass(frozen=True)
class ChangeRange:
    """What one read covers: the changes committed after ``start`` up to ``end``, from
    ``change_table`` (a table of schema applier_changes), as the snapshot's ``slot`` applied them."""

    table: TableInfo
    slot: str
    change_table: str
    start: LSN
    end: LSN

    @property
    def qualified(self) -> str:
        return qualified(SCHEMA, self.change_table)


def _lsn(value: str | int | LSN) -> LSN:
    return value if isinstance(value, LSN) else LSN(value) if isinstance(value, int) else LSN.parse(value)


def feed_history(snapshot: Snapshot, table: str) -> tuple[TableInfo, RetainedHistory]:
    """``table`` and the history the feed retains of it, as ``snapshot`` sees them; raises
    ``HistoryNotRetained`` when the feed does not record it, or not for one slot only."""
    info = describe_table(snapshot, table)
    slots = [p.slot_name for p in snapshot.position.positions]
    found: list[RetainedHistory] = FeedRegistry(snapshot.connection).history(info.schema, info.name, slots)
    if not found:
        raise HistoryNotRetained(f"the change feed does not record {info.display} on this replica "
                                 "(start the worker with --change-feed naming it, or all)")
    if len(found) > 1:
        raise HistoryNotRetained(f"{info.display} is recorded for several slots "
                                 f"({', '.join(h.slot for h in found)}): open the snapshot with slot=")
    if not snapshot.history_locked:
        raise HistoryNotRetained("this snapshot was opened before the change feed existed, so its "
                                 "history is not held for it: open a new snapshot")
    return info, found[0]


def change_range(snapshot: Snapshot, table: str, start_lsn: str | int | LSN,
                 end_lsn: str | int | LSN | None = None) -> ChangeRange:
    """Check ``(start_lsn, end_lsn]`` against what the feed retains in ``snapshot``."""
    info, history = feed_history(snapshot, table)
    applied = next(LSN.parse(p.commit_lsn) for p in snapshot.position.positions
                   if p.slot_name == history.slot)
    start = _lsn(start_lsn)
    end = applied if end_lsn is None else _lsn(end_lsn)
    if history.stopped_lsn is not None and end > history.stopped_lsn:
        if end_lsn is None:
            end = history.stopped_lsn
        else:
            raise HistoryNotRetained(f"the change feed of {info.display} stopped at "
                                     f"{history.stopped_lsn}: changes after it were not recorded")
    if start < history.retained_after:
        raise HistoryNotRetained(
            f"changes of {info.display} committed after {start} are not all retained: the change "
            f"feed holds those committed after {history.retained_after} (up to {end}); read the "
            f"table again in full (read_table) and go on from its position")
    if end > applied:
        raise HistoryNotRetained(f"end_lsn {end} is past what the replica had applied in this "
                                 f"snapshot ({applied})")
    return ChangeRange(info, history.slot, history.change_table, start, max(start, end))


def read_changes(spark: SparkSession, table: str, snapshot: Snapshot, *,
                 start_lsn: str | int | LSN, end_lsn: str | int | LSN | None = None,
                 net: bool = False, num_partitions: int | None = None,
                 fetchsize: int = DEFAULT_FETCHSIZE, probe: bool = False,
                 text_columns: Any = ()) -> DataFrame:
    """The changes of ``table`` committed after ``start_lsn`` and up to ``end_lsn`` (default: the
    position the replica had applied in ``snapshot``), as ``snapshot`` sees them. ``net``: one row
    per key, its last change (a final row, or a delete marker), and the last truncate's marker
    if the range holds one (the rows before it are gone). Raises ``HistoryNotRetained`` when the
    feed does not hold the whole range."""
    if fetchsize <= 0:
        raise ValueError("fetchsize must be positive: 0 makes pgjdbc buffer whole partitions in memory")
    span = change_range(snapshot, table, start_lsn, end_lsn)
    queries = change_queries(snapshot, span, net=net, count=num_partitions or spark.sparkContext.defaultParallelism,
                             probe=probe, text_columns=text_columns)
    url, properties = jdbc_options(snapshot.dsn)
    properties |= {"fetchsize": str(fetchsize), "preferTimestampNTZ": "true",
                   "sessionInitStatement": f"{snapshot.session_init_statement}; {PLAN_SETTINGS}"}
    frames = [spark.read.jdbc(url, query, properties=properties) for query in queries]
    frame = frames[0]
    for more in frames[1:]:
        frame = frame.union(more)
    return with_position(frame, snapshot.position, False, [])


def change_queries(snapshot: Snapshot, span: ChangeRange, *, net: bool = False, count: int = 1,
                   probe: bool = False, text_columns: Any = ()) -> list[str]:
    """The reads of ``span`` (checked by :func:`change_range` in ``snapshot``), each a subquery
    named ``applier_changes`` whose columns are those :func:`read_changes` documents: ``count``
    ranges of commit LSNs, or with ``net`` ``count`` parts by a hash of the key."""
    if net and not span.table.key:
        raise ValueError(f"net=True needs a key: {span.table.display} has no primary key or "
                         "replica identity index")
    recorded = describe_table(snapshot, f"{span.qualified}")
    columns = [c for c in recorded.columns if c.name not in META_COLUMNS]
    as_text = {c.name for c in columns} if text_columns == "*" else set(text_columns)
    probed = probe_columns(snapshot, recorded, [c for c in columns if c.name not in as_text]) \
        if probe else None
    expressions = ["change_op::text AS change_op", "change_commit_lsn::text AS change_commit_lsn",
                   "(change_commit_lsn - '0/0'::pg_lsn)::numeric(20, 0) AS change_position",
                   "change_commit_time", "change_xid", "change_seq"]
    expressions += [f"{select_expression(c, c.name in as_text, probed)} AS {c.quoted}" for c in columns]
    where = _within(snapshot, span)
    last_truncate = _last_truncate(snapshot, span, where) if net else None
    if last_truncate is not None:
        lsn, seq = last_truncate
        after = (f"(change_commit_lsn > {snapshot.literal(lsn)}::pg_lsn OR (change_commit_lsn = "
                 f"{snapshot.literal(lsn)}::pg_lsn AND change_seq >= {int(seq)}))")
        where = f"{where} AND {after}"
    select = ", ".join(expressions)
    ends = _EndLsn(snapshot, span)
    if net:
        return [ends.join(query, span.start, span.end)
                for query in _net_queries(span, recorded, select, where, count, last_truncate is not None)]
    # One read per range of commit LSNs, each with its range inside its own query: PostgreSQL
    # then reads only the partitions (and BRIN ranges) it covers, which a predicate Spark adds
    # around a subquery's computed column would not let it do.
    return [ends.join(f"SELECT {select} FROM {span.qualified} c WHERE {where} AND "
                      f"{_between(snapshot, 'change_commit_lsn', lo, hi)}", lo, hi)
            for lo, hi in lsn_bounds(span.start, span.end, count)]


class _EndLsn:
    """Each change's ``change_end_lsn``: its source transaction's end LSN, as text, from
    ``applier.change_commits`` (its arrays unnested, one entry per transaction, joined by commit
    LSN outside the query of the change rows, whose columns may have any name); NULL where the
    worker that recorded the change kept no end LSNs (before bookkeeping revision 0007)."""

    def __init__(self, snapshot: Snapshot, span: ChangeRange) -> None:
        self.snapshot = snapshot
        self.slot = snapshot.literal(span.slot)
        self.kept = snapshot.query(
            "SELECT pg_catalog.to_regclass('applier.change_commits') IS NOT NULL")[0][0]

    def join(self, query: str, lo: LSN, hi: LSN) -> str:
        """``query`` (change rows committed in ``(lo, hi]``, with ``change_commit_lsn`` as text)
        with ``change_end_lsn`` added, as a subquery for Spark."""
        if not self.kept:
            return f"(SELECT q.*, NULL::text AS change_end_lsn FROM ({query}) q) applier_changes"
        ends = (f"SELECT e.commit_lsn, e.end_lsn FROM applier.change_commits k, "
                "unnest(k.commit_lsns, k.end_lsns) e(commit_lsn, end_lsn) "
                f"WHERE k.slot_name = {self.slot} AND k.last_lsn > {self.snapshot.literal(str(lo))}::pg_lsn "
                f"AND k.first_lsn <= {self.snapshot.literal(str(hi))}::pg_lsn "
                f"AND {_between(self.snapshot, 'e.commit_lsn', lo, hi)}")
        return (f"(SELECT q.*, e.end_lsn::text AS change_end_lsn FROM ({query}) q LEFT JOIN "
                f"({ends}) e ON e.commit_lsn = q.change_commit_lsn::pg_lsn) applier_changes")


def _between(snapshot: Snapshot, column: str, lo: LSN, hi: LSN) -> str:
    return (f"{column} > {snapshot.literal(str(lo))}::pg_lsn AND "
            f"{column} <= {snapshot.literal(str(hi))}::pg_lsn")


def lsn_bounds(start: LSN, end: LSN, count: int) -> list[tuple[LSN, LSN]]:
    """``(start, end]`` split into ``count`` ranges of commit LSNs (of equal WAL length: changes
    are spread over it as the source wrote them)."""
    count = max(1, min(count, int(end) - int(start)))
    cuts = [LSN(int(start) + (int(end) - int(start)) * i // count) for i in range(count + 1)]
    return list(zip(cuts, cuts[1:]))


def _within(snapshot: Snapshot, span: ChangeRange) -> str:
    return _between(snapshot, "change_commit_lsn", span.start, span.end)


def truncated(snapshot: Snapshot, span: ChangeRange) -> bool:
    """Whether the table was truncated in ``span`` (one query, in ``snapshot``)."""
    return _last_truncate(snapshot, span, _within(snapshot, span)) is not None


def _last_truncate(snapshot: Snapshot, span: ChangeRange, where: str) -> tuple[str, int] | None:
    # Ordered by the pg_lsn column (c.), not by the text of it that the query returns under the
    # same name: as text, 0/F011B70 sorts after 0/17420F88.
    found = snapshot.query(f"SELECT change_commit_lsn::text, change_seq FROM {span.qualified} c "
                           f"WHERE {where} AND change_op = 'T' "
                           "ORDER BY c.change_commit_lsn DESC, c.change_seq DESC LIMIT 1")
    return (found[0][0], int(found[0][1])) if found else None


def _net_queries(span: ChangeRange, recorded: TableInfo, select: str, where: str, count: int,
                 marker: bool) -> list[str]:
    """The reads of the net form: the last change of each key in ``count`` parts by a hash of
    the key, so that all of a key's changes are in one part and PostgreSQL picks its last
    (``DISTINCT ON``; Spark shuffles nothing), and (``marker``) the truncate marker the range
    starts at."""
    keys = ", ".join(f"c.{recorded.column(name).quoted}" for name in span.table.key)
    part = f"(pg_catalog.hashtextextended(ROW({keys})::text, 0) & 9223372036854775807) % {count}"
    # Ordered by the pg_lsn column (c.), not by the text of it the query returns under that name.
    queries = [f"SELECT DISTINCT ON ({keys}) {select} FROM {span.qualified} c WHERE {where} "
               f"AND c.change_op <> 'T' AND {part} = {n} "
               f"ORDER BY {keys}, c.change_commit_lsn DESC, c.change_seq DESC"
               for n in range(count)]
    if marker:
        queries.append(f"SELECT {select} FROM {span.qualified} c WHERE {where} AND c.change_op = 'T'")
    return queries
