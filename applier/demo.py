"""``applier demo``: the whole product on two throwaway servers, in one command.

Starts a source and a target PostgreSQL from the binaries the project installs, creates a small
shop schema (identity, serial, CHECK and foreign key constraints, an index) and a few thousand
rows on the source, runs ``applier sync --create-tables`` (the target's tables made with the
source's definition, slot, snapshot copy, then streaming, with two-phase decoding) while a
workload writes (small transactions, a large transaction the server streams in progress, a
two-phase transaction, rows deleted and updated, and schema changes: a column added with a
default, a type widened), shows progress and lag live, damages the target and finds and repairs
it while the worker runs (``applier verify``, ``verify --repair``, ``verify`` again), then ends
the replica's life as a migration does: ``applier cutover`` with its default checks (the worker
caught up, sequences set, nothing pending, schemas compared, every row compared by hash, skips
and conflicts weighed) while the worker still runs, then stops the worker and retires the
replica with ``applier drop``; prints a summary and removes the servers (``--keep`` leaves them
running and prints their connection strings).
Must never touch a server it did not start.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Callable

import psycopg

from .config import Settings
from .embedded import Database, ServerSettings, start_server
from .exit_codes import ExitCode

DEMO_GID = "demo-order-batch"
SCHEMA = """
CREATE TABLE customers (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, name text NOT NULL,
                        email text, created timestamptz DEFAULT now());
CREATE TABLE products (sku text PRIMARY KEY, title text, price numeric(10,2) CHECK (price >= 0),
                       tags text[]);
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id int NOT NULL REFERENCES customers,
                     sku text NOT NULL REFERENCES products, qty int NOT NULL CHECK (qty > 0),
                     total numeric(12,2), note jsonb);
CREATE INDEX orders_by_customer ON orders (customer_id);
CREATE TABLE reviews (id serial PRIMARY KEY, sku text NOT NULL, stars int NOT NULL
                      CHECK (stars BETWEEN 1 AND 5));
