"""Initial-copy benchmark: ``applier sync`` against PostgreSQL's own subscription copy.

Owns nothing the product uses; it only measures. It starts one source and one target server
(``applier.embedded``, identical settings), loads the same data once, and for each workload times,
in the same run and on fresh target databases with the same empty tables:

* ``applier sync --exit-when-caught-up`` end to end (process start, slot and snapshot, copy,
  hand-over to the worker, catch-up, exit), and
* ``CREATE SUBSCRIPTION ... WITH (copy_data = true)`` until every table is 'r' or 's' in
  ``pg_subscription_rel`` (default ``max_sync_workers_per_subscription`` = 2).

Workloads: one table of 2,000,000 rows, and 20 tables of 100,000 rows (pgbench_accounts shape:
int key, two ints, 84-character filler). Both contenders' row counts are checked. With
``--repeat N`` the contenders take turns going first and each one's best run counts.

    .venv/bin/python bench/sync.py [--pg-version 18] [--jobs 4] [--scale 1.0] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from applier.embedded import PostgresServer, ServerSettings, start_server  # noqa: E402

TABLE_SQL = "CREATE TABLE {name} (aid int PRIMARY KEY, bid int NOT NULL, abalance int NOT NULL, filler char(84))"


@dataclass(frozen=True)
class Workload:
    name: str
    tables: tuple[str, ...]
    rows: int  # per table


def load(source: PostgresServer, workloads: list[Workload]) -> None:
    with psycopg.connect(source.dsn("bench"), autocommit=True) as conn:
        for workload in workloads:
            for table in workload.tables:
                conn.execute(TABLE_SQL.format(name=table))
                conn.execute(f"INSERT INTO {table} SELECT g, g % 100, 0, '' FROM "
                             f"generate_series(1, {workload.rows}) g")
            conn.execute(f"CREATE PUBLICATION {workload.name} FOR TABLE {', '.join(workload.tables)}")
        conn.execute("VACUUM ANALYZE")


def fresh_target(target: PostgresServer, name: str, workload: Workload) -> str:
    with psycopg.connect(target.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name}")
    with psycopg.connect(target.dsn(name), autocommit=True) as conn:
        for table in workload.tables:
            conn.execute(TABLE_SQL.format(name=table))
    return target.dsn(name)


def count_rows(dsn: str, workload: Workload) -> int:
    with psycopg.connect(dsn) as conn:
        return sum(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in workload.tables)


def run_applier(source: PostgresServer, target: PostgresServer, workload: Workload, jobs: int) -> float:
    dsn = fresh_target(target, f"applier_{workload.name}", workload)
    slot = f"bench_{workload.name}"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "applier", "sync", "--source", source.dsn("bench"),
                           "--target", dsn, "--slot", slot, "--publication", workload.name,
                           "--jobs", str(jobs), "--exit-when-caught-up", "--log-level", "WARNING"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"applier sync failed:\n{proc.stderr}")
    with psycopg.connect(source.dsn("bench"), autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    assert count_rows(dsn, workload) == workload.rows * len(workload.tables)
    return elapsed


def run_native(source: PostgresServer, target: PostgresServer, workload: Workload) -> float:
    dsn = fresh_target(target, f"native_{workload.name}", workload)
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        conn.execute(f"CREATE SUBSCRIPTION sub_{workload.name} CONNECTION "
                     f"'{source.dsn('bench')}' PUBLICATION {workload.name} WITH (copy_data = true)")
        while True:
            states = [row[0] for row in conn.execute("SELECT srsubstate FROM pg_subscription_rel")]
            if states and all(state in ("r", "s") for state in states):
                break
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
        conn.execute(f"DROP SUBSCRIPTION sub_{workload.name}")
    assert count_rows(dsn, workload) == workload.rows * len(workload.tables)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pg-version", type=int, choices=(15, 18), default=18,
                        help="PostgreSQL major version of both servers (default 18)")
    parser.add_argument("--jobs", type=int, default=4,
                        help="applier sync --jobs: tables copied at once (default 4)")
    parser.add_argument("--scale", type=float, default=1.0, help="row-count multiplier (quick runs)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per contender, alternating which goes first; the best counts")
    args = parser.parse_args()
    workloads = [Workload("one_table", ("big",), int(2_000_000 * args.scale)),
                 Workload("many_tables", tuple(f"small_{i:02}" for i in range(20)),
                          int(100_000 * args.scale))]
    print(f"PostgreSQL {args.pg_version}, {os.cpu_count()} cores, applier --jobs {args.jobs}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    source = start_server(args.pg_version, ServerSettings.source(), name="benchsrc")
    target = start_server(args.pg_version, ServerSettings.source(), name="benchtgt")
    try:
        source.create_database("bench")
        load(source, workloads)
        print(f"{'workload':<34} {'applier sync':>13} {'subscription':>13} {'speed-up':>9}")
        for workload in workloads:
            runs: dict[str, list[float]] = {"ours": [], "native": []}
            for round_ in range(args.repeat):
                # Alternate who goes first: neither always meets the warmer caches or the
                # quieter moment of a shared machine.
                order = ["ours", "native"] if round_ % 2 == 0 else ["native", "ours"]
                for contender in order:
                    runs[contender].append(run_applier(source, target, workload, args.jobs)
                                           if contender == "ours" else run_native(source, target, workload))
            ours, native = min(runs["ours"]), min(runs["native"])
            label = f"{workload.name} ({len(workload.tables)} x {workload.rows:,} rows)"
            print(f"{label:<34} {ours:>12.2f}s {native:>12.2f}s {native / ours:>8.2f}x", flush=True)
            if args.repeat > 1:
                print(f"{'':<4}every run: applier sync {', '.join(f'{t:.2f}' for t in runs['ours'])}; "
                      f"subscription {', '.join(f'{t:.2f}' for t in runs['native'])}", flush=True)
    finally:
        source.cleanup()
        target.cleanup()


if __name__ == "__main__":
    main()
