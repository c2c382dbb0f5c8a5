"""The change feed read as a Structured Streaming source against the same changes read over JDBC.

Owns nothing the product uses; it only measures. One source and one target server (throwaway,
``applier.embedded``). The source gets ``bench_stream (id bigint PRIMARY KEY, grp int, amount
numeric(12,2), at timestamptz, pad text)`` with ``--rows`` rows; ``applier sync --change-feed
all`` copies it, then ``--changes`` rows are updated in transactions of 1,000 rows and
``applier run --change-feed all --exit-when-caught-up`` applies them. Then, in one Spark session,
taking turns going first, ``--repeat`` times: the range of those changes read by
``read_changes`` (JDBC, every column, into Spark's ``noop`` sink) and by a ``read_change_stream``
query (``Trigger.AvailableNow``, a new checkpoint each time, into the ``noop`` sink). It prints
each time and the medians, in seconds and changes per second; an untimed warm-up of each first.

    .venv/bin/python bench/change_stream.py [--rows 200000] [--changes 1000000] [--repeat 3]
                                            [--partitions 2] [--pg-version 18] [--master local[*]]
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply_workloads import SOURCE_SETTINGS, TARGET_SETTINGS  # noqa: E402
from pipeline import applier, header, spark_bench_parser  # noqa: E402

from applier.embedded import start_server  # noqa: E402

TABLE = "bench_stream"
DDL = (f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, grp int NOT NULL, amount numeric(12,2), "
       "at timestamptz, pad text)")


def main() -> int:
    parser = spark_bench_parser(__doc__)
    parser.add_argument("--rows", type=int, default=200_000, help="rows in the table")
    parser.add_argument("--changes", type=int, default=1_000_000,
                        help="row updates applied (and read back), in transactions of 1,000 rows")
    parser.add_argument("--repeat", type=int, default=3, help="timed reads of each kind")
    parser.add_argument("--partitions", type=int, default=2, help="num_partitions of both reads")
    args = parser.parse_args()
    if args.rows <= 0 or args.changes <= 0 or args.repeat <= 0 or args.partitions <= 0:
        parser.error("--rows, --changes, --repeat and --partitions must be positive")
    print(header(args.pg_version, args.master), flush=True)
    source = start_server(args.pg_version, SOURCE_SETTINGS, name="bench-stream-src")
    target = start_server(args.pg_version, TARGET_SETTINGS, name="bench-stream-tgt")
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    spark = None
    try:
        source.create_database("bench")
        target.create_database("bench")
        src, tgt = source.dsn("bench"), target.dsn("bench")
        for dsn in (src, tgt):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(DDL)
        with psycopg.connect(src, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {TABLE} SELECT g, g % 1000, g / 100.0, now(), repeat('x', 60) "
                         f"FROM generate_series(1, {args.rows}) g")
            conn.execute(f"CREATE PUBLICATION pub FOR TABLE {TABLE}")
        worker = ["--source", src, "--target", tgt, "--slot", "bench", "--publication", "pub",
                  "--change-feed", "all", "--exit-when-caught-up", "--log-level", "WARNING"]
        applier("sync", *worker)
        with psycopg.connect(tgt) as conn:
            start = conn.execute("SELECT commit_lsn::text FROM applier.progress").fetchone()[0]
        with psycopg.connect(src, autocommit=True) as conn:
            done = 0
            while done < args.changes:
                step = min(1000, args.changes - done)
                first = done % args.rows
                conn.execute(f"UPDATE {TABLE} SET amount = amount + 1, at = now() "
                             f"WHERE id > {first} AND id <= {first + step}")
                done += step
        seconds, _ = applier("run", *worker)
        print(f"{args.changes:,} updates in {args.changes // 1000:,} transactions applied with the "
              f"feed in {seconds:.1f} s; reading them, {args.partitions} partitions:", flush=True)

        from applier.spark.changes import read_changes
        from applier.spark.reader import open_snapshot
        from applier.spark.session import spark_session
        from applier.spark.stream import read_change_stream

        spark = spark_session(args.master, app_name="bench change stream")
        runs = 0

        def jdbc() -> float:
            began = time.perf_counter()
            with open_snapshot(tgt) as snap:
                frame = read_changes(spark, f"public.{TABLE}", snap, start_lsn=start,
                                     num_partitions=args.partitions)
                frame.write.format("noop").mode("overwrite").save()
            return time.perf_counter() - began

        def stream() -> float:
            nonlocal runs
            runs += 1
            began = time.perf_counter()
            frame = read_change_stream(spark, tgt, f"public.{TABLE}", starting_lsn=start,
                                       num_partitions=args.partitions)
            query = (frame.writeStream.format("noop").trigger(availableNow=True)
                     .option("checkpointLocation", str(work / f"checkpoint-{runs}")).start())
            query.awaitTermination()
            rows = sum(p["numInputRows"] for p in query.recentProgress)
            if rows != args.changes:
                raise SystemExit(f"the stream read {rows:,} changes, not {args.changes:,}")
            return time.perf_counter() - began

        jdbc()
        stream()  # warm-up
        times: dict[str, list[float]] = {"read_changes (JDBC)": [], "read_change_stream": []}
        for n in range(args.repeat):
            order = [("read_changes (JDBC)", jdbc), ("read_change_stream", stream)]
            for name, read in order if n % 2 == 0 else reversed(order):
                times[name].append(read())
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{name:>20}: {', '.join(f'{v:.2f}' for v in values)} s; median {median:.2f} s, "
                  f"{args.changes / median:,.0f} changes/s", flush=True)
        return 0
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(work, ignore_errors=True)
        source.cleanup()
        target.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
