"""Incremental ``applier pipeline`` against a full recompute, after a small share of a table changed.

Owns nothing the product uses; it only measures (issue 27: "an incremental pipeline run after 1%
of a 2,000,000-row table changed (inserts, updates, deletes) against a full recompute: the same
result, at least 5x faster"). One source and one target server (throwaway, ``applier.embedded``).
The source gets ``bench_pipeline (id bigint PRIMARY KEY, grp int, amount numeric(12,2), pad
text)`` with ``--rows`` rows spread over ``--groups`` groups; ``applier sync --change-feed all``
copies it (nothing streams after the copy: the pipeline starts from the copy's position), and
``applier pipeline`` (group by ``grp``, sum of ``amount``) runs once, in full. Then two parts,
``--repeat`` timed rounds each:

*Whole processes* (as from cron), each round:

1. on the source, ``--change-fraction`` of the rows change: a third deleted, a third updated
   (each moved to another group, its amount changed), a third inserted, picked at random, in
   one transaction each or (``--rows-per-transaction``) in transactions of that many rows; the
   groups those changes touch (before and after) are counted;
2. ``applier run --change-feed all --exit-when-caught-up`` applies them (no worker runs while
   the pipelines are timed);
3. timed, each as a whole process from start to exit, taking turns going first: an incremental
   ``applier pipeline`` into the output it updated last time, and ``applier pipeline --full`` into
   another directory; and a trivial Spark job (``spark.range(1).count()``), the fixed cost of
   starting and stopping Python, the JVM and Spark that both pay;
4. both results (Parquet, read back with Spark after the timings) must equal each other and a
   ``GROUP BY`` on the target, at the same commit LSN.

*One Spark session* (as ``applier pipeline --every``): the same steps, but the two pipelines are
``run_pipeline_job`` calls in this process's session, timed from call to return; an untimed
warm-up round first (a new JVM's first jobs load classes and compile).

It prints every round and the medians: process seconds, the seconds the pipeline itself reports
(``seconds`` in its state file: from opening the snapshot to the written result, Spark start-up
excluded), in-session seconds with the Spark jobs each round ran, and the ratios full /
incremental.

    .venv/bin/python bench/pipeline.py [--rows 2000000] [--change-fraction 0.01] [--groups 1000]
                                       [--repeat 3] [--pg-version 18] [--master local[*]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply_measure import load_average  # noqa: E402
from apply_workloads import SOURCE_SETTINGS, TARGET_SETTINGS  # noqa: E402

from applier.embedded import start_server  # noqa: E402

TABLE = "bench_pipeline"
DDL = f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, grp int NOT NULL, amount numeric(12,2) NOT NULL, pad text)"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
TRIVIAL_SPARK = ("from applier.spark.session import spark_session\n"
                 "import sys\n"
                 "spark = spark_session(sys.argv[1], app_name='bench trivial')\n"
                 "assert spark.range(1).count() == 1\n"
                 "spark.stop()\n")


def applier(*args: str) -> tuple[float, str]:
    """Run ``python -m applier ARGS``: (seconds from start to exit, stdout); fails loudly."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "applier", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"applier {args[0]} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return elapsed, proc.stdout


def trivial_spark(master: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", TRIVIAL_SPARK, master], cwd=ROOT, env=ENV, check=True,
                   capture_output=True)
    return time.perf_counter() - started


def load(dsn: str, rows: int, groups: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
        conn.execute(f"INSERT INTO {TABLE} SELECT g, (hashint4(g::int) & 2147483647) % {groups}, "
                     f"(g % 10000) / 100.0, repeat('x', 80) FROM generate_series(1, {rows}) g")
        conn.execute(f"CREATE PUBLICATION pub FOR TABLE {TABLE}")
        conn.execute(f"VACUUM ANALYZE {TABLE}")


def change(dsn: str, rows: int, fraction: float, groups: int, per_transaction: int) -> tuple[int, int]:
    """Delete, update (moving groups) and insert ``rows * fraction`` rows in all: one transaction
    each, or (``per_transaction``) transactions of that many rows; returns (rows changed, distinct
    groups touched before or after)."""
    third = max(1, round(rows * fraction / 3))
    step = per_transaction or third
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE picked AS SELECT id, grp, row_number() OVER () AS n "
                     f"FROM (SELECT id, grp FROM {TABLE} ORDER BY random() LIMIT {2 * third}) p")
        top = conn.execute(f"SELECT max(id) FROM {TABLE}").fetchone()[0]
        moved: list[tuple[int]] = []
        inserted: list[tuple[int]] = []
        for first in range(0, third, step):
            last = min(third, first + step)
            conn.execute(f"DELETE FROM {TABLE} t USING picked p WHERE t.id = p.id "
                         f"AND p.n > {first} AND p.n <= {last}")
            moved += conn.execute(
                f"UPDATE {TABLE} t SET grp = (t.grp + 1 + floor(random() * {groups - 1})::int) % {groups}, "
                f"amount = t.amount + 1.25 FROM picked p WHERE t.id = p.id AND p.n > {third + first} "
                f"AND p.n <= {third + last} RETURNING t.grp").fetchall()
            inserted += conn.execute(
                f"INSERT INTO {TABLE} SELECT g, floor(random() * {groups})::int, (g % 10000) / 100.0, "
                f"repeat('y', 80) FROM generate_series({top + first + 1}, {top + last}) g "
                "RETURNING grp").fetchall()
        before = {g for (g,) in conn.execute("SELECT grp FROM picked")}
        conn.execute("DROP TABLE picked")
    return 3 * third, len(before | {g for (g,) in moved} | {g for (g,) in inserted})


