"""``applier pipeline``: an example PySpark job that derives a dataset from the replica.

Owns: reading one replicated table consistently (one exported snapshot, see :mod:`.reader`),
aggregating it per group (rows and the sum of a measure, per value of ``--group-by``), and
writing the result to Parquet under ``--output`` tagged with the source position it reflects:
every row carries ``source_commit_lsn``, and ``_applier_state.json`` records commit LSN, end LSN,
commit time, the snapshot and how the run computed the result. Must never write to the replica,
and never leave a half-written result where the last good one was (it writes a new directory,
then switches the state file to it).

Incremental or full, and why. When the worker records the table in the change feed
(``--change-feed``), a run after the first reads only the changes committed since the previous
run's commit LSN (``read_changes``, ``net=True``: one row per key, its final state or a delete, in
the same snapshot as the table). The groups to recompute are the new groups of the changed keys
and the groups those keys were in before, which the previous run kept beside its result (the
*key index*: each key's group, in Parquet); so deletes and rows moving between groups are exact.
Only those groups are read from the table and aggregated again, every other group is kept from
the previous result, and the key index is updated from the same changes. A run recomputes in
full when there is no previous result or key index, with ``--full``, when the table is not
recorded or has no key, when the feed no longer retains the range (``HistoryNotRetained``), when
the range holds a truncate, and when the changes touch more than half the groups (reading those
again and merging costs more than reading everything: ``bench/pipeline.py``). No column or
trigger on the source is needed.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cli
from ..config import Settings
from ..exit_codes import ExitCode
from ..quoting import ident
from .changes import HistoryNotRetained, read_changes
from .columns import describe_table
from .reader import read_table, spark_column
from .session import SparkUnavailable, spark_session
from .snapshot import open_snapshot

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from .snapshot import Snapshot

__all__ = ["main", "run_pipeline", "run_pipeline_job"]

STATE_FILE = "_applier_state.json"


def _state(output: Path) -> dict[str, Any] | None:
    path = output / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _aggregate(frame: DataFrame, group_by: str, measure: str) -> DataFrame:
    from pyspark.sql import functions as F

    return frame.groupBy(group_by).agg(F.count(F.lit(1)).alias("rows"),
                                       F.sum(F.col(measure)).alias(f"sum_{measure}"))


def _in_groups(snap: Snapshot, group_by: str, groups: list[Any]) -> str:
    """SQL: the group column is one of ``groups`` (None: NULL)."""
    present = [g for g in groups if g is not None]
    terms = [f"{ident(group_by)} = ANY({snap.literal(present)})"] if present else []
    if len(present) < len(groups):
        terms.append(f"{ident(group_by)} IS NULL")
    return " OR ".join(terms) or "false"


def _incremental(spark: SparkSession, snap: Snapshot, settings: Settings, table: str,
                 key: tuple[str, ...], previous: dict[str, Any],
                 output: Path) -> tuple[DataFrame, DataFrame] | str:
    """The new result and key index from the changes since the previous run, or why not."""
    from pyspark.sql import functions as F

    group_by, measure = settings.group_by, settings.measure
    try:
        changes = read_changes(spark, table, snap, start_lsn=str(previous["commit_lsn"]), net=True)
    except HistoryNotRetained as exc:
        return f"full ({exc})"
    wanted = [spark_column(c) for c in dict.fromkeys([*key, group_by])]
    changes = changes.select("change_op", *wanted).persist()
    if changes.where(F.col("change_op") == "T").limit(1).count():
        changes.unpersist()
        return "full (the table was truncated)"
    keys = [spark_column(k) for k in key]
    old_index = spark.read.parquet(str(output / previous["keys"]))
    changed = changes.select(*keys)
    before = old_index.join(changed, list(key), "inner").select(spark_column(group_by))
    after = changes.where(F.col("change_op") != "D").select(spark_column(group_by))
    groups = [row[0] for row in before.union(after).distinct().collect()]
    old = spark.read.parquet(str(output / previous["data"])).drop("source_commit_lsn")
    known = old.count()
    if len(groups) * 2 > known:
        # Reading more than half the groups again, and merging, costs more than reading them all.
        changes.unpersist()
        return f"full ({len(groups)} of {known} groups changed)"
    if groups:
        recomputed = _aggregate(read_table(spark, table, snap, columns=[group_by, measure],
                                           where=_in_groups(snap, group_by, groups)), group_by, measure)
        column = F.col(spark_column(group_by))
        untouched = ~column.isin([g for g in groups if g is not None])
        if None in groups:
            untouched = untouched & column.isNotNull()
        else:
            untouched = untouched | column.isNull()
        result = old.where(untouched).unionByName(recomputed)
    else:
        result = old
    index = old_index.join(changed, list(key), "left_anti").unionByName(
        changes.where(F.col("change_op") != "D").select(*keys, spark_column(group_by)))
    return result, index


def run_pipeline_job(spark: SparkSession, settings: Settings) -> dict[str, Any]:
    """One run: read at one snapshot, aggregate (incrementally when the change feed allows it),
    publish the result and its key index, then the state naming both and the position."""
    from pyspark.sql import functions as F

    assert settings.target is not None and settings.output is not None  # required by the command
    output = settings.output
    (table,) = settings.table  # the settings allow pipeline exactly one
    group_by, measure = settings.group_by, settings.measure
    output.mkdir(parents=True, exist_ok=True)
    previous = _state(output)
    started = time.monotonic()
    with open_snapshot(settings.target, slot=settings.slot) as snap:
        if len(snap.position.positions) != 1:
            raise LookupError(f"the replica has {len(snap.position.positions)} applier.progress rows; "
                              "pass --slot to say which position tags the result")
        position = snap.position.positions[0]
        key = describe_table(snap, table).key
        found: tuple[DataFrame, DataFrame] | str
        if settings.full:
            found = "full (--full)"
        elif previous is None or not previous.get("keys"):
            found = "full (no previous result with a key index)"
        elif not key:
            found = "full (the table has no key)"
        else:
            found = _incremental(spark, snap, settings, table, key, previous, output)
        if isinstance(found, str):
            mode = found
            rows = read_table(spark, table, snap,
                              columns=[*dict.fromkeys([*key, group_by, measure])]).persist()
            result = _aggregate(rows, group_by, measure)
            index = rows.select(*[spark_column(k) for k in key], spark_column(group_by)) if key else None
        else:
            mode = "incremental"
            result, index = found
        stamp = f"{position.commit_lsn.replace('/', '-')}-{int(time.time() * 1000)}"
        data, keys = f"data-{stamp}", (f"keys-{stamp}" if index is not None else None)
        result.withColumn("source_commit_lsn", F.lit(position.commit_lsn)) \
            .write.mode("overwrite").parquet(str(output / data))
        if index is not None:
            index.write.mode("overwrite").parquet(str(output / str(keys)))
        groups = spark.read.parquet(str(output / data)).count()
    state = {"table": table, "group_by": group_by, "measure": measure,
             "commit_lsn": position.commit_lsn, "end_lsn": position.end_lsn,
             "commit_time": position.commit_time, "slot_name": position.slot_name,
             "snapshot": snap.snapshot_id, "mode": mode, "groups": groups, "data": data,
             "keys": keys, "seconds": round(time.monotonic() - started, 3)}
    temporary = output / (STATE_FILE + ".tmp")
    temporary.write_text(json.dumps(state, indent=2) + "\n")
    temporary.replace(output / STATE_FILE)  # the switch to the new result is one rename
    if previous is not None:
        for name in ("data", "keys"):
            if previous.get(name) and previous[name] not in (data, keys):
                shutil.rmtree(output / previous[name], ignore_errors=True)
    return state


def run_pipeline(settings: Settings) -> int:
    """``applier pipeline``: OK with the state of the new result printed, else FAILED."""
    settings.require("target", "output")
    try:
        spark = spark_session(settings.master, app_name="applier pipeline", jar=settings.jdbc_jar)
        state = run_pipeline_job(spark, settings)
    except (SparkUnavailable, LookupError) as exc:
        print(f"applier pipeline: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    print(json.dumps(state, indent=2))
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    """``python -m applier.spark.pipeline`` (the same as ``applier pipeline``)."""
    return cli.main(["pipeline", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
