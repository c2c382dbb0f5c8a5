"""Operations of a running worker: metrics, /healthz and /readyz, ``applier status``, JSON logs
with slot/LSN/xid and masked passwords (PostgreSQL 15 and 18)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import forked
import pytest
from replication import REPO, create_slot, start_worker, stop_worker, wait_for

pytestmark = pytest.mark.server


def applier(*args: str) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-m", "applier", *args], capture_output=True, text=True,
                      timeout=120, cwd=REPO)


def status(source_db, target_db, *extra: str, slot: str = "s") -> tuple[int, dict]:
    proc = applier("status", "--source", source_db.dsn, "--target", target_db.dsn, "--slot", slot,
                   "--json", *extra)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sample(metrics: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text format, or None when absent."""
    for line in metrics.splitlines():
        match = re.match(r"^([a-zA-Z_:]+)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = {k: v.replace('\\"', '"') for k, v in
                 re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or "")}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


def metrics_url(log: Path) -> str:
    found: list[str] = []

    def announced() -> bool:
        found[:] = re.findall(r"metrics on http://[^:]+:(\d+)/metrics", log.read_text(errors="replace"))
        return bool(found)

    wait_for(announced, what="the metrics server to start")
    return f"http://127.0.0.1:{found[0]}"


def test_metrics_health_and_status(source_db, target_db, tmp_path: Path) -> None:
    ddl = "CREATE TABLE t (id int PRIMARY KEY, v text)"
    source_db.execute(ddl)
    target_db.execute(ddl)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db)
    spill = tmp_path / "spill"
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, "--metrics-port", "0", "--metrics-address",
                          "127.0.0.1", "--status-interval", "1", "--spill-dir", str(spill),
                          log_path=log)
    try:
        base = metrics_url(log)
        assert http_get(f"{base}/healthz") == (200, "ok\n")
        source_db.execute("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 50) g")
        source_db.execute("UPDATE t SET v = 'w' WHERE id <= 10")
        source_db.execute("DELETE FROM t WHERE id > 45")
        target_db.execute("INSERT INTO t VALUES (1000, 'only on the target')")
        source_db.execute("INSERT INTO t VALUES (1000, 'from the source')")  # insert_exists

        def applied_all() -> bool:
            return sample(http_get(f"{base}/metrics")[1], "applier_transactions_applied_total") == 4

        wait_for(applied_all, what="four transactions in the metrics")
        text = http_get(f"{base}/metrics")[1]
        assert sample(text, "applier_rows_applied_total", slot="s", type="insert") == 51
        assert sample(text, "applier_rows_applied_total", type="update") == 10
        assert sample(text, "applier_rows_applied_total", type="delete") == 5
        assert sample(text, "applier_conflicts_total", table="public.t", type="insert_exists") == 1, text
        assert sample(text, "applier_received_bytes_total") > 0
        assert sample(text, "applier_connected") == 1
        # The conflict made the fast path hand its batch back, redone in the same session.
        assert sample(text, "applier_reconnects_total") == 0
        assert sample(text, "applier_open_streamed_transactions") == 0
        assert sample(text, "applier_spilled_bytes") == 0

        def ready() -> bool:
            return http_get(f"{base}/readyz")[0] == 200

        wait_for(ready, what="/readyz")
        text = http_get(f"{base}/metrics")[1]
        assert sample(text, "applier_probe_ok") == 1
        assert sample(text, "applier_source_rtt_seconds") > 0
        assert sample(text, "applier_target_rtt_seconds") > 0
        assert sample(text, "applier_apply_lag_bytes") is not None

        rc, report = status(source_db, target_db, "--spill-dir", str(spill))
        assert rc == 0, report
        assert report["slot"]["active"] is True and report["slot"]["plugin"] == "pgoutput"
        assert report["progress"]["commit_lsn"] and report["progress"]["commit_time"]
        assert report["retained_wal_bytes"] >= 0
        assert report["spill_bytes"] == 0 and report["spill_dir"] == str(spill)
        assert report["prepared_transactions"] == [] and report["table_sync"] == []

        # A transaction the source streams (over its 64kB logical_decoding_work_mem) is applied
        # as it streams, and counted as such.
        assert sample(text, "applier_streamed_applied_early_total") == 0
        source_db.execute("INSERT INTO t SELECT g, repeat(md5(g::text), 3) "
                          "FROM generate_series(3000, 5999) g")
        wait_for(lambda: sample(http_get(f"{base}/metrics")[1],
                                "applier_streamed_applied_early_total") == 1,
                 what="the streamed transaction applied early in the metrics")
    finally:
        assert stop_worker(worker) == 0, log.read_text()[-3000:]

    # Stopped, with changes waiting: the lag shows, and --max-lag fails on it.
    source_db.execute("INSERT INTO t VALUES (2000, 'waiting')")
    rc, report = status(source_db, target_db, "--max-lag", "0")
    assert rc == 3 and report["lag_exceeded"] is True and report["lag"]["bytes"] > 0
    assert report["slot"]["active"] is False
    rc, _ = status(source_db, target_db, "--max-lag", "1GB")
    assert rc == 0
    table = applier("status", "--source", source_db.dsn, "--target", target_db.dsn, "--slot", "s")
    assert table.returncode == 0 and "apply lag" in table.stdout and "WAL retained" in table.stdout