def sql_result(dsn: str) -> dict:
    with psycopg.connect(dsn) as conn:
        return {g: (n, k, s) for g, n, k, s in
                conn.execute(f"SELECT grp, count(*), count(amount), sum(amount) FROM {TABLE} GROUP BY grp")}


def parquet_result(spark, output: Path) -> tuple[dict, set]:
    """A pipeline output's groups (rows, sum) and the commit LSNs its rows carry."""
    state = json.loads((output / "_applier_state.json").read_text())
    found = spark.read.parquet(str(output / state["data"])).collect()
    groups = {r["grp"]: (r["rows"], r["count_amount"], r["sum_amount"]) for r in found}
    return groups, {r["source_commit_lsn"] for r in found}


def same_results(spark, outputs: dict[str, Path], states: dict[str, dict], tgt: str) -> bool:
    """Both results equal each other and a GROUP BY on the target, all at the same commit LSN."""
    incremental, lsns_i = parquet_result(spark, outputs["incremental"])
    full, lsns_f = parquet_result(spark, outputs["full"])
    lsn = states["full"]["commit_lsn"]
    return (states["incremental"]["mode"] == "incremental" and incremental == full == sql_result(tgt)
            and lsns_i == lsns_f == {lsn} and states["incremental"]["commit_lsn"] == lsn)


