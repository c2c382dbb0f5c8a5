"""``applier pipeline``: an example PySpark job that derives a dataset from the replica.

Owns: reading one replicated table consistently (one exported snapshot, see :mod:`.reader`),
aggregating it per group (rows and the sum of a measure, per value of ``--group-by``), and
writing the result to Parquet under ``--output`` tagged with the source position it reflects:
every row carries ``source_commit_lsn``, and ``_applier_state.json`` records commit LSN, end LSN,
commit time, the snapshot and how the run computed the result. Must never write to the replica,
and never leave a half-written result where the last good one was (it writes a new directory,
then switches the state file to it).

Incremental or full, and why. The worker applies deletes as deletes, so the replica itself
cannot list what changed since an LSN. A table *carries* the LSN when it has ``--lsn-column``
(default ``_source_lsn``, type pg_lsn): a column the source sets on every insert and update
(``DEFAULT pg_current_wal_lsn()`` plus a BEFORE UPDATE trigger) and that replicates like any
other. Then the next run reads only rows with that column past the previous run's commit LSN,
recomputes exactly the groups those rows belong to (in the same snapshot), and keeps every other
group from the previous result. Deleted rows and rows moved to another group are invisible to
that read; they can only leave an untouched group with too many rows, so the run checks that the
group counts add up to the table's row count in the snapshot and recomputes everything if not.
A table without the column is always recomputed in full: there is nothing that says what
changed, and a full aggregate over a consistent snapshot is always right. Known limit: a source
transaction open across the previous run's position can write rows whose column is below that
position yet commit after it; run ``--full`` periodically if such long transactions exist.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .reader import describe_table, open_snapshot, read_table
from .session import SparkUnavailable, spark_session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from .reader import Snapshot

__all__ = ["add_arguments", "main", "run_pipeline", "run_pipeline_job"]

STATE_FILE = "_applier_state.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=os.environ.get("APPLIER_TARGET"), metavar="DSN",
                        help="The replica (target) database to read [env APPLIER_TARGET].")
    parser.add_argument("--table", default="orders", help="Replicated table to aggregate (default: orders).")
    parser.add_argument("--group-by", default="customer_id", metavar="COLUMN",
                        help="Column to group by (default: customer_id).")
    parser.add_argument("--measure", default="total", metavar="COLUMN",
                        help="Numeric column to sum per group (default: total).")
    parser.add_argument("--output", required=True, type=Path, metavar="DIR",
                        help="Directory of the Parquet result and its state file.")
    parser.add_argument("--lsn-column", default="_source_lsn", metavar="COLUMN",
                        help="pg_lsn column the source stamps on every write; when the table has it, "
                             "runs after the first process only what changed (default: _source_lsn).")
    parser.add_argument("--full", action="store_true", help="Recompute everything even if incremental is possible.")
    parser.add_argument("--slot", default=None, metavar="NAME",
                        help="Slot whose applied position tags the result (default: the only one).")
    parser.add_argument("--master", default=None, metavar="URL", help="Spark master URL (default: local[*]).")
    parser.add_argument("--jdbc-jar", default=None, metavar="PATH", help="PostgreSQL JDBC driver jar.")


def _state(output: Path) -> dict[str, Any] | None:
    path = output / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _aggregate(frame: DataFrame, group_by: str, measure: str) -> DataFrame:
    from pyspark.sql import functions as F

    return frame.groupBy(group_by).agg(F.count(F.lit(1)).alias("rows"),
                                       F.sum(F.col(measure)).alias(f"sum_{measure}"))


def _incremental(spark: SparkSession, snap: Snapshot, args: argparse.Namespace,
                 previous: dict[str, Any], output: Path) -> DataFrame | None:
    """The new result from the changed groups and the previous result, or None if unsound."""
    from pyspark.sql import functions as F

    lsn = str(previous["commit_lsn"])
    column = args.lsn_column.replace('"', '""')
    changed = read_table(spark, args.table, snap, columns=[args.group_by],
                         where=f'"{column}" > {snap.literal(lsn)}::pg_lsn')
    groups = [row[0] for row in changed.distinct().collect()]
    old = spark.read.parquet(str(output / previous["data"])).drop("source_commit_lsn")
    group_col = args.group_by.replace('"', '""')
    if groups:
        in_groups = f'"{group_col}" = ANY({snap.literal(groups)})'
        recomputed = _aggregate(read_table(spark, args.table, snap, columns=[args.group_by, args.measure],
                                           where=in_groups), args.group_by, args.measure)
        kept = old.where(~F.col(args.group_by).isin(groups) | F.col(args.group_by).isNull())
        result = kept.unionByName(recomputed)
    else:
        result = old
    result = result.persist()
    rows = snap.query(f"SELECT count(*) FROM {describe_table(snap, args.table).qualified}")[0][0]
    total = result.agg(F.sum("rows")).first()[0] or 0
    if total != rows:  # an untouched group lost rows: deletes or moves the changed rows hide
        result.unpersist()
        return None
    return result


def run_pipeline_job(spark: SparkSession, args: argparse.Namespace) -> dict[str, Any]:
    """One run: read at one snapshot, aggregate (incrementally when sound), publish the result."""
    from pyspark.sql import functions as F

    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    previous = _state(output)
    started = time.monotonic()
    with open_snapshot(args.target, slot=args.slot) as snap:
        if len(snap.position.positions) != 1:
            raise LookupError(f"the replica has {len(snap.position.positions)} applier.progress rows; "
                              "pass --slot to say which position tags the result")
        position = snap.position.positions[0]
        info = describe_table(snap, args.table)
        carries_lsn = any(c.name == args.lsn_column and c.typname == "pg_lsn" for c in info.columns)
        mode = "full" if carries_lsn else f"full (the table has no {args.lsn_column} column)"
        result = None
        if carries_lsn and previous is not None and not args.full:
            result = _incremental(spark, snap, args, previous, output)
            mode = "incremental" if result is not None else "full (group counts did not add up)"
        if result is None:
            result = _aggregate(read_table(spark, args.table, snap, columns=[args.group_by, args.measure]),
                                args.group_by, args.measure)
        data = f"data-{position.commit_lsn.replace('/', '-')}-{int(time.time() * 1000)}"
        result.withColumn("source_commit_lsn", F.lit(position.commit_lsn)) \
            .write.mode("overwrite").parquet(str(output / data))
        groups = spark.read.parquet(str(output / data)).count()
    state = {"table": args.table, "group_by": args.group_by, "measure": args.measure,
             "commit_lsn": position.commit_lsn, "end_lsn": position.end_lsn,
             "commit_time": position.commit_time, "slot_name": position.slot_name,
             "snapshot": snap.snapshot_id, "mode": mode, "groups": groups, "data": data,
             "seconds": round(time.monotonic() - started, 3)}
    temporary = output / (STATE_FILE + ".tmp")
    temporary.write_text(json.dumps(state, indent=2) + "\n")
    temporary.replace(output / STATE_FILE)  # the switch to the new result is one rename
    if previous is not None and previous["data"] != data:
        shutil.rmtree(output / previous["data"], ignore_errors=True)
    return state


def run_pipeline(args: argparse.Namespace) -> int:
    if not args.target:
        print("applier pipeline: missing --target", file=sys.stderr)
        return 2
    try:
        spark = spark_session(args.master, app_name="applier pipeline", jar=args.jdbc_jar)
        state = run_pipeline_job(spark, args)
    except (SparkUnavailable, LookupError) as exc:
        print(f"applier pipeline: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(state, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m applier.spark.pipeline`` (the same as ``applier pipeline``)."""
    parser = argparse.ArgumentParser(prog="applier pipeline", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_pipeline(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
