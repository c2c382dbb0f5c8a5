"""``applier pipeline``: an example PySpark job that derives a dataset from the replica.

Owns: reading one replicated table consistently (one exported snapshot, see :mod:`.reader`),
aggregating it per group (per value of ``--group-by``: ``rows``, ``count_<measure>`` the
non-null values of ``--measure``, ``sum_<measure>`` their sum, NULL when there is none, as SQL's
``sum``), and writing the result to Parquet under ``--output`` tagged with the source position it
reflects: every row carries ``source_commit_lsn``, and ``_applier_state.json`` records commit
LSN, end LSN, commit time, the snapshot, how the round computed the result, the result's
directory and the key index's (:mod:`.keyindex`). Must never write to the replica, and never
leave a half-written result where the last good one was: a round writes new directories, then
renames the state file over the old one (the commit), and only then removes the round
directories the new state does not name (the old state's, and those of a round that died). A
round that dies before the rename leaves the previous state valid, and the next round starts
again from its LSN (exactly once).

Incremental or full, and why. When the worker records the table in the change feed
(``--change-feed``), a round after the first reads only the changes committed since the previous
round's commit LSN (``read_changes``, ``net=True``: one row per key, its final row or a delete,
in the same snapshot) and the key index (each key's group and measure as of the previous round),
never the table: each changed key takes its old contribution (from the index, if it was there)
away from its old group and adds its final row's to its new group; the per-group deltas are
merged into the previous result (full outer join; a group left with no row is dropped; types
are the previous result's, which a full recompute's are). The count of non-null measures is
what tells a sum that became NULL (its group's last value went) from one that is 0. The index
gets one layer of the changed keys' entries (see :mod:`.keyindex`). A round recomputes in full
(reading the table) with ``--full``, when the table has no key, when there is no previous result
with a key index (or it aggregated another table, group or measure), when the feed does not
record the table or no longer retains the range (``HistoryNotRetained``), and when the range
holds a truncate. No column or trigger on the source is needed. A float measure's sum may differ
from a full recompute's in the last bits (additions in another order); numeric and integer sums
are exact.

``--every DURATION`` keeps one Spark session and runs a round every DURATION until SIGINT or
SIGTERM (which end the loop between rounds); ``--rounds N`` bounds the count.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cli
from ..config import Settings
from ..exit_codes import ExitCode
from .changes import HistoryNotRetained, change_range, read_changes, truncated
from .columns import describe_table
from .keyindex import DELETED, KeyIndex, lookup, write_base, write_layer
from .reader import read_table, spark_column
from .session import SparkUnavailable, spark_session
from .snapshot import open_snapshot
from .written import forget, read_written, write_counted

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from .snapshot import Snapshot

__all__ = ["main", "run_pipeline", "run_pipeline_job"]

STATE_FILE = "_applier_state.json"
#: What ends a loop of rounds (between two of them).
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _state(output: Path) -> dict[str, Any] | None:
    path = output / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _names(measure: str) -> tuple[str, str]:
    """The result's columns of the measure: the count of its non-null values, and its sum."""
    return f"count_{measure}", f"sum_{measure}"


def _aggregate(frame: DataFrame, group_by: str, measure: str) -> DataFrame:
    from pyspark.sql import functions as F

    counted, summed = _names(measure)
    return frame.groupBy(spark_column(group_by)).agg(
        F.count(F.lit(1)).alias("rows"), F.count(F.col(spark_column(measure))).alias(counted),
        F.sum(F.col(spark_column(measure))).alias(summed))


def _contributions(entries: DataFrame, group_by: str, measure: str, sign: int) -> DataFrame:
    """What rows add to (``sign`` 1) or take from (-1) their groups' rows, count and sum."""
    from pyspark.sql import functions as F

    value = F.col(spark_column(measure))
    return entries.select(F.col(spark_column(group_by)).alias("_group"),
                          F.lit(sign).cast("long").alias("_rows"),
                          (value.isNotNull().cast("long") * sign).alias("_counted"),
                          (value if sign > 0 else -value).alias("_summed"))


