"""``applier verify`` on a live replica (issue 40): under a pgbench load with the worker running,
each run compares both sides at one source position the worker holds at, so a single row changed
on the target is found in every run, and nothing else ever differs."""

from __future__ import annotations

import pytest
from live import pgbench_load, pgbench_replica, verify, wait_streaming
from replication import start_worker, stop_worker

from applier.exit_codes import ExitCode

pytestmark = pytest.mark.server

#: Runs under the load (a run takes about a second and a half at pgbench scale 1).
RUNS = 20


@pytest.mark.slow
def test_verify_under_load_is_exact(pg_pair, source_db, target_db, tmp_path) -> None:
    pgbench_replica(pg_pair, source_db, target_db)
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, log_path=log)
    try:
        wait_streaming(source_db, target_db)
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
