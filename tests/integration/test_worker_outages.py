"""Issue 23, item 3: every lost connection is retried, through whichever client library and at
whichever step (the stream, the apply session, the catalog reflection through SQLAlchemy, the
bookkeeping reads). Under a write load the target server is restarted (immediate shutdown, as a
crash) at random moments, and every connection of the worker to both servers is cut at random
moments by a proxy; the worker must survive all of it, and the replica must end equal to the
source row by row."""

from __future__ import annotations

import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from proxy import CuttingProxy, endpoint, through
from replication import assert_same_rows, run_worker, start_worker, stop_worker, wait_for
from test_worker_faults import TABLES, Workload, _bank

pytestmark = pytest.mark.server


def _history(target_db) -> int:
    try:
        return int(target_db.query("SELECT count(*) FROM history")[0][0])
    except Exception:
        return -1


@pytest.mark.slow
def test_target_restarted_at_random_moments_is_survived(source_db, target_db, tmp_path: Path) -> None:
    _bank(source_db, target_db)
    workload = Workload(source_db.dsn, seed=23)
    workload.start()
    chooser = random.Random(5)
    log = tmp_path / "worker.log"
    proc = start_worker(source_db, target_db, log_path=log)
    try:
        for _ in range(10):
            seen = _history(target_db)
            wait_for(lambda: _history(target_db) > seen, timeout=90, what="progress before a restart")
            time.sleep(chooser.uniform(0.0, 1.5))  # anywhere: mid-batch, mid-commit, idle
            target_db.cluster.restart("immediate")
            assert proc.poll() is None, log.read_text()[-4000:]
        seen = _history(target_db)
        wait_for(lambda: _history(target_db) > seen, timeout=90, what="progress after the restarts")
    finally:
        workload.stop()
        assert stop_worker(proc) == 0, log.read_text()[-4000:]
    assert workload.committed > 50
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, *TABLES)
    assert "reconnecting" in log.read_text()
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
def test_connections_cut_at_random_moments_are_survived(source_db, target_db, tmp_path: Path) -> None:
    _bank(source_db, target_db)
    source_proxy = CuttingProxy(*endpoint(source_db.dsn))
    target_proxy = CuttingProxy(*endpoint(target_db.dsn))
    source = SimpleNamespace(dsn=through(source_db.dsn, source_proxy))
    target = SimpleNamespace(dsn=through(target_db.dsn, target_proxy))
    workload = Workload(source_db.dsn, seed=29)
    workload.start()
    chooser = random.Random(9)
    log = tmp_path / "worker.log"
    proc = start_worker(source, target, log_path=log)
    try:
        for n in range(14):
            seen = _history(target_db)
            wait_for(lambda: _history(target_db) > seen, timeout=90, what="progress before a cut")
            time.sleep(chooser.uniform(0.0, 1.5))
            # Both sides, or one of them: the stream alone, the target sessions alone.
            for proxy in ((source_proxy, target_proxy), (source_proxy,), (target_proxy,))[n % 3]:
                proxy.cut()
            assert proc.poll() is None, log.read_text()[-4000:]
        seen = _history(target_db)
        wait_for(lambda: _history(target_db) > seen, timeout=90, what="progress after the cuts")
    finally:
        workload.stop()
        assert stop_worker(proc) == 0, log.read_text()[-4000:]
        source_proxy.close()
        target_proxy.close()
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, *TABLES)
    text = log.read_text()
    assert "reconnecting" in text and "Traceback" not in text