def _merge(previous: DataFrame, delta: DataFrame, group_by: str, measure: str) -> DataFrame:
    """``previous`` (a result) plus ``delta`` (per group: rows, count and sum to add), without
    the groups left with no row, in ``previous``'s column types."""
    from pyspark.sql import functions as F

    counted, summed = _names(measure)
    types = {f.name: f.dataType for f in previous.schema}
    group = spark_column(group_by)
    joined = previous.join(delta, previous[group].eqNullSafe(delta["_group"]), "full_outer")

    def plus(column: str, change: str) -> Column:
        return F.coalesce(F.col(spark_column(column)), F.lit(0)) + F.coalesce(F.col(change), F.lit(0))

    return joined.select(
        F.coalesce(previous[group], F.col("_group")).alias(group_by),
        plus("rows", "_rows").cast(types["rows"]).alias("rows"),
        plus(counted, "_counted").cast(types[counted]).alias(counted),
        # SQL's sum: NULL when no row of the group has a value.
        F.when(plus(counted, "_counted") == 0, F.lit(None))
         .otherwise(plus(summed, "_summed")).cast(types[summed]).alias(summed),
    ).where(F.col("rows") > 0)


def _index_columns(key: tuple[str, ...], group_by: str, measure: str) -> list[str]:
    """The key index's columns: the key, then the group and measure it adds to."""
    return [*dict.fromkeys([*key, group_by, measure])]


def _incremental(spark: SparkSession, snap: Snapshot, settings: Settings, table: str,
                 key: tuple[str, ...], previous: dict[str, Any], index: KeyIndex,
                 output: Path) -> tuple[DataFrame, DataFrame, DataFrame] | str:
    """From the changes since the previous round: the new result, the key index's new layer
    (changed keys' entries and tombstones) and the changes (one row per changed key, persisted:
    the first write fills the cache, and the caller unpersists them once both are written); or
    why the round must recompute in full."""
    from pyspark.sql import functions as F

    group_by, measure = settings.group_by, settings.measure
    start = str(previous["commit_lsn"])
    try:
        # Asked of PostgreSQL before any Spark job: a truncate makes the round a full one.
        if truncated(snap, change_range(snap, table, start)):
            return "full (the table was truncated)"
        changes = read_changes(spark, table, snap, start_lsn=start, net=True)
    except HistoryNotRetained as exc:
        return f"full ({exc})"
    columns = [spark_column(c) for c in _index_columns(key, group_by, measure)]
    changes = changes.select("change_op", *columns).persist()
    # Each changed key takes its old entry's contribution away and adds its final row's (none
    # for a delete): exact for rows that moved between groups, changed measure, or left.
    old = lookup(spark, output, index, changes.select(*[spark_column(k) for k in key]), key)
    new = changes.where(F.col("change_op") != "D")
    delta = _contributions(old, group_by, measure, -1) \
        .unionByName(_contributions(new, group_by, measure, 1)) \
        .groupBy("_group").agg(*[F.sum(c).alias(c) for c in ("_rows", "_counted", "_summed")])
    result = _merge(read_written(spark, output / previous["data"]).drop("source_commit_lsn"),
                    delta, group_by, measure)
    layer = changes.select(*columns, (F.col("change_op") == "D").alias(DELETED))
    return result, layer, changes


def _mode(settings: Settings, key: tuple[str, ...], previous: dict[str, Any] | None,
          index: KeyIndex | None) -> str | None:
    """Why this round recomputes in full, or None to go incrementally."""
    if settings.full:
        return "full (--full)"
    if not key:
        return "full (the table has no key)"
    if previous is None or index is None:
        return "full (no previous result with a key index)"
    if [previous.get(n) for n in ("table", "group_by", "measure")] != \
            [settings.table[0], settings.group_by, settings.measure]:
        return "full (the previous result is of another table, group or measure)"
    return None


#: The directories rounds write (``stamp`` in ``run_pipeline_job``: commit LSN, nanoseconds).
_ROUND_DIRECTORY = re.compile(r"(data|keys|layer)-[0-9A-F]+-[0-9A-F]+-[0-9]+")


def _discard(output: Path, kept: set[str]) -> None:
    """Remove the round directories the new state does not name: the previous round's, and any
    a round that died before its commit left. Only once the new state is in place: until then
    the previous ones are the committed result."""
    for path in output.iterdir():
        if path.is_dir() and _ROUND_DIRECTORY.fullmatch(path.name) and path.name not in kept:
            forget(path)
            shutil.rmtree(path, ignore_errors=True)