def header(pg_version: int, master: str) -> str:
    """The run's first line: servers, machine, Spark master, commit, time and load."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return (f"PostgreSQL {pg_version}, {os.cpu_count()} cores, Spark {master}, commit {commit}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load_average()}")


def spark_bench_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a Spark benchmark, with the options they all have."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pg-version", type=int, choices=(15, 18), default=18,
                        help="PostgreSQL major version of the servers")
    parser.add_argument("--master", default="local[*]", help="Spark master URL of every Spark run")
    return parser


def medians(runs: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in runs.items()}


def main() -> int:
    parser = spark_bench_parser(__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000,
                        help="rows in the table before the first change (the issue's figure: 2,000,000)")
    parser.add_argument("--change-fraction", type=float, default=0.01,
                        help="share of --rows changed before each timed round, in equal thirds "
                             "deletes, updates that move rows to another group, and inserts")
    parser.add_argument("--rows-per-transaction", type=int, default=0,
                        help="rows each source transaction of a change deletes, updates or inserts "
                             "(0: one transaction for each of the three)")
    parser.add_argument("--groups", type=int, default=1000,
                        help="distinct values of the group column")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed rounds of each part, each after a fresh change; medians are reported")
    args = parser.parse_args()
    if not (0 < args.change_fraction < 1 and args.rows > 0 and args.groups > 1 and args.repeat > 0
            and args.rows_per_transaction >= 0):
        parser.error("need 0 < --change-fraction < 1, --rows > 0, --groups > 1, --repeat > 0, "
                     "--rows-per-transaction >= 0")
    print(header(args.pg_version, args.master), flush=True)
    source = start_server(args.pg_version, SOURCE_SETTINGS, name="bench-pipe-src")
    target = start_server(args.pg_version, TARGET_SETTINGS, name="bench-pipe-tgt")
    spark = None
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    try:
        source.create_database("bench")
        target.create_database("bench")
        src, tgt = source.dsn("bench"), target.dsn("bench")
        with psycopg.connect(tgt, autocommit=True) as conn:
            conn.execute(DDL)
        load(src, args.rows, args.groups)
        worker = ["--source", src, "--target", tgt, "--slot", "bench", "--publication", "pub",
                  "--change-feed", "all", "--exit-when-caught-up", "--log-level", "WARNING"]
        seconds, _ = applier("sync", *worker)
        print(f"{args.rows:,} rows in {args.groups:,} groups; applier sync --change-feed all: {seconds:.1f} s",
              flush=True)
        outputs = {"incremental": work / "incremental", "full": work / "full"}
        pipeline = ["pipeline", "--target", tgt, "--table", f"public.{TABLE}", "--group-by", "grp",
                    "--measure", "amount", "--master", args.master]
        seconds, _ = applier(*pipeline, "--output", str(outputs["incremental"]))
        print(f"first pipeline run (full, no previous result): {seconds:.1f} s", flush=True)

        print("\nWhole processes (python -m applier pipeline, start to exit):", flush=True)
        print(f"{'round':>5} {'changed':>8} {'groups hit':>10} {'apply':>7} {'incremental':>12} "
              f"{'(in job)':>9} {'full':>7} {'(in job)':>9} {'ratio':>6} {'spark':>6}  same", flush=True)
        runs: dict[str, list[float]] = {k: [] for k in ("incremental", "incr_job", "full", "full_job",
                                                        "spark", "ratio")}
        ok = True
        for round_ in range(args.repeat):
            changed, hit = change(src, args.rows, args.change_fraction, args.groups, args.rows_per_transaction)
            apply_seconds, _ = applier("run", *worker)
            states = {}
            order = ["incremental", "full"] if round_ % 2 == 0 else ["full", "incremental"]
            for name in order:
                extra = ["--full"] if name == "full" else []
                seconds, out = applier(*pipeline, "--output", str(outputs[name]), *extra)
                states[name] = json.loads(out)
                runs[name].append(seconds)
            runs["spark"].append(trivial_spark(args.master))
            runs["incr_job"].append(states["incremental"]["seconds"])
            runs["full_job"].append(states["full"]["seconds"])
            runs["ratio"].append(runs["full"][-1] / runs["incremental"][-1])
            if spark is None:  # after the first timings: an idle JVM from here on, and the
                # session of the in-session part below
                from applier.spark.session import spark_session
                spark = spark_session(args.master, app_name="bench pipeline")
            same = same_results(spark, outputs, states, tgt)
            ok = ok and same
            print(f"{round_ + 1:>5} {changed:>8,} {hit:>10,} {apply_seconds:>6.1f}s "
                  f"{runs['incremental'][-1]:>11.1f}s {runs['incr_job'][-1]:>8.1f}s "
                  f"{runs['full'][-1]:>6.1f}s {runs['full_job'][-1]:>8.1f}s {runs['ratio'][-1]:>5.2f}x "
                  f"{runs['spark'][-1]:>5.1f}s  {'yes' if same else 'NO'}", flush=True)
        med = medians(runs)
        print(f"median of {args.repeat}: incremental {med['incremental']:.1f} s ({med['incr_job']:.1f} s in "
              f"the job), full {med['full']:.1f} s ({med['full_job']:.1f} s in the job), full/incremental "
              f"{med['full'] / med['incremental']:.2f}x (median of the rounds' ratios {med['ratio']:.2f}x); "
              f"trivial Spark job {med['spark']:.1f} s", flush=True)

        # One long-lived session, as applier pipeline --every runs: run_pipeline_job called
        # again and again, incremental and full taking turns; round 0 warms the session up.
        from applier.cli import parse_settings
        from applier.spark.pipeline import run_pipeline_job

        assert spark is not None
        settings = {name: parse_settings([*pipeline, "--output", str(outputs[name]),
                                          *(["--full"] if name == "full" else [])], {})
                    for name in outputs}
        print("\nOne Spark session (run_pipeline_job, as in the --every loop):", flush=True)
        print(f"{'round':>7} {'changed':>8} {'apply':>7} {'incremental':>12} {'full':>7} {'ratio':>6} "
              f"{'jobs':>9}  same", flush=True)
        tracker = spark.sparkContext.statusTracker()
        session: dict[str, list[float]] = {k: [] for k in ("incremental", "full", "ratio")}
        for round_ in range(args.repeat + 1):
            changed, _ = change(src, args.rows, args.change_fraction, args.groups, args.rows_per_transaction)
            apply_seconds, _ = applier("run", *worker)
            states, took, jobs = {}, {}, {}
            for name in (["incremental", "full"] if round_ % 2 == 0 else ["full", "incremental"]):
                # Spark jobs the round ran (each costs 0.06-0.2 s here, whatever its size).
                known = len(tracker.getJobIdsForGroup())
                started = time.perf_counter()
                states[name] = run_pipeline_job(spark, settings[name])
                took[name] = time.perf_counter() - started
                jobs[name] = len(tracker.getJobIdsForGroup()) - known
            same = same_results(spark, outputs, states, tgt)
            ok = ok and same
            if round_:
                for name in took:
                    session[name].append(took[name])
                session["ratio"].append(took["full"] / took["incremental"])
            print(f"{round_ if round_ else 'warm-up':>7} {changed:>8,} {apply_seconds:>6.1f}s "
                  f"{took['incremental']:>11.2f}s {took['full']:>6.2f}s "
                  f"{took['full'] / took['incremental']:>5.2f}x {jobs['incremental']:>4}/{jobs['full']:<4} "
                  f"{'yes' if same else 'NO'}", flush=True)
        med = medians(session)
        print(f"median of {args.repeat}: incremental {med['incremental']:.2f} s, full {med['full']:.2f} s, "
              f"full/incremental {med['full'] / med['incremental']:.2f}x (median of the rounds' ratios "
              f"{med['ratio']:.2f}x); results equal in every round of both parts: {'yes' if ok else 'NO'}")
        print(f"load average at the end: {load_average()}")
        return 0 if ok else 1
    finally:
        if spark is not None:
            spark.stop()
        source.cleanup()
        target.cleanup()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