def test_lag_of_a_fresh_replica_is_what_its_slot_has_to_deliver(source_db, target_db,
                                                                 tmp_path: Path) -> None:
    """WAL written before the slot existed is not the replica's to apply (issue 42): with
    --create-slot on an idle publication, no scrape shows it as lag."""
    ddl = "CREATE TABLE t (id int PRIMARY KEY, v text)"
    source_db.execute(ddl)
    target_db.execute(ddl)
    source_db.execute("CREATE TABLE unpublished (v text)")
    source_db.execute("INSERT INTO unpublished SELECT repeat('x', 200) FROM generate_series(1, 100000)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    log = tmp_path / "worker.log"
    # Probes every 10 s (the longest interval): what the first scrapes show comes from the
    # first probes.
    worker = start_worker(source_db, target_db, "--create-slot", "--metrics-port", "0",
                          "--metrics-address", "127.0.0.1", "--status-interval", "10",
                          log_path=log)
    try:
        base = metrics_url(log)
        seen: list[float | None] = []

        def streaming_lag_known() -> bool:
            seen.append(sample(http_get(f"{base}/metrics")[1], "applier_apply_lag_bytes"))
            return "streaming from" in log.read_text() and seen[-1] is not None

        wait_for(streaming_lag_known, what="a known lag while streaming")
        assert all(lag is None or lag < 1_000_000 for lag in seen), seen
    finally:
        assert stop_worker(worker) == 0, log.read_text()[-3000:]


def test_status_missing_slot_and_newer_bookkeeping(source_db, target_db) -> None:
    # Tables other versions of the schema add are reported when present.
    target_db.execute("CREATE SCHEMA applier")
    target_db.execute("CREATE TABLE applier.table_sync (slot_name text, table_name text, state text)")
    target_db.execute("INSERT INTO applier.table_sync VALUES ('s', 'public.t', 'ready'), "
                      "('other', 'public.u', 'copying')")
    target_db.execute("CREATE TABLE applier.conflicts (slot_name text, conflict_type text)")
    target_db.execute("INSERT INTO applier.conflicts VALUES ('s', 'update_missing'), "
                      "('s', 'update_missing'), ('s', 'insert_exists'), ('other', 'insert_exists')")
    target_db.execute("BEGIN; CREATE TABLE prepared_t (); PREPARE TRANSACTION 'applier_s_1'")
    try:
        rc, report = status(source_db, target_db, slot="nope")
        assert rc == 3 and report["slot"] is None
        assert any("does not exist" in note for note in report["notes"])
        rc, report = status(source_db, target_db, slot="s")
        assert report["table_sync"] == [{"slot_name": "s", "table_name": "public.t", "state": "ready"}]
        assert report["conflicts"] == {"insert_exists": 1, "update_missing": 2}
        assert report["skipped_transactions"] is None
        assert [p["gid"] for p in report["prepared_transactions"]] == ["applier_s_1"]
    finally:
        target_db.execute("ROLLBACK PREPARED 'applier_s_1'")


def test_status_names_the_server_it_cannot_read(source_db) -> None:
    proc = applier("status", "--source", source_db.dsn, "--target",
                   "postgresql://u:hunter2@127.0.0.1:1/x?connect_timeout=2", "--slot", "s")
    assert proc.returncode == 1
    assert "cannot read the target" in proc.stderr and "hunter2" not in proc.stderr


def test_json_logs_name_slot_lsn_xid_and_mask_passwords(source_db, target_db) -> None:
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db)
    source_db.execute("INSERT INTO t VALUES (1)")  # no table t on the target: a permanent error
    xid = int(source_db.query("SELECT xmin::text FROM t")[0][0])
    with_password = target_db.dsn.replace("postgres@", "postgres:hunter2@")
    proc = forked.run(
        [sys.executable, "-m", "applier", "run", "--source", source_db.dsn, "--target", with_password,
         "--slot", "s", "--publication", "pub", "--exit-when-caught-up", "--log-format", "json"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    assert "hunter2" not in proc.stderr
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    errors = [line for line in lines if line["level"] == "ERROR"]
    assert errors, proc.stderr
    assert errors[-1]["slot"] == "s" and errors[-1]["xid"] == xid and errors[-1]["lsn"]
    assert "****" in " ".join(line["message"] for line in lines)