def run_pipeline_job(spark: SparkSession, settings: Settings) -> dict[str, Any]:
    """One round: read at one snapshot, aggregate (by deltas when the change feed allows it),
    write the result and the key index's new base or layer, then the state naming them and the
    position (the commit), then remove the round directories it does not name."""
    from pyspark.sql import functions as F

    assert settings.target is not None and settings.output is not None  # required by the command
    output = settings.output
    (table,) = settings.table  # the settings allow pipeline exactly one
    group_by, measure = settings.group_by, settings.measure
    output.mkdir(parents=True, exist_ok=True)
    previous = _state(output)
    index = KeyIndex.from_state(previous.get("key_index")) if previous else None
    started = time.monotonic()
    with open_snapshot(settings.target, slot=settings.slot) as snap:
        if len(snap.position.positions) != 1:
            raise LookupError(f"the replica has {len(snap.position.positions)} applier.progress rows; "
                              "pass --slot to say which position tags the result")
        position = snap.position.positions[0]
        key = describe_table(snap, table).key
        mode = _mode(settings, key, previous, index)
        found = None
        if mode is None:
            assert previous is not None and index is not None  # as _mode found
            incremental = _incremental(spark, snap, settings, table, key, previous, index, output)
            if isinstance(incremental, str):
                mode = incremental
            else:
                found = incremental
        stamp = f"{position.commit_lsn.replace('/', '-')}-{time.time_ns()}"
        data = f"data-{stamp}"
        extra: dict[str, Any] = {}

        def publish(result: DataFrame) -> int:
            # One row per group: one file, written by one task (a file per shuffle partition
            # costs a task and a Parquet writer each, and more files to list next round).
            return write_counted(result.withColumn("source_commit_lsn", F.lit(position.commit_lsn)),
                                 output / data, coalesce=True)

        if found is not None:
            mode = "incremental"
            result, layer, changes = found
            groups = publish(result)
            assert index is not None
            # The layer is written from the cache the result's write filled.
            new_index: KeyIndex | None
            new_index, extra["changed_keys"] = write_layer(spark, output, index, layer, key, stamp)
            changes.unpersist()
        else:
            rows = read_table(spark, table, snap,
                              columns=_index_columns(key, group_by, measure)).persist()
            groups = publish(_aggregate(rows, group_by, measure))
            new_index = write_base(rows, output, stamp) if key else None
            rows.unpersist()
    state = {"table": table, "group_by": group_by, "measure": measure,
             "commit_lsn": position.commit_lsn, "end_lsn": position.end_lsn,
             "commit_time": position.commit_time, "slot_name": position.slot_name,
             "snapshot": snap.snapshot_id, "mode": mode, **extra, "groups": groups, "data": data,
             "key_index": new_index.to_state() if new_index else None,
             "seconds": round(time.monotonic() - started, 3)}
    temporary = output / (STATE_FILE + ".tmp")
    temporary.write_text(json.dumps(state, indent=2) + "\n")
    temporary.replace(output / STATE_FILE)  # the switch to the new result is one rename
    _discard(output, {data, *(new_index.directories if new_index else [])})
    return state


def run_pipeline(settings: Settings) -> int:
    """``applier pipeline``: one round, or (``--every``, ``--rounds``) rounds in one Spark
    session until the count is reached or SIGINT/SIGTERM asks to stop (taken between rounds:
    the round under way still commits). Prints each round's state (one JSON object; a line each
    when there are several rounds). OK, else FAILED (a failed round ends the loop; the state of
    the last committed round stays)."""
    settings.require("target", "output")
    every, limit = settings.every, settings.rounds or (None if settings.every else 1)
    # Between rounds the stop signals are waited for, not handled: a handler runs whenever the
    # interpreter gets to it, and one that set a threading.Event while the wait held the
    # Event's own lock would hang the loop for good. Blocked before Spark starts its threads,
    # so that they inherit the mask and none of them takes the signal instead.
    waited = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS) if limit != 1 else None
    try:
        spark = spark_session(settings.master, app_name="applier pipeline", jar=settings.jdbc_jar)
        done = 0
        while True:
            started = time.monotonic()
            state = run_pipeline_job(spark, settings)
            print(json.dumps(state, indent=None if limit != 1 else 2), flush=True)
            done += 1
            if done == limit or signal.sigtimedwait(
                    _STOP_SIGNALS, max(0.0, (every or 0.0) - (time.monotonic() - started))):
                break
    except (SparkUnavailable, LookupError) as exc:
        print(f"applier pipeline: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    finally:
        if waited is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, waited)
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    """``python -m applier.spark.pipeline`` (the same as ``applier pipeline``)."""
    return cli.main(["pipeline", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
