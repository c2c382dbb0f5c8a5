"""``applier verify`` on a live replica (issue 40): under a pgbench load with the worker running,
each run compares both sides at one source position the worker holds at, so a single row changed
on the target is found in every run, and nothing else ever differs."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from replication import REPO, start_worker, stop_worker, wait_for

from applier.cli import parse_settings
from applier.exit_codes import ExitCode
from applier.verify import run_verify

pytestmark = pytest.mark.server

#: Runs each way (the issue asks for 20; a run takes about a second at pgbench scale 1).
RUNS = 20


@contextlib.contextmanager
def pgbench_load(pg_pair, source_db, *args: str) -> Iterator[None]:
    """pgbench writing to the source until the block ends (TPC-B, 2 clients, 200 tx/s)."""
    pgbench = str(pg_pair.source.pgbench_path)
    load = subprocess.Popen([pgbench, "-n", "-c", "2", "-R", "200", "-T", "900", *args, source_db.dsn],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        seen = source_db.query("SELECT count(*) FROM pgbench_history")[0][0]
        wait_for(lambda: source_db.query("SELECT count(*) FROM pgbench_history")[0][0] > seen + 50,
                 what="the load to start")
        yield
    finally:
        # SIGTERM, not SIGINT: see test_sync (PostgreSQL 15's pgbench may ignore SIGINT).
        load.terminate()
        load.wait(timeout=60)


def pgbench_replica(pg_pair, source_db, target_db) -> None:
    """pgbench's tables (scale 1, and a row in pgbench_history) published and copied by applier
    sync, so the target's rows are the worker's own."""
    pgbench = str(pg_pair.source.pgbench_path)
    subprocess.run([pgbench, "-i", "-s", "1", "-q", source_db.dsn], check=True, capture_output=True)
    subprocess.run([pgbench, "-i", "-I", "dtp", "-q", target_db.dsn], check=True, capture_output=True)
    source_db.execute("INSERT INTO pgbench_history VALUES (1, 1, 1, 0, '2024-01-01', 'before')")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE pgbench_accounts, pgbench_branches, "
                      "pgbench_tellers, pgbench_history")
    subprocess.run([sys.executable, "-m", "applier", "sync", "--source", source_db.dsn, "--target",
                    target_db.dsn, "--slot", "s", "--publication", "pub", "--exit-when-caught-up"],
                   check=True, capture_output=True, cwd=REPO, timeout=300)


def wait_streaming(source_db, slot: str = "s") -> None:
    wait_for(lambda: source_db.query("SELECT active FROM pg_replication_slots WHERE slot_name = %s",
                                     (slot,)) == [(True,)], what="the worker to stream")


def verify(source_db, target_db, *extra: str) -> tuple[int, dict]:
    settings = parse_settings(["verify", "--source", source_db.dsn, "--target", target_db.dsn,
                               "--publication", "pub", "--json", *extra], {})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run_verify(settings)
    return rc, json.loads(out.getvalue()) if out.getvalue() else {}


def test_verify_under_load_is_exact(pg_pair, source_db, target_db, tmp_path) -> None:
    pgbench_replica(pg_pair, source_db, target_db)
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, log_path=log)
    try:
        wait_streaming(source_db)
        # pgbench_history only gets inserts: a row changed there stays changed.
        target_db.execute("UPDATE pgbench_history SET delta = 1 WHERE filler = 'before'")
        with pgbench_load(pg_pair, source_db):
            for _ in range(RUNS):
                rc, report = verify(source_db, target_db)
                tables = {t["table"]: t for t in report["tables"]}
                history = tables.pop("public.pgbench_history")
                assert rc == ExitCode.CHECK and report["exact"], report
                # Exactly that row differs (as one missing and one extra: the table has no key).
                assert (history["missing_count"], history["extra_count"]) == (1, 1), history
                assert all(t["equal"] for t in tables.values()), tables
    finally:
        assert stop_worker(worker) == 0, log.read_text()[-4000:]
    assert "holding for verify" in log.read_text()
