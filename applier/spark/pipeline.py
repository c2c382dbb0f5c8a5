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
from .columns import describe_table
from .reader import read_table
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


def _incremental(spark: SparkSession, snap: Snapshot, settings: Settings, table: str,
                 previous: dict[str, Any], output: Path) -> DataFrame | None:
    """The new result from the changed groups and the previous result, or None if unsound."""
    from pyspark.sql import functions as F

    lsn = str(previous["commit_lsn"])
    group_by, measure = settings.group_by, settings.measure
    changed = read_table(spark, table, snap, columns=[group_by],
                         where=f"{ident(settings.lsn_column)} > {snap.literal(lsn)}::pg_lsn")
    groups = [row[0] for row in changed.distinct().collect()]
    old = spark.read.parquet(str(output / previous["data"])).drop("source_commit_lsn")
    if groups:
        in_groups = f"{ident(group_by)} = ANY({snap.literal(groups)})"
        recomputed = _aggregate(read_table(spark, table, snap, columns=[group_by, measure],
                                           where=in_groups), group_by, measure)
        kept = old.where(~F.col(group_by).isin(groups) | F.col(group_by).isNull())
        result = kept.unionByName(recomputed)
    else:
        result = old
    result = result.persist()
    rows = snap.query(f"SELECT count(*) FROM {describe_table(snap, table).qualified}")[0][0]
    summed = result.agg(F.sum("rows")).first()
    total = (summed[0] if summed is not None else 0) or 0
    if total != rows:  # an untouched group lost rows: deletes or moves the changed rows hide
        result.unpersist()
        return None
    return result


def run_pipeline_job(spark: SparkSession, settings: Settings) -> dict[str, Any]:
    """One run: read at one snapshot, aggregate (incrementally when sound), publish the result."""
    from pyspark.sql import functions as F

    assert settings.target is not None and settings.output is not None  # required by the command
    output = settings.output
    (table,) = settings.table  # the settings allow pipeline exactly one
    group_by, measure, lsn_column = settings.group_by, settings.measure, settings.lsn_column
    output.mkdir(parents=True, exist_ok=True)
    previous = _state(output)
    started = time.monotonic()
    with open_snapshot(settings.target, slot=settings.slot) as snap:
        if len(snap.position.positions) != 1:
            raise LookupError(f"the replica has {len(snap.position.positions)} applier.progress rows; "
                              "pass --slot to say which position tags the result")
        position = snap.position.positions[0]
        info = describe_table(snap, table)
        carries_lsn = any(c.name == lsn_column and c.typname == "pg_lsn" for c in info.columns)
        mode = "full" if carries_lsn else f"full (the table has no {lsn_column} column)"
        result = None
        if carries_lsn and previous is not None and not settings.full:
            result = _incremental(spark, snap, settings, table, previous, output)
            mode = "incremental" if result is not None else "full (group counts did not add up)"
        if result is None:
            result = _aggregate(read_table(spark, table, snap, columns=[group_by, measure]),
                                group_by, measure)
        data = f"data-{position.commit_lsn.replace('/', '-')}-{int(time.time() * 1000)}"
        result.withColumn("source_commit_lsn", F.lit(position.commit_lsn)) \
            .write.mode("overwrite").parquet(str(output / data))
        groups = spark.read.parquet(str(output / data)).count()
    state = {"table": table, "group_by": group_by, "measure": measure,
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
