"""``applier verify --repair`` and ``applier resync`` on a live replica (issue 40): under a pgbench
load with the worker running, damage to the target is reported exactly and repaired while the
load goes on; the other tables never pause for longer than the copy of a table resynced; a
keyless table is copied again whole."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time

import forked
import pytest
from live import applier, pgbench_load, pgbench_replica, script, servers, verify, wait_streaming
from replication import (
    REPO,
    assert_same_rows,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
    wait_slot_inactive,
    worker_env,
)
from test_ops import http_get, metrics_url, sample

from applier.exit_codes import ExitCode

pytestmark = pytest.mark.server

#: TPC-B on half the accounts and tellers (the other half is left for the damage), and a tick per
#: transaction into ``ticks``, whose target-only column says when the worker applied it.
LOAD = """\\set aid random(1, 50000)
\\set tid random(1, 5)
\\set delta random(-5000, 5000)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
UPDATE pgbench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid;
UPDATE pgbench_branches SET bbalance = bbalance + :delta WHERE bid = 1;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, 1, :aid, :delta, CURRENT_TIMESTAMP);
INSERT INTO ticks (at) VALUES (clock_timestamp());
END;
"""
# (The target's ticks.applied_at of the first test is not published: verify and the row-by-row
# comparison leave it out.)


def _damage(target_db) -> int:
    """Delete, change and add rows in two tables, truncate a third; the rows truncated."""
    target_db.execute("DELETE FROM pgbench_accounts WHERE aid BETWEEN 60001 AND 60010")
    target_db.execute("UPDATE pgbench_accounts SET abalance = -1 WHERE aid BETWEEN 70001 AND 70005")
    target_db.execute("INSERT INTO pgbench_accounts VALUES (200001, 1, 0, ''), (200002, 1, 0, '')")
    target_db.execute("DELETE FROM pgbench_tellers WHERE tid = 9")
    target_db.execute("UPDATE pgbench_tellers SET tbalance = 7 WHERE tid = 8")
    target_db.execute("INSERT INTO pgbench_tellers VALUES (100, 1, 0, 'extra')")
    with target_db.connect() as conn, conn.transaction():
        conn.execute("LOCK TABLE pgbench_history")  # the count is exactly what TRUNCATE removes
        truncated = conn.execute("SELECT count(*) FROM pgbench_history").fetchone()[0]
        conn.execute("TRUNCATE pgbench_history")
    return truncated


@pytest.mark.slow
def test_damage_is_reported_exactly_and_repaired_under_load(pg_pair, source_db, target_db,
                                                            tmp_path) -> None:
    for db in (source_db, target_db):
        db.execute("CREATE TABLE ticks (id bigserial PRIMARY KEY, at timestamptz)")
    target_db.execute("ALTER TABLE ticks ADD COLUMN applied_at timestamptz DEFAULT clock_timestamp()")
    pgbench_replica(pg_pair, source_db, target_db, extra_tables=("ticks",))
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, log_path=log)
    try:
        wait_streaming(source_db, target_db)
        with pgbench_load(pg_pair, source_db, "-f", script(tmp_path, LOAD)):
            truncated = _damage(target_db)
            rc, report = verify(source_db, target_db)
            assert rc == ExitCode.CHECK and report["exact"], (report["notes"], log.read_text()[-3000:])
            found = {t["table"]: (t["missing"], t["extra"], t["changed"]) for t in report["tables"]
                     if not t["equal"]}
            history = found.pop("public.pgbench_history")
            assert history[1:] == ([], []) and len(history[0]) == min(truncated, 100)
            assert found == {
                "public.pgbench_accounts": ([[str(a)] for a in range(60001, 60011)],
                                            [["200001"], ["200002"]],
                                            [[str(a)] for a in range(70001, 70006)]),
                "public.pgbench_tellers": ([["9"]], [["100"]], [["8"]])}
            counts = {t["table"]: (t["missing_count"], t["extra_count"]) for t in report["tables"]}
            assert counts["public.pgbench_history"] == (truncated, 0)
            assert "copy the whole table again" in {t["table"]: t for t in report["tables"]}[
                "public.pgbench_history"]["repair"]
            # The keyed tables by verify --repair, the truncated one by applier resync.
            rc, report = verify(source_db, target_db, "--repair", "--table", "pgbench_accounts",
                                "--table", "pgbench_tellers")
            assert rc == ExitCode.OK, report
            assert {(r["table"], r["action"], r["inserted"], r["updated"], r["deleted"])
                    for r in report["repairs"]} == {("public.pgbench_accounts", "repair", 10, 5, 2),
                                                    ("public.pgbench_tellers", "repair", 1, 1, 1)}
            done = applier("resync", *servers(source_db, target_db), "--slot", "s", "--publication",
                           "pub", "--table", "pgbench_history")
            assert done.returncode == 0, done.stderr
            wait_for(lambda: target_db.query("SELECT state FROM applier.repairs WHERE kind = "
                                             "'resync'") == [("done",)], timeout=120, what="the resync")
            rc, report = verify(source_db, target_db)
            assert rc == ExitCode.OK and report["exact"], report
    finally:
        assert stop_worker(worker) == 0, log.read_text()[-4000:]
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "pgbench_accounts", "pgbench_tellers", "pgbench_branches",
                     "pgbench_history", "ticks")
    # The repairs and the resync ran beside the stream: the worker never stopped or started its
    # replication session again (not a timing: a busy machine stretches any pause).
    sessions = [line for line in log.read_text().splitlines() if "streaming from" in line]
    assert len(sessions) == 1, sessions
    assert target_db.query("SELECT kind, schema_name, table_name, keys FROM applier.repairs "
                           "WHERE kind = 'repair' ORDER BY table_name") == [
        ("repair", "public", "pgbench_accounts", [[60001, 60010], [70001, 70005], [200001, 200002]]),
        ("repair", "public", "pgbench_tellers", [[8, 9], [100, 100]])]


def test_a_keyless_table_is_copied_again_whole(source_db, target_db, tmp_path) -> None:
    for db in (source_db, target_db):
        db.execute("CREATE TABLE bag (x int, y text)")
        db.execute("ALTER TABLE bag REPLICA IDENTITY FULL")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE bag")
    source_db.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    source_db.execute("INSERT INTO bag SELECT g % 10, 'dup' FROM generate_series(1, 1000) g")
    run_worker(source_db, target_db)
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, "--metrics-port", "0", "--metrics-address",
                          "127.0.0.1", "--status-interval", "1", log_path=log)
    try:
        wait_streaming(source_db, target_db)
        target_db.execute("DELETE FROM bag WHERE ctid IN (SELECT ctid FROM bag WHERE x = 3 LIMIT 2)")
        target_db.execute("INSERT INTO bag VALUES (42, 'extra')")
        source_db.execute("UPDATE bag SET y = 'changed' WHERE ctid = (SELECT min(ctid) FROM bag "
                          "WHERE x = 5)")
        rc, report = verify(source_db, target_db)
        (bag,) = report["tables"]
        assert rc == ExitCode.CHECK and (bag["missing_count"], bag["extra_count"]) == (2, 1), report
        rc, report = verify(source_db, target_db, "--repair")
        assert rc == ExitCode.OK and [r["action"] for r in report["repairs"]] == ["resync"], report
        wait_for(lambda: target_db.query("SELECT state FROM applier.repairs") == [("done",)],
                 timeout=120, what="the resync")
        rc, report = verify(source_db, target_db)
        assert rc == ExitCode.OK, report
        # Shown by the metrics (the probe reads applier.repairs every status interval) and status.
        base = metrics_url(log)
        wait_for(lambda: sample(http_get(f"{base}/metrics")[1], "applier_repairs_total",
                                kind="resync") == 1, what="the resync in the metrics")
        text = http_get(f"{base}/metrics")[1]
        assert sample(text, "applier_resyncs_pending") == 0
        assert (sample(text, "applier_verify_holds_total") or 0) >= 3  # two verifies and a repair's
        assert sample(text, "applier_repaired_rows_total", kind="resync") == 1000
    finally:
        assert stop_worker(worker) == 0, log.read_text()[-4000:]
    assert_same_rows(source_db, target_db, "bag")
    status = applier("status", *servers(source_db, target_db), "--slot", "s")
    assert re.search(r"public\.bag: resync done at [0-9A-F]+/[0-9A-F]+: 1000 rows copied", status.stdout), \
        status.stdout


#: How verify --repair and its worker die, one scenario after the other: at a named point (the
#: dangerous moments: the worker holding, a table emptied for its copy, the repair holding the
#: worker, its rows committed), then at random moments.
SCENARIOS = [("worker", "resync_copying"), ("worker", "after_hold_ack"), ("repair", "repair_held"),
             ("repair", "after_repair"), ("random", None), ("random", None), ("random", None)]


def _damage_keys(target_db, n: int) -> None:
    """A few more keys of the half the load leaves alone: deleted, changed, added."""
    base = 80000 + 100 * n
    target_db.execute("DELETE FROM pgbench_accounts WHERE aid BETWEEN %s AND %s", (base, base + 4))
    target_db.execute("UPDATE pgbench_accounts SET abalance = -2 WHERE aid = %s", (base + 50,))
    target_db.execute("INSERT INTO pgbench_accounts VALUES (%s, 1, 0, '')", (300000 + n,))


@pytest.mark.slow
def test_killed_worker_and_repair_lose_nothing(pg_pair, source_db, target_db, tmp_path) -> None:
    """verify --repair (keyed repairs and a resync) killed, or its worker killed, at the moments
    that matter and at random ones, under the load: a rerun finishes the job, and the tables end
    up equal row by row (nothing lost, nothing doubled)."""
    rng = random.Random(40 + pg_pair.version)
    for db in (source_db, target_db):
        db.execute("CREATE TABLE ticks (id bigserial PRIMARY KEY, at timestamptz)")
    pgbench_replica(pg_pair, source_db, target_db, extra_tables=("ticks",))
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, log_path=log)
    died = []
    try:
        wait_streaming(source_db, target_db)
        with pgbench_load(pg_pair, source_db, "-f", script(tmp_path, LOAD)):
            _damage(target_db)
            command = [sys.executable, "-m", "applier", "verify", *servers(source_db, target_db),
                       "--publication", "pub", "--repair", "--timeout", "30s"]
            for n, (who, point) in enumerate(SCENARIOS):
                _damage_keys(target_db, n)
                if who == "worker":
                    stop_worker(worker)
                    worker = start_worker(source_db, target_db, log_path=log, fault=point)
                    wait_streaming(source_db, target_db)
                repair = forked.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      cwd=REPO, env=worker_env(point if who == "repair" else None))
                if who == "random":
                    time.sleep(rng.uniform(0.2, 3.0))
                    who = rng.choice(["repair", "worker", "both"])
                    if who in ("repair", "both"):
                        repair.kill()
                    if who in ("worker", "both"):
                        worker.kill()
                if who in ("worker", "both"):
                    died.append(worker.wait(timeout=120))
                    wait_slot_inactive(source_db)
                    worker = start_worker(source_db, target_db, log_path=log)
                    wait_streaming(source_db, target_db)
                died.append(repair.wait(timeout=120))
            # The rerun: whatever is still different is repaired; a resync it asks for is done.
            rc, report = verify(source_db, target_db, "--repair")
            assert rc == ExitCode.OK, (died, report)
            wait_for(lambda: target_db.query("SELECT count(*) FROM applier.repairs WHERE kind = "
                                             "'resync' AND state <> 'done'") == [(0,)],
                     timeout=120, what="the resyncs")
            rc, report = verify(source_db, target_db)
            assert rc == ExitCode.OK and report["exact"], (died, report)
    finally:
        assert stop_worker(worker) == 0, log.read_text()[-4000:]
    # Each named point was reached; a repair outlived its worker's death there.
    assert died[:6] == [-9, 0, -9, 0, -9, -9], died
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "pgbench_accounts", "pgbench_tellers", "pgbench_branches",
                     "pgbench_history", "ticks")
