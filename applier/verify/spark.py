"""``applier verify --engine spark``: the comparison of :mod:`.sql`, computed by Spark.

Owns: reading both sides through :mod:`applier.spark.reader` (the target snapshot first, then the
source, each exported and held open for the whole comparison), per-range counts and hash sums,
and the full outer join of the rows of differing ranges. Must never write to either database,
collect whole tables to the driver, or be imported unless the Spark engine was asked for.

Values are compared in PostgreSQL's text form (every non-key column is read with
``text_columns``), so no type mapping question can make equal rows differ. Ranges are buckets of
the key's hash here (Spark decides the key-range partitioning of the reads itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from ..spark.reader import Snapshot, open_snapshot, read_table, spark_column
from .report import MAX_RANGES, ROWS_PER_RANGE, TableResult, TableSpec, VerifyReport

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["compare_spark"]


def compare_spark(spark: SparkSession, source_dsn: str, target_dsn: str, specs: Sequence[TableSpec],
                  slot: str | None, max_keys: int) -> VerifyReport:
    with open_snapshot(target_dsn, slot=slot) as target, open_snapshot(source_dsn) as source:
        results = [_compare_table(spark, source, target, spec, max_keys) for spec in specs]
    positions = [asdict(p) for p in target.position.positions]
    return VerifyReport("spark", source.position.wal_lsn, positions, 1, results)


def _prepared(spark: SparkSession, snap: Snapshot, spec: TableSpec, where: str | None) -> DataFrame:
    """(k0, k1, ..., row hash) per row, or (row, row hash) for a table without a key."""
    from pyspark.sql import functions as F

    frame = read_table(spark, spec.qualified.as_string(), snap,
                       columns=list(spec.columns), where=where,
                       text_columns=[c for c in spec.columns if c not in spec.key])
    # to_json leaves out NULL fields, so NULL and '' (or a moved value) hash differently.
    row = F.to_json(F.struct(*[F.col(spark_column(c)).cast("string").alias(c) for c in spec.columns]))
    keys = [F.col(spark_column(k)).cast("string").alias(f"k{i}") for i, k in enumerate(spec.key)] or [row.alias("k0")]
    return frame.select(*keys, F.md5(row).alias("h"))


def _compare_table(spark: SparkSession, source_snap: Snapshot, target_snap: Snapshot,
                   spec: TableSpec, max_keys: int) -> TableResult:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    result = TableResult(spec.display, key=list(spec.key or ["row"]))
    try:
        source = _prepared(spark, source_snap, spec, spec.row_filter)
        target = _prepared(spark, target_snap, spec, None)
    except LookupError as exc:
        result.error = str(exc)
        return result
    key_names = [f"k{i}" for i in range(max(1, len(spec.key)))]
    # Each action would re-read the databases; keys and hashes are small, keep them.
    source, target = (frame.persist(StorageLevel.MEMORY_AND_DISK) for frame in (source, target))
    try:
        result.source_rows, result.target_rows = source.count(), target.count()
        ranges = max(1, min(MAX_RANGES, -(-max(result.source_rows, result.target_rows) // ROWS_PER_RANGE)))
        result.ranges = ranges

        def sums(frame: DataFrame) -> dict[int, tuple[int, int]]:
            bucketed = frame.withColumn("r", F.pmod(F.xxhash64(*key_names), F.lit(ranges)))
            rows = bucketed.groupBy("r").agg(
                F.count(F.lit(1)).alias("n"),
                F.sum(F.conv(F.substring("h", 1, 15), 16, 10).cast("decimal(20,0)")).alias("s")).collect()
            return {int(r["r"]): (int(r["n"]), int(r["s"])) for r in rows}

        source_sums, target_sums = sums(source), sums(target)
        differing = sorted(r for r in source_sums.keys() | target_sums.keys()
                           if source_sums.get(r) != target_sums.get(r))
        result.differing_ranges = len(differing)
        if differing:
            in_ranges = F.pmod(F.xxhash64(*key_names), F.lit(ranges)).isin(differing)
            if spec.key:
                _keyed_differences(result, source.where(in_ranges), target.where(in_ranges),
                                   key_names, max_keys)
            else:
                _multiset_differences(result, source.where(in_ranges), target.where(in_ranges), max_keys)
    finally:
        source.unpersist()
        target.unpersist()
    return result


def _keyed_differences(result: TableResult, source: DataFrame, target: DataFrame,
                       key_names: list[str], max_keys: int) -> None:
    from pyspark.sql import functions as F

    joined = source.withColumnRenamed("h", "sh").join(target.withColumnRenamed("h", "th"),
                                                      key_names, "full_outer")
    kind = (F.when(F.col("th").isNull(), "missing").when(F.col("sh").isNull(), "extra")
            .when(F.col("sh") != F.col("th"), "changed"))
    differences = joined.select(*key_names, kind.alias("kind")).where(F.col("kind").isNotNull())
    counts = {r["kind"]: int(r["count"]) for r in differences.groupBy("kind").count().collect()}
    result.missing_count = counts.get("missing", 0)
    result.extra_count = counts.get("extra", 0)
    result.changed_count = counts.get("changed", 0)
    for name, target_list in (("missing", result.missing), ("extra", result.extra), ("changed", result.changed)):
        rows = differences.where(F.col("kind") == name).orderBy(*key_names).limit(max_keys).collect()
        target_list.extend([r[k] for k in key_names] for r in rows)


def _multiset_differences(result: TableResult, source: DataFrame, target: DataFrame,
                          max_keys: int) -> None:
    from pyspark.sql import functions as F

    counted = [frame.groupBy("k0").agg(F.count(F.lit(1)).alias(name))
               for frame, name in ((source, "sn"), (target, "tn"))]
    diff = counted[0].join(counted[1], "k0", "full_outer").select(
        "k0", (F.coalesce(F.col("sn"), F.lit(0)) - F.coalesce(F.col("tn"), F.lit(0))).alias("d")
    ).where(F.col("d") != 0)
    totals = diff.agg(F.sum(F.when(F.col("d") > 0, F.col("d"))).alias("missing"),
                      F.sum(F.when(F.col("d") < 0, -F.col("d"))).alias("extra")).first()
    result.missing_count = int(totals["missing"] or 0) if totals else 0
    result.extra_count = int(totals["extra"] or 0) if totals else 0
    for sign, target_list in ((1, result.missing), (-1, result.extra)):
        for row in diff.where(F.col("d") * sign > 0).orderBy("k0").limit(max_keys).collect():
            target_list.extend([[row["k0"]]] * min(abs(int(row["d"])), max_keys))
        del target_list[max_keys:]
