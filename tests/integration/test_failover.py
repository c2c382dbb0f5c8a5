"""Issue 41: a failover of the source. A worker given both hosts goes on by itself from the
promoted standby's synchronised copy of its failover slot, losing and doubling nothing; it never
replaces a slot that vanished, never follows another server, and refuses a promoted standby that
lacks changes the target already holds, changing nothing. PostgreSQL 15 sources: no failover
slot, and a clear message when one is asked for."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
from failover_rig import (
    FAILOVER_PG,
    SIDE_TABLES,
    TABLES,
    FailingSource,
    Pgbench,
    SideLoad,
    finish_prepared,
    worker_log_tail,
)
from psycopg.conninfo import conninfo_to_dict
from replication import (
    REPO,
    assert_same_rows,
    replicated_table,
    run_worker,
    slot_of_that_name_elsewhere,
    start_worker,
    stop_worker,
    wait_for,
    worker_env,
)

from applier.spark.snapshot import open_snapshot

pytestmark = pytest.mark.server
#: Failovers in the loop, there and back (odd: the first host listed ends as the standby). About
#: 4 s each on a 2-core machine, with the standby rebuilt and its copy of the slot synchronised.
FAILOVERS = 5
on_failover_versions = pytest.mark.parametrize("pg_pair", FAILOVER_PG, indirect=True,
                                               ids=[f"pg{v}" for v in FAILOVER_PG])


def _applier(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-m", "applier", *args], capture_output=True, text=True,
                      timeout=timeout, cwd=REPO, env=worker_env())


def _progress(target_db, slot: str = "s") -> tuple | None:
    found = target_db.query("SELECT commit_lsn::text, end_lsn::text FROM applier.progress "
                            "WHERE slot_name = %s", (slot,)) if _has_schema(target_db) else []
    return found[0] if found else None


def _has_schema(target_db) -> bool:
    return target_db.query("SELECT to_regclass('applier.progress') IS NOT NULL")[0][0]


def _count(db, table: str) -> int:
    try:
        return int(db.query(f"SELECT count(*) FROM {table}")[0][0])
    except Exception:
        return -1


def _caught_up(source: FailingSource) -> bool:
    """The slot has confirmed the primary's WAL position (the worker confirms only what the
    target holds, and an idle one confirms the server's position)."""
    with source.db().connect() as conn:
        row = conn.execute("SELECT confirmed_flush_lsn >= pg_current_wal_lsn() FROM "
                           "pg_replication_slots WHERE slot_name = 's'").fetchone()
    return bool(row and row[0])


def _target_state(target_db, *tables: str) -> tuple:
    return (tuple(sorted(map(repr, target_db.query(f"SELECT * FROM {t}"))) for t in tables),
            target_db.query("SELECT * FROM applier.progress"),
            target_db.query("SELECT slot_name, system_identifier, timeline FROM applier.source_identity"))


# -- the running worker never replaces a slot, never follows another server ----------------------

def test_a_vanished_slot_is_never_replaced_by_a_running_worker(source_db, target_db, tmp_path: Path) -> None:
    """It used to create a new slot at the source's current position and go on, skipping every
    change in between. Now it stops, saying so, and creates nothing."""
    replicated_table(source_db, target_db, with_slot=False)
    log = tmp_path / "worker.log"
    proc = start_worker(source_db, target_db, "--create-slot", log_path=log)
    try:
        wait_for(lambda: _slot_active(source_db), what="the worker to create its slot and stream")
        source_db.execute("INSERT INTO t SELECT generate_series(1, 10)")
        wait_for(lambda: _count(target_db, "t") == 10, what="the first rows applied")
        # The slot goes (dropped by hand, or lost in a failover) while the worker runs.
        wait_for(lambda: _drop_slot(source_db), timeout=60, what="the slot dropped")
        source_db.execute("INSERT INTO t SELECT generate_series(11, 20)")  # skipped by a new slot
        assert proc.wait(timeout=120) == 1, worker_log_tail(log)
    finally:
        stop_worker(proc)
    text = log.read_text()
    assert "replication slot 's' does not exist on the source server" in text
    assert "none is created (not even with --create-slot)" in text
    assert source_db.query("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 's'") == [(0,)]
    again = run_worker(source_db, target_db, "--create-slot", expect_rc=1, timeout=60)
    assert "none is created" in again.stderr
    assert source_db.query("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 's'") == [(0,)]


def _slot_active(db) -> bool:
    return db.query("SELECT active FROM pg_replication_slots WHERE slot_name = 's'") == [(True,)]


