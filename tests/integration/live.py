"""Helpers for tests on a live replica (issue 40): a pgbench replica copied by applier sync, a
pgbench load on the source, and the worker's commands run in this process or as a child."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import forked
from replication import REPO, wait_for

from applier.cli import parse_settings
from applier.progress.lock import lock_holder
from applier.verify import run_verify

PGBENCH_TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history")


def pgbench_replica(pg_pair, source_db, target_db, *, extra_tables: tuple[str, ...] = ()) -> None:
    """pgbench's tables (scale 1, and a row in pgbench_history) and ``extra_tables`` (made on
    both sides already) published and copied by applier sync, so the target's rows are the
    worker's own."""
    pgbench = str(pg_pair.source.pgbench_path)
    subprocess.run([pgbench, "-i", "-s", "1", "-q", source_db.dsn], check=True, capture_output=True)
    subprocess.run([pgbench, "-i", "-I", "dtp", "-q", target_db.dsn], check=True, capture_output=True)
    source_db.execute("INSERT INTO pgbench_history VALUES (1, 1, 1, 0, '2024-01-01', 'before')")
    source_db.execute(f"CREATE PUBLICATION pub FOR TABLE {', '.join(PGBENCH_TABLES + extra_tables)}")
    forked.run([sys.executable, "-m", "applier", "sync", "--source", source_db.dsn, "--target",
                target_db.dsn, "--slot", "s", "--publication", "pub", "--exit-when-caught-up"],
               check=True, capture_output=True, cwd=REPO, timeout=300)


@contextlib.contextmanager
def pgbench_load(pg_pair, source_db, *args: str) -> Iterator[None]:
    """pgbench writing to the source until the block ends (2 clients, 200 tx/s; TPC-B unless
    ``args`` give a script)."""
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


def wait_streaming(source_db, target_db, slot: str = "s") -> None:
    """The worker holds its lock (a verify holds it from then on) and streams."""

    def running() -> bool:
        with target_db.connect() as conn:
            return lock_holder(conn, slot) is not None

    wait_for(running, what="the worker to start")
    wait_for(lambda: source_db.query("SELECT active FROM pg_replication_slots WHERE slot_name = %s",
                                     (slot,)) == [(True,)], what="the worker to stream")


def verify(source_db, target_db, *extra: str) -> tuple[int, dict]:
    """``applier verify --json`` in this process: exit status and report."""
    settings = parse_settings(["verify", "--source", source_db.dsn, "--target", target_db.dsn,
                               "--publication", "pub", "--json", *extra], {})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run_verify(settings)
    return rc, json.loads(out.getvalue()) if out.getvalue() else {}


def applier(*arguments: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-m", "applier", *arguments], capture_output=True,
                      text=True, timeout=timeout, cwd=REPO)


def servers(source_db, target_db) -> list[str]:
    return ["--source", source_db.dsn, "--target", target_db.dsn]


def script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "load.sql"
    path.write_text(text)
    return str(path)
