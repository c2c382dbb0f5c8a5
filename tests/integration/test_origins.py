"""Replication origins: our writes are tagged, a bidirectional pair of workers does not loop,
origins seen in the stream are tracked per name, --skip-origin, and running untagged."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import forked
import psycopg
import pytest
from conftest import drop_replication_origins
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from replication import (
    REPO,
    assert_same_rows,
    create_slot,
    rows,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
)

pytestmark = pytest.mark.server

TABLE = "CREATE TABLE t (id int PRIMARY KEY, v text, site text)"


def _origin(slot: str, db) -> str:
    """The origin a worker with this slot tags its writes to ``db`` with."""
    return f"applier_{slot}_{db.name}"


def _progress(db) -> list[tuple]:
    return db.query("SELECT slot_name, end_lsn::text FROM applier.progress ORDER BY 1")


@pytest.mark.parametrize("mechanism", ["skip-origin", "origin-none"])
def test_bidirectional_pair_does_not_loop(source_db, target_db, mechanism: str,
                                          tmp_path: Path) -> None:
    a, b = source_db, target_db  # on two servers: each replicates to the other
    for db, name in ((a, "pub_a"), (b, "pub_b")):
        db.execute(TABLE)
        db.execute(f"CREATE PUBLICATION {name} FOR TABLE t")
    create_slot(a, "ab")
    create_slot(b, "ba")
    if mechanism == "skip-origin":  # what PostgreSQL 15 needs; works on every version
        extra_ab = ("--skip-origin", _origin("ba", a))
        extra_ba = ("--skip-origin", _origin("ab", b))
    else:
        extra_ab = extra_ba = ("--origin", "none")
        if a.version < 16:
            refused = run_worker(a, b, *extra_ab, slot="ab", publication="pub_a", expect_rc=2)
            assert "origin filtering needs PostgreSQL 16 or later" in refused.stderr
            return
    log_ab, log_ba = tmp_path / "ab.log", tmp_path / "ba.log"
    ab = start_worker(a, b, *extra_ab, slot="ab", publication="pub_a", log_path=log_ab)
    ba = start_worker(b, a, *extra_ba, slot="ba", publication="pub_b", log_path=log_ba)
    try:
        a.execute("INSERT INTO t SELECT g, 'new', 'A' FROM generate_series(1, 20) g")
        b.execute("INSERT INTO t SELECT g, 'new', 'B' FROM generate_series(101, 120) g")
        wait_for(lambda: len(rows(a, "t")) == 40 and rows(a, "t") == rows(b, "t"), timeout=90,
                 what="both sides to have every row")
        a.execute("UPDATE t SET v = 'changed on A' WHERE id = 101")
        b.execute("UPDATE t SET v = 'changed on B' WHERE id = 1")
        a.execute("DELETE FROM t WHERE id = 102")
        b.execute("DELETE FROM t WHERE id = 2")
        wait_for(lambda: len(rows(a, "t")) == 38 and rows(a, "t") == rows(b, "t"), timeout=90,
                 what="updates and deletes on both sides")
        # A loop would keep both workers busy forever: nothing may move any more.
        settled = (_progress(a), _progress(b))
        time.sleep(3)
        assert (_progress(a), _progress(b)) == settled
        assert proc_alive(ab, log_ab) and proc_alive(ba, log_ba)
    finally:
        assert stop_worker(ab) == 0, log_ab.read_text()[-3000:]
        assert stop_worker(ba) == 0, log_ba.read_text()[-3000:]
    assert_same_rows(a, b, "t")
    assert a.query("SELECT v FROM t WHERE id IN (1, 101) ORDER BY id") == [
        ("changed on B",), ("changed on A",)]
    for db in (a, b):
        # The only conflicts: each side updated a row the other side wrote, which the other
        # side's worker reports as update_origin_differs (PostgreSQL 16+, as PostgreSQL's own
        # subscriber does) and applies. Nothing came back around.
        expected = [("update_origin_differs", "applied")] if db.version >= 16 else []
        assert db.query("SELECT conflict_type, resolution FROM applier.conflicts") == expected
        assert db.query("SELECT count(*) FROM applier.origins") == [(0,)]
    if mechanism == "skip-origin":
        # The other worker's writes did arrive (tagged with its origin) and were dropped.
        for log in (log_ab, log_ba):
            assert "transaction(s) from skipped origins" in log.read_text()
    if a.version >= 16:
        # Each row's last writer on B is worker ab's origin, or B itself.
        writers = b.query("SELECT DISTINCT o.roname FROM t LEFT JOIN pg_replication_origin o "
                          "ON o.roident = (pg_xact_commit_timestamp_origin(t.xmin)).roident "
                          "ORDER BY 1")
        assert writers == [(_origin("ab", b),), (None,)]


def proc_alive(proc: subprocess.Popen, log: Path) -> bool:
    assert proc.poll() is None, log.read_text()[-3000:]
    return True


def test_origins_are_tracked_through_a_cascade(pg_pair, source_db, target_db) -> None:
    """A -> B -> C: C records, for origin 'worker A->B', the origin LSN of the last transaction
    applied from it, which is the A end LSN that worker recorded on B."""
    a, b = source_db, target_db
    c = pg_pair.source.create_database(f"cascade_c_{uuid.uuid4().hex[:8]}")
    try:
        for db in (a, b, c):
            db.execute(TABLE)
        a.execute("CREATE PUBLICATION pub FOR TABLE t")
        b.execute("CREATE PUBLICATION pub FOR TABLE t")
        create_slot(a, "ab")
        create_slot(b, "bc")
        a.execute("INSERT INTO t VALUES (1, 'from A', 'A')")
        a.execute("INSERT INTO t VALUES (2, 'from A', 'A')")
        run_worker(a, b, slot="ab")
        b.execute("INSERT INTO t VALUES (3, 'from B', 'B')")  # a local write on B: no origin
        run_worker(b, c, slot="bc")
        assert rows(c, "t") == rows(b, "t") and len(rows(c, "t")) == 3

        a_end = b.query("SELECT end_lsn FROM applier.progress WHERE slot_name = 'ab'")[0][0]
        # (How many B transactions carried them depends on whether worker A->B batched A's two
        # transactions into one target transaction; the last origin LSN does not.)
        tracked = c.query("SELECT origin_name, origin_lsn FROM applier.origins "
                          "WHERE slot_name = 'bc'")
        assert tracked == [(_origin("ab", b), a_end)]
        # The target's own origin progress shows it too (pg_replication_origin_xact_setup).
        assert b.query("SELECT remote_lsn FROM pg_replication_origin_status s JOIN "
                       "pg_replication_origin o ON o.roident = s.local_id WHERE o.roname = %s",
                       (_origin("ab", b),)) == [(a_end,)]
        status = forked.run([sys.executable, "-m", "applier", "status", "--target", c.dsn,
                             "--slot", "bc", "--source", b.dsn, "--json"],
                            capture_output=True, text=True, cwd=REPO)
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert [(o["origin_name"], o["origin_lsn"]) for o in shown["origins"]] == [
            (_origin("ab", b), str(a_end))]
        text = forked.run([sys.executable, "-m", "applier", "status", "--target", c.dsn,
                           "--slot", "bc", "--source", b.dsn], capture_output=True, text=True,
                          cwd=REPO).stdout
        assert f"'{_origin('ab', b)}': origin LSN {a_end}" in text

        # --skip-origin drops everything that came from A through B; B's own writes still pass.
        a.execute("INSERT INTO t VALUES (4, 'from A', 'A')")
        b.execute("INSERT INTO t VALUES (5, 'from B', 'B')")
        run_worker(a, b, slot="ab")
        run_worker(b, c, "--skip-origin", _origin("ab", b), slot="bc")
        assert [r[0] for r in c.query("SELECT id FROM t ORDER BY id")] == [1, 2, 3, 5]
    finally:
        pg_pair.source.drop_database(c.name)
        drop_replication_origins(pg_pair.source, c.name)


def test_untagged_when_the_role_may_not_use_origins(source_db, target_db) -> None:
    role = f"applier_np_{uuid.uuid4().hex[:8]}"
    target_db.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    try:
        target_db.execute(f"GRANT CREATE ON DATABASE \"{target_db.name}\" TO {role}")
        target_db.execute(f"GRANT SET ON PARAMETER session_replication_role TO {role}")
        target_db.execute(TABLE)
        target_db.execute(f"ALTER TABLE t OWNER TO {role}")
        source_db.execute(TABLE)
        source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
        create_slot(source_db)
        source_db.execute("INSERT INTO t VALUES (1, 'x', 'A')")
        params = conninfo_to_dict(target_db.dsn)
        params.update(user=role, password="pw")

        class Target:  # target_db as that role
            dsn = make_conninfo(**params)
            name = target_db.name

        done = run_worker(source_db, Target)
        assert done.stderr.count("may not use replication origins") == 1
        assert_same_rows(source_db, target_db, "t")
        assert target_db.query("SELECT count(*) FROM pg_replication_origin WHERE roname = %s",
                               (_origin("s", target_db),)) == [(0,)]
    finally:
        with psycopg.connect(target_db.dsn, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"REVOKE SET ON PARAMETER session_replication_role FROM {role}")
            conn.execute(f"DROP ROLE {role}")
