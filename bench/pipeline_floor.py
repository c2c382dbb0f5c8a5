"""The cheapest incremental pipeline round Spark can run, against a full recompute, in one session.

Owns nothing the product uses; it only measures the limit behind issue 27's "incremental run
after 1% of a 2,000,000-row table changed ... at least 5x faster than a full recompute". No
replication and no change feed: one throwaway target server holds

* ``floor_rows (id bigint PRIMARY KEY, grp int, amount numeric(12,2), pad text)``, ``--rows``
  rows in ``--groups`` groups (the table of ``bench/pipeline.py``), and
* ``floor_deltas (grp int, amount numeric(12,2), sign int)``: ``--change-fraction`` of ``--rows``
  signed contributions, the least any incremental round must read (as if every change carried
  its old row, so that no key needs looking up: +1 for a row's new value, -1 for its old one).

In one warmed-up Spark session (as ``applier pipeline --every`` keeps), taking turns, it times:

* **full**: the three columns of every row over JDBC (2 key-range partitions), aggregated per
  group (rows, count and sum of the measure), written as one Parquet file;
* **floor, deltas in Spark**: the signed contributions over JDBC, aggregated per group in Spark,
  merged into the previous result (a 1,000-row Parquet file, full outer join), written;
* **floor, deltas in PostgreSQL**: the same with the per-group sums computed by the JDBC query,
  so that Spark reads one row per group;
* **trivial job**: ``spark.range(1).count()``, the fixed cost of one Spark action.

No real round can be cheaper than the floor: it reads no snapshot, catalog, feed range or key
index, and writes no index. ``full / floor`` bounds the speed-up of any incremental round at
this size on this machine.

    .venv/bin/python bench/pipeline_floor.py [--rows 2000000] [--change-fraction 0.01]
                                             [--groups 1000] [--repeat 5] [--pg-version 18]
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply_measure import load_average  # noqa: E402
from apply_workloads import TARGET_SETTINGS  # noqa: E402
from pipeline import header, spark_bench_parser  # noqa: E402

from applier.embedded import start_server  # noqa: E402
from applier.spark.reader import jdbc_options  # noqa: E402
from applier.spark.session import spark_session  # noqa: E402


def load(dsn: str, rows: int, groups: int, deltas: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE floor_rows (id bigint PRIMARY KEY, grp int NOT NULL, "
                     "amount numeric(12,2) NOT NULL, pad text)")
        conn.execute(f"INSERT INTO floor_rows SELECT g, (hashint4(g::int) & 2147483647) % {groups}, "
                     f"(g % 10000) / 100.0, repeat('x', 80) FROM generate_series(1, {rows}) g")
        conn.execute("CREATE TABLE floor_deltas (grp int NOT NULL, amount numeric(12,2) NOT NULL, sign int NOT NULL)")
        conn.execute(f"INSERT INTO floor_deltas SELECT (g * 7) % {groups}, g / 100.0, "
                     f"CASE WHEN g % 2 = 0 THEN 1 ELSE -1 END FROM generate_series(1, {deltas}) g")
        conn.execute("VACUUM ANALYZE floor_rows")
        conn.execute("VACUUM ANALYZE floor_deltas")


def rounds(spark, dsn: str, rows: int, work: Path) -> dict[str, Callable[[Path], None]]:
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    url, properties = jdbc_options(dsn)
    properties |= {"fetchsize": "10000"}
    previous = work / "previous"

    def full(out: Path) -> None:
        frame = spark.read.jdbc(url, "(SELECT id, grp, amount FROM floor_rows) r",
                                predicates=[f"id <= {rows // 2}", f"id > {rows // 2}"], properties=properties)
        frame.groupBy("grp").agg(F.count(F.lit(1)).alias("rows"), F.count("amount").alias("count_amount"),
                                 F.sum("amount").alias("sum_amount")) \
            .coalesce(1).write.mode("overwrite").parquet(str(out))

    def merge(delta: DataFrame, out: Path) -> None:
        prev = spark.read.parquet(str(previous))

        def plus(column: str, change: str):
            return F.coalesce(F.col(column), F.lit(0)) + F.coalesce(F.col(change), F.lit(0))

        prev.join(delta, prev["grp"].eqNullSafe(delta["_group"]), "full_outer").select(
            F.coalesce(prev["grp"], F.col("_group")).alias("grp"), plus("rows", "_rows").alias("rows"),
            plus("count_amount", "_counted").alias("count_amount"),
            plus("sum_amount", "_summed").alias("sum_amount")) \
            .where(F.col("rows") > 0).coalesce(1).write.mode("overwrite").parquet(str(out))

    def deltas_in_spark(out: Path) -> None:
        changes = spark.read.jdbc(url, "(SELECT grp, amount, sign FROM floor_deltas) d", properties=properties)
        merge(changes.groupBy(F.col("grp").alias("_group")).agg(
            F.sum("sign").alias("_rows"), F.sum("sign").alias("_counted"),
            F.sum(F.col("amount") * F.col("sign")).alias("_summed")), out)

    def deltas_in_postgres(out: Path) -> None:
        merge(spark.read.jdbc(url, "(SELECT grp AS _group, sum(sign) AS _rows, sum(sign) AS _counted, "
                                   "sum(amount * sign) AS _summed FROM floor_deltas GROUP BY grp) d",
                              properties=properties), out)

    def trivial(out: Path) -> None:
        assert spark.range(1).count() == 1

    full(previous)
    return {"full": full, "floor, deltas in Spark": deltas_in_spark,
            "floor, deltas in PostgreSQL": deltas_in_postgres, "trivial job": trivial}


def main() -> int:
    parser = spark_bench_parser(__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows in the table")
    parser.add_argument("--change-fraction", type=float, default=0.01,
                        help="signed contributions a round reads, as a share of --rows")
    parser.add_argument("--groups", type=int, default=1000, help="distinct values of the group column")
    parser.add_argument("--repeat", type=int, default=5, help="timed turns of every variant; medians reported")
    args = parser.parse_args()
    if not (0 < args.change_fraction < 1 and args.rows > 1 and args.groups > 1 and args.repeat > 0):
        parser.error("need 0 < --change-fraction < 1, --rows > 1, --groups > 1, --repeat > 0")
    print(header(args.pg_version, args.master), flush=True)
    server = start_server(args.pg_version, TARGET_SETTINGS, name="bench-floor")
    work = Path(tempfile.mkdtemp(prefix="bench-floor-"))
    spark = None
    try:
        server.create_database("bench")
        dsn = server.dsn("bench")
        deltas = max(1, int(args.rows * args.change_fraction))
        load(dsn, args.rows, args.groups, deltas)
        spark = spark_session(args.master, app_name="bench pipeline floor")
        variants = rounds(spark, dsn, args.rows, work)
        for run in variants.values():  # warm-up: a new JVM's first jobs load and compile
            run(work / "warm-up")
        times: dict[str, list[float]] = {name: [] for name in variants}
        for turn in range(args.repeat):
            order = list(variants) if turn % 2 == 0 else list(reversed(variants))
            for name in order:
                started = time.perf_counter()
                variants[name](work / f"out-{turn}")
                times[name].append(time.perf_counter() - started)
        full = statistics.median(times["full"])
        print(f"{args.rows:,} rows, {args.groups:,} groups, {deltas:,} signed contributions a round; "
              f"seconds in one warm session, median of {args.repeat}:")
        for name, seconds in times.items():
            median = statistics.median(seconds)
            ratio = f"full / this {full / median:5.2f}x" if name.startswith("floor") else ""
            print(f"  {name:<28} {median:6.3f} s  {ratio:<20} ({' '.join(f'{s:.3f}' for s in seconds)})")
        print(f"load average at the end: {load_average()}")
        return 0
    finally:
        if spark is not None:
            spark.stop()
        server.cleanup()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