def _drop_slot(source_db) -> bool:
    source_db.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                      "WHERE slot_name = 's' AND active_pid IS NOT NULL")
    try:
        source_db.execute("SELECT pg_drop_replication_slot('s')")
    except Exception:
        return False
    return True


def test_another_server_with_a_slot_of_that_name_is_refused(pg_pair, source_db, target_db) -> None:
    """A slot of the same name on another server (another system identifier) is not the slot the
    target's progress came from: refused, the target untouched, the other slot not consumed."""
    replicated_table(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT generate_series(1, 5)")
    run_worker(source_db, target_db)
    with slot_of_that_name_elsewhere(pg_pair, target_db) as other:
        other.execute("INSERT INTO t SELECT generate_series(100, 105)")
        before = _target_state(target_db, "t")
        slot_before = other.query("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 's'")
        refused = run_worker(other, target_db, expect_rc=1, timeout=60)
        assert "is not the one the target's progress for slot 's' came from" in refused.stderr
        assert "Nothing was applied" in refused.stderr
        assert _target_state(target_db, "t") == before
        assert other.query("SELECT confirmed_flush_lsn FROM pg_replication_slots "
                           "WHERE slot_name = 's'") == slot_before


# -- failover slots where the source has them, a clear message where it has not ------------------

def test_a_new_slot_is_a_failover_slot_where_the_source_supports_it(pg_pair, source_db, target_db) -> None:
    replicated_table(source_db, target_db, with_slot=False)
    if pg_pair.version < 17:
        asked = run_worker(source_db, target_db, "--create-slot", "--failover-slot", expect_rc=2)
        assert "--failover-slot needs PostgreSQL 17 or later" in asked.stderr
        assert "runs PostgreSQL 15" in asked.stderr
        # A usage error, found before anything was created.
        assert source_db.query("SELECT count(*) FROM pg_replication_slots") == [(0,)]
        assert not _has_schema(target_db)
    run_worker(source_db, target_db, "--create-slot")
    source_db.execute("INSERT INTO t VALUES (1)")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t")
    failover = source_db.query("SELECT to_jsonb(s) ->> 'failover' FROM pg_replication_slots s "
                               "WHERE slot_name = 's'")
    assert failover == [("true",)] if pg_pair.version >= 17 else [(None,)]
    status = _applier("status", "--source", source_db.dsn, "--target", target_db.dsn, "--slot", "s")
    assert status.returncode == 0, status.stderr
    expected = "yes" if pg_pair.version >= 17 else r"not supported by the source \(PostgreSQL 17\+\)"
    assert re.search(f"failover slot +{expected}", status.stdout), status.stdout
    if pg_pair.version >= 17:
        run_worker(source_db, target_db, "--create-slot", "--no-failover-slot", slot="plain")
        assert source_db.query("SELECT failover FROM pg_replication_slots WHERE slot_name = 'plain'") == [(False,)]


# -- a source that fails over ----------------------------------------------------------------------

@on_failover_versions
def test_failovers_at_random_moments_lose_and_double_nothing(pg_pair, target_db, tmp_path: Path) -> None:
    """A primary and its standby (synchronized_standby_slots naming it) under pgbench and a load
    of streamed and prepared transactions; ``applier sync`` given both hosts. The standby is
    promoted and the old primary stopped -m immediate at random moments, the old primary then
    rebuilt as the new standby, and back: the worker goes on by itself each time, and at the end
    the target equals the new primary row by row."""
    source = FailingSource(pg_pair.version)
    pgbench = Pgbench(source)
    side = SideLoad(source.dsn(), seed=41)
    log = tmp_path / "worker.log"
    proc = None
    chooser = random.Random(4141)
    try:
        pgbench.initialise()
        source.db().execute(SIDE_TABLES)
        source.db().execute("CREATE PUBLICATION pub FOR ALL TABLES")
        proc = forked.Popen([sys.executable, "-m", "applier", "sync", "--source", source.url(),
                             "--target", target_db.dsn, "--slot", "s", "--publication", "pub",
                             "--two-phase", "--create-tables", "--log-level", "INFO"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=REPO,
                            env=worker_env())
        pgbench.ensure_running()
        side.start()
        wait_for(lambda: _count(target_db, "bulk") > 0, timeout=120, what="the copy and streaming")
        source.wait_synced()
        for round_ in range(FAILOVERS):
            seen = _count(target_db, "side")
            wait_for(lambda: _count(target_db, "side") > seen, timeout=120,
                     what=f"progress before failover {round_ + 1}")
            time.sleep(chooser.uniform(0.0, 1.5))  # anywhere: mid-batch, mid-stream, idle
            source.fail_over()
            assert proc.poll() is None, worker_log_tail(log)
            pgbench.ensure_running()
            seen = _count(target_db, "side")
            wait_for(lambda: _count(target_db, "side") > seen, timeout=120,
                     what=f"progress after failover {round_ + 1}")
            pgbench.ensure_running()
            source.remake_standby()
            source.wait_synced()
    finally:
        side.stop()
        pgbench.stop()
    try:
        with source.db().connect() as conn:
            finish_prepared(conn, SideLoad.GID, side.rollback)
        wait_for(lambda: _caught_up(source), timeout=300, what="the worker to catch up")
        assert proc.poll() is None, worker_log_tail(log)
        assert_same_rows(source.db(), target_db, *TABLES)
        assert target_db.query("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'applier%'") == [(0,)]
        assert side.committed > 50 and side.reconnects >= 3
        assert stop_worker(proc, timeout=60) == 0, worker_log_tail(log)
        _every_command_reaches_the_primary(source, target_db)
    finally:
        if proc is not None:
            stop_worker(proc, timeout=60)
        source.cleanup()
    text = log.read_text()
    assert text.count("the source failed over since the last session") == FAILOVERS, text[-6000:]
    assert "created failover slot 's'" in text and "Traceback" not in text


def _every_command_reaches_the_primary(source: FailingSource, target_db) -> None:
    """The first host listed is the standby now: status, verify and peek still read the primary."""
    assert source.first is source.standby
    status = _applier("status", "--source", source.dsn(), "--target", target_db.dsn, "--slot", "s",
                      "--standby", source.standby.dsn(source.dbname))
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(r"failover slot +yes", status.stdout), status.stdout
    assert re.search(rf"standby 127.0.0.1:{source.standby.port} +ready: copy synchronised", status.stdout)
    # A snapshot Spark's partitions import names the one server that exported it.
    with open_snapshot(source.dsn()) as snapshot:
        assert conninfo_to_dict(snapshot.dsn)["port"] == str(source.primary.port)
    verify = _applier("verify", "--source", source.url(), "--target", target_db.dsn, "--publication",
                      "pub", "--settle", "30")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    source.db().execute("INSERT INTO side VALUES (-1, 0, 'peeked')")
    peek = _applier("peek", "--source", source.dsn(), "--slot", "s", "--publication", "pub",
                    "--limit", "3")
    assert peek.returncode == 0 and "peeked" in peek.stdout, peek.stdout + peek.stderr


@on_failover_versions
def test_a_standby_that_lacks_what_the_target_holds_is_refused(pg_pair, target_db, tmp_path: Path) -> None:
    """Without synchronized_standby_slots, and with the standby stopped while the worker applied
    more, the promoted standby never had the last transactions the target holds: the worker,
    given both hosts, refuses it, naming the positions, and changes nothing on the target."""
    source = FailingSource(pg_pair.version, protected=False)
    log = tmp_path / "worker.log"
    proc = None
    try:
        db = source.db()
        replicated_table(db, target_db, with_slot=False)
        proc = start_worker(_Dsn(source.url()), target_db, "--create-slot", log_path=log)
        wait_for(lambda: _slot_active(db), what="the worker to create its slot and stream")
        db.execute("INSERT INTO t SELECT generate_series(1, 10)")
        wait_for(lambda: _count(target_db, "t") == 10, what="the first rows applied")
        source.wait_synced()
        # status warns: failover slots, and no synchronized_standby_slots naming the standby.
        status = _applier("status", "--source", source.dsn(), "--target", target_db.dsn, "--slot",
                          "s", "--standby", source.standby.dsn(source.dbname))
        assert status.returncode == 3, status.stdout + status.stderr
        assert "synchronized_standby_slots is empty" in status.stdout
        assert "does not name 'standby_" in status.stdout
        source.standby.stop("fast")
        for n in range(11, 31):
            db.execute("INSERT INTO t VALUES (%s)", (n,))
        wait_for(lambda: _count(target_db, "t") == 30, what="the rows the standby lacks applied")
        wait_for(lambda: _caught_up(source), what="the worker to confirm them")
        before = _target_state(target_db, "t")
        source.primary.stop("immediate")
        source.standby.start()
        source.standby.promote()
        assert proc.wait(timeout=180) == 1, worker_log_tail(log)
        assert _target_state(target_db, "t") == before
        text = log.read_text()
        assert "left timeline 1 at" in text and "never had" in text and "Nothing was applied" in text
        assert f"up to {before[1][0][2]}" in text  # the target's position, named
        again = run_worker(_Dsn(source.url()), target_db, expect_rc=1, timeout=60)
        assert "never had" in again.stderr
        assert _target_state(target_db, "t") == before
    finally:
        if proc is not None:
            stop_worker(proc)
        source.cleanup()


class _Dsn:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