"""
#: Made on the source while the worker streams: the worker follows them on the target.
SCHEMA_CHANGES = ("ALTER TABLE customers ADD COLUMN vip boolean NOT NULL DEFAULT false",
                  "ALTER TABLE orders ALTER COLUMN qty TYPE bigint")


def _workload_step(conn: psycopg.Connection, rng: random.Random, next_order: list[int],
                   bulk: bool) -> int:
    """One source transaction; returns the rows it changed."""
    roll = rng.random()
    with conn.transaction():
        if bulk:  # a large transaction: the server streams it while it is still in progress
            start = next_order[0]
            next_order[0] += 20000
            conn.execute("INSERT INTO orders SELECT g, 1 + g %% 2000, 'sku-' || (g %% 200), 1, 9.99, "
                         "jsonb_build_object('bulk', true, 'pad', repeat('x', 100)) "
                         "FROM generate_series(%s::bigint, %s::bigint) g", (start, next_order[0] - 1))
            return 20000
        if roll < 0.10:
            conn.execute("UPDATE products SET price = price + 0.01 WHERE sku = %s",
                         (f"sku-{rng.randrange(200)}",))
            return 1
        if roll < 0.15:
            conn.execute("DELETE FROM orders WHERE id = %s", (rng.randrange(1, next_order[0]),))
            return 1
        order = next_order[0]
        next_order[0] += 1
        conn.execute("INSERT INTO orders VALUES (%s, %s, %s, %s, %s, %s)",
                     (order, rng.randrange(1, 2001), f"sku-{rng.randrange(200)}", rng.randint(1, 5),
                      rng.randint(100, 99999) / 100, '{"channel": "web"}'))
        conn.execute("UPDATE customers SET email = %s WHERE id = %s",
                     (f"c{order}@example.com", rng.randrange(1, 2001)))
        conn.execute("INSERT INTO reviews (sku, stars) VALUES (%s, %s)",
                     (f"sku-{rng.randrange(200)}", rng.randint(1, 5)))
        return 3


def _prepare_step(conn: psycopg.Connection, next_order: list[int]) -> int:
    """Prepare a two-phase transaction (the worker applies it and prepares it on the target) and
    leave it pending while later transactions commit. Returns the rows it changes."""
    order = next_order[0]
    next_order[0] += 10
    conn.execute("BEGIN")
    conn.execute("INSERT INTO orders SELECT g, 1, 'sku-1', 1, 1.00, '{\"two_phase\": true}' "
                 "FROM generate_series(%s::bigint, %s::bigint) g", (order, order + 9))
    conn.execute(f"PREPARE TRANSACTION '{DEMO_GID}'")
    return 10


def _lag(source: psycopg.Connection) -> int | None:
    """Bytes of source WAL the slot has not confirmed yet; None before sync has made the slot
    (a slow start must not pass for a replica caught up)."""
    row = source.execute("SELECT pg_current_wal_lsn() - confirmed_flush_lsn FROM pg_replication_slots "
                         "WHERE slot_name = 'demo'").fetchone()
    return int(row[0]) if row and row[0] is not None else None


def _damage_and_repair(say: Callable[[str], None], target: Database, verify: list[str]) -> bool:
    """Damage the replica while the worker runs, find it (applier verify), repair it (verify
    --repair) and verify again; True when the last verify found the tables equal."""
    say("  damage on the target: a review deleted, a product's price changed, an order added ...")
    target.execute("DELETE FROM reviews WHERE id = 7")  # no row references it
    target.execute("UPDATE products SET price = 0 WHERE sku = 'sku-3'")
    target.execute("INSERT INTO orders VALUES (-1, 1, 'sku-1', 1, 0, NULL)")
    equal = False
    for label, extra in (("applier verify: both sides at one source position the worker holds at",
                          []),
                         ("applier verify --repair: those rows as the source has them", ["--repair"]),
                         ("applier verify again", [])):
        say(f"  {label} ...")
        done = subprocess.run([*verify, *extra], capture_output=True, text=True)
        for line in (done.stdout + done.stderr).splitlines():
            if not (line.startswith("public.") and line.endswith(" equal")):  # the differing only
                say(f"    {line}")
        equal = done.returncode == ExitCode.OK and done.stdout.rstrip().endswith("EQUAL")
    return equal


def run_demo(settings: Settings) -> int:
    """``applier demo``: OK when the target equals the source at the end, else CHECK."""
    say = lambda text: print(text, flush=True)  # noqa: E731
    seconds = settings.seconds
    say(f"applier demo: starting two throwaway PostgreSQL {settings.pg_version} servers ...")
    source_server = start_server(settings.pg_version, ServerSettings.source(), name="demo-source")
    target_server = start_server(settings.pg_version, ServerSettings.target(), name="demo-target")
    worker: subprocess.Popen | None = None
    try:
        source_db = source_server.create_database("shop")
        target_db = target_server.create_database("shop")
        source_db.execute(SCHEMA)
        source_db.execute("CREATE PUBLICATION demo_pub FOR TABLE customers, products, orders, reviews")
        with source_db.connect() as conn:
            conn.execute("INSERT INTO customers (name) SELECT 'customer ' || g FROM generate_series(1, 2000) g")
            conn.execute("INSERT INTO products SELECT 'sku-' || g, 'product ' || g, g * 1.25, "
                         "ARRAY['tag' || (g % 5), 'sale'] FROM generate_series(0, 199) g")
        say("  schema, publication demo_pub and 2,200 rows on the source, an empty target; "
            "starting applier sync --create-tables (tables, slot, snapshot copy, then streaming) "
            "while the workload writes ...")
        worker = subprocess.Popen([sys.executable, "-m", "applier", "sync", "--source", source_db.dsn,
                                   "--target", target_db.dsn, "--slot", "demo", "--publication",
                                   "demo_pub", "--jobs", "2", "--two-phase", "--create-tables",
                                   "--log-level", "WARNING"])
        rng = random.Random(42)
        next_order = [1]
        rows = 2200
        transactions = 2
        max_lag = 0
        started = time.monotonic()
        last_report = started
        bulk_done = committed = altered = False
        prepared_at: float | None = None
        with source_db.connect() as writer, source_db.connect() as watcher:
            while time.monotonic() - started < seconds:
                elapsed_now = time.monotonic() - started
                bulk = not bulk_done and elapsed_now > seconds / 3
                bulk_done |= bulk
                if prepared_at is None and elapsed_now > seconds / 2:
                    rows += _prepare_step(writer, next_order)
                    prepared_at = elapsed_now
                    say(f"  {elapsed_now:5.1f}s  prepared two-phase transaction {DEMO_GID!r}; "
                        "later transactions commit while it is pending")
                elif prepared_at is not None and not committed and elapsed_now > seconds * 3 / 4:
                    writer.execute(f"COMMIT PREPARED '{DEMO_GID}'")
                    committed = True
                    say(f"  {elapsed_now:5.1f}s  COMMIT PREPARED {DEMO_GID!r} after "
                        f"{elapsed_now - prepared_at:.1f}s pending")
                elif committed and not altered and elapsed_now > seconds * 5 / 6:
                    # After the prepared transaction, whose locks the type change would wait for.
                    for statement in SCHEMA_CHANGES:
                        writer.execute(statement)
                    writer.execute("UPDATE customers SET vip = true WHERE id % 10 = 0")
                    altered = True
                    say(f"  {elapsed_now:5.1f}s  schema changes on the source: "
                        + "; ".join(SCHEMA_CHANGES))
                rows += _workload_step(writer, rng, next_order, bulk)
                transactions += 1
                time.sleep(0.004)  # a steady OLTP trickle of about 200 transactions/s
                now = time.monotonic()
                if now - last_report >= 1:
                    lag = _lag(watcher)
                    max_lag = max(max_lag, lag or 0)
                    say(f"  {now - started:5.1f}s  {transactions:6d} transactions  {rows:7d} rows  "
                        + (f"slot lag {lag / 1024:8.1f} kB" if lag is not None
                           else "slot not made yet"))
                    last_report = now
                if worker.poll() is not None:
                    raise SystemExit(f"the worker exited early with status {worker.returncode}")
            say("  workload stopped; waiting for the worker to catch up ...")
            deadline = time.monotonic() + 120
            while _lag(watcher) != 0 and time.monotonic() < deadline:
                if worker.poll() is not None:
                    raise SystemExit(f"the worker exited early with status {worker.returncode}")
                time.sleep(0.2)
            if _lag(watcher) != 0:
                raise SystemExit("the worker did not catch up within 120 s of the workload's end")
        elapsed = time.monotonic() - started
        applier = [sys.executable, "-m", "applier"]
        servers = ["--source", source_db.dsn, "--target", target_db.dsn, "--slot", "demo"]
        repaired = _damage_and_repair(say, target_db, [*applier, "verify", *servers, "--publication",
                                                       "demo_pub", "--max-keys", "3"])
        say("  applier cutover: writes have stopped; caught up? sequences, prepared transactions, "
            "schemas, every row compared, skips and conflicts ...")
        cutover = subprocess.run([*applier, "cutover", *servers, "--publication", "demo_pub",
                                  "--timeout", "2min"], capture_output=True, text=True)
        for line in (cutover.stdout + cutover.stderr).splitlines():
            say(f"    {line}")
        safe = cutover.returncode == ExitCode.OK
        worker.terminate()
        worker.wait(timeout=30)
        say("  worker stopped; applier drop: the slot, origin, bookkeeping rows and spill files ...")
        drop = subprocess.run([*applier, "drop", *servers, "--yes"], capture_output=True, text=True)
        for line in (drop.stdout + drop.stderr).splitlines():
            say(f"    {line}")
        dropped = drop.returncode == ExitCode.OK
        say(f"summary: {transactions} source transactions, {rows} row changes in {elapsed:.1f}s "
            f"({rows / elapsed:,.0f} rows/s written and replicated), peak slot lag "
            f"{max_lag / 1024:.1f} kB, damage {'found and repaired' if repaired else 'NOT repaired'}, "
            f"target {'equals' if safe else 'DIFFERS FROM'} source"
            + ("" if safe else " (see the cutover report)")
            + (", replica retired" if dropped else "; the drop FAILED"))
        if settings.keep:
            say(f"servers kept running:\n  source: {source_db.dsn}\n  target: {target_db.dsn}")
        return ExitCode.OK if safe and dropped and repaired else ExitCode.CHECK
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        if not settings.keep:
            source_server.cleanup()
            target_server.cleanup()
