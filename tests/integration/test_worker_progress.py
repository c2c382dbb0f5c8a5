"""Progress bookkeeping: concurrent schema upgrades, the worker's check of the schema without
SQLAlchemy, idle slots never holding WAL back, and authentication failures as clear permanent
errors."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import forked
import pytest
from alembic import command
from alembic.config import Config
from replication import (
    REPO,
    create_slot,
    replicated_table,
    start_worker,
    stop_worker,
    wait_for,
    worker_command,
)

from applier.apply.target import TargetSession
from applier.apply.transaction import TargetTransaction
from applier.errors import Cause, TargetError
from applier.progress.lock import WorkerLock
from applier.progress.postgres import PostgresApplyStore
from applier.progress.records import AppliedPosition
from applier.progress.schema import MIGRATIONS_DIR, SCHEMA_HEAD, ensure_schema, make_engine, upgrade_schema
from applier.protocol.lsn import LSN

pytestmark = pytest.mark.server


def test_two_workers_starting_at_once_upgrade_the_schema_once(target_db) -> None:
    errors: list[BaseException] = []

    def upgrade() -> None:
        try:
            upgrade_schema(make_engine(target_db.dsn))
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=upgrade) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert target_db.query("SELECT count(*) FROM applier.alembic_version") == [(1,)]
    assert target_db.query("SELECT version_num FROM applier.alembic_version") == [(SCHEMA_HEAD,)]


def test_a_current_schema_is_left_as_it_is_and_an_older_one_upgraded(target_db) -> None:
    engine = make_engine(target_db.dsn)
    upgrade_schema(engine)
    # Current: nothing runs (a table the migrations would never touch survives as it is).
    target_db.execute("CREATE TABLE applier.marker (id int)")
    upgrade_schema(engine)
    assert target_db.query("SELECT to_regclass('applier.marker') IS NOT NULL") == [(True,)]
    # One revision behind (the newest migration undone by its own downgrade): it runs again.
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "-1")
    behind = target_db.query("SELECT version_num FROM applier.alembic_version")
    assert behind != [(SCHEMA_HEAD,)]
    upgrade_schema(engine)
    assert target_db.query("SELECT version_num FROM applier.alembic_version") == [(SCHEMA_HEAD,)]
    assert target_db.query("SELECT to_regclass('applier.marker') IS NOT NULL") == [(True,)]


_ENSURE = """
import sys
from applier.progress.schema import ensure_schema
ensure_schema(sys.argv[1])
print(sorted({name.split(".")[0] for name in sys.modules} & {"sqlalchemy", "alembic"}))
"""


def _ensure_in_a_new_process(dsn: str) -> list[str]:
    """``ensure_schema`` in a fresh interpreter; the SQLAlchemy and alembic packages it loaded."""
    done = subprocess.run([sys.executable, "-c", _ENSURE, dsn], capture_output=True, text=True,
                          timeout=120, cwd=REPO, check=True)
    return eval(done.stdout)  # a list of names, printed by the script above


def test_the_worker_start_creates_and_upgrades_the_schema_and_loads_alembic_only_then(target_db) -> None:
    """ensure_schema (the worker's start) reads the revision over psycopg: a fresh target and an
    older schema are brought to SCHEMA_HEAD through alembic; a current one costs one query, and
    neither SQLAlchemy nor alembic is loaded."""
    assert _ensure_in_a_new_process(target_db.dsn) == ["alembic", "sqlalchemy"]
    assert target_db.query("SELECT version_num FROM applier.alembic_version") == [(SCHEMA_HEAD,)]
    target_db.execute("CREATE TABLE applier.marker (id int)")
    assert _ensure_in_a_new_process(target_db.dsn) == []
    assert target_db.query("SELECT to_regclass('applier.marker') IS NOT NULL") == [(True,)]
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with make_engine(target_db.dsn).begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "-1")
    assert target_db.query("SELECT version_num FROM applier.alembic_version") != [(SCHEMA_HEAD,)]
    assert _ensure_in_a_new_process(target_db.dsn) == ["alembic", "sqlalchemy"]
    assert target_db.query("SELECT version_num FROM applier.alembic_version") == [(SCHEMA_HEAD,)]


def test_the_worker_start_reports_an_unreachable_target_as_upgrade_schema_did(target_db) -> None:
    dsn = target_db.dsn.replace("postgres@", "no_such_role@")
    with pytest.raises(TargetError) as checked:
        ensure_schema(dsn)
    with pytest.raises(TargetError) as upgraded:
        upgrade_schema(make_engine(dsn))
    assert str(checked.value) == str(upgraded.value)
    assert 'role "no_such_role" does not exist' in str(checked.value)
    assert checked.value.cause is upgraded.value.cause is Cause.NEEDS_OPERATOR
    assert checked.value.sqlstate == upgraded.value.sqlstate


def test_writes_to_unpublished_tables_do_not_hold_the_slot_back(source_db, target_db, tmp_path: Path) -> None:
    source_db.execute("CREATE TABLE published (id int PRIMARY KEY)")
    source_db.execute("CREATE TABLE busy_elsewhere (id int, pad text)")
    target_db.execute("CREATE TABLE published (id int PRIMARY KEY)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE published")
    create_slot(source_db)
    worker = start_worker(source_db, target_db, log_path=tmp_path / "w.log")
    try:
        source_db.execute("INSERT INTO busy_elsewhere SELECT g, repeat('x', 200) FROM generate_series(1, 20000) g")
        goal = source_db.query("SELECT pg_current_wal_lsn()::text")[0][0]
        wait_for(lambda: source_db.query("SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots "
                                         "WHERE slot_name = 's'", (goal,)) == [(True,)],
                 timeout=60, what="the slot to confirm past WAL of unpublished tables")
    finally:
        assert stop_worker(worker) == 0


def test_an_applied_position_reaches_the_slot_before_the_status_interval(source_db, target_db,
                                                                         tmp_path: Path) -> None:
    """A confirmed position that moved is reported promptly, not only every --status-interval:
    the slot's confirmed_flush_lsn (what frees WAL, what operators watch) follows the apply."""
    replicated_table(source_db, target_db)
    worker = start_worker(source_db, target_db, "--status-interval", "10", log_path=tmp_path / "w.log")
    try:
        for round_ in range(3):
            source_db.execute(f"INSERT INTO t VALUES ({round_})")
            goal = source_db.query("SELECT pg_current_wal_lsn()::text")[0][0]
            wait_for(lambda: target_db.query("SELECT count(*) FROM t") == [(round_ + 1,)],
                     timeout=30, what="the row on the target")
            wait_for(lambda: source_db.query(
                "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots "
                "WHERE slot_name = 's'", (goal,)) == [(True,)],
                timeout=7, what="the slot to confirm the applied position within the 10 s interval")
    finally:
        assert stop_worker(worker) == 0


def test_authentication_failure_is_permanent_and_named(source_db, target_db) -> None:
    source_db.execute("CREATE PUBLICATION pub FOR ALL TABLES")
    create_slot(source_db)
    command = worker_command(source_db, target_db, "--exit-when-caught-up")
    command[command.index("--source") + 1] = source_db.dsn.replace("postgres@", "no_such_role@")
    proc = forked.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    assert 'role "no_such_role" does not exist' in proc.stderr
    assert "reconnecting" not in proc.stderr  # permanent: no retry loop


def test_make_durable_makes_asynchronous_commits_durable_at_once(target_db) -> None:
    """What the worker does when the stream pauses after commits made with synchronous_commit
    off: the progress row written again, unchanged, in a durable transaction, after which the
    target's WAL is on disk past those commits. The WAL writer is told to wait 10 s here, so it
    is not what flushed it."""
    upgrade_schema(make_engine(target_db.dsn))
    with target_db.connect() as admin:
        admin.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        admin.execute("SELECT pg_reload_conf()")
    session = TargetSession(target_db.dsn, "test flush_wal", synchronous_commit="off")
    tx = TargetTransaction(session, PostgresApplyStore(session, "s"), AppliedPosition(LSN(0), LSN(0)),
                           lambda end_lsn, target_lsn: None)
    try:
        assert not tx.make_durable()  # no progress row: nothing to write, nothing flushed
        session.sql("BEGIN")
        session.sql("CREATE TABLE public.flushed (id int)")
        session.sql("INSERT INTO public.flushed SELECT generate_series(1, 10)")
        session.sql("INSERT INTO applier.progress (slot_name, commit_lsn, end_lsn, applied_at) "
                    "VALUES ('s', '0/10', '0/20', '2026-01-01')")
        session.sql("COMMIT")
        committed = LSN.parse(session.sql("SELECT pg_catalog.pg_current_wal_insert_lsn()").get_value(0, 0).decode())
        assert session.flushed_wal_lsn() < committed
        assert tx.make_durable()
        assert session.flushed_wal_lsn() >= committed
        assert target_db.query("SELECT commit_lsn::text, end_lsn::text, applied_at::date::text "
                               "FROM applier.progress") == [("0/10", "0/20", "2026-01-01")]
    finally:
        session.close()
        with target_db.connect() as admin:
            admin.execute("ALTER SYSTEM RESET wal_writer_delay")
            admin.execute("SELECT pg_reload_conf()")


def test_a_batch_at_a_pause_is_visible_first_then_made_durable_once_the_stream_is_quiet(
        source_db, target_db, tmp_path: Path) -> None:
    """A batch committed because the stream paused commits with synchronous_commit off, like any
    other, so its rows are visible without waiting for the target's WAL flush; once the stream has
    stayed quiet, one durable rewrite of the progress row (a transaction of its own, after the
    batch's) flushes it, and only then is the slot told. The WAL writer is told to wait 10 s here,
    so it is not what flushed it."""
    replicated_table(source_db, target_db)
    with target_db.connect() as admin:
        admin.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        admin.execute("SELECT pg_reload_conf()")
    worker = start_worker(source_db, target_db, log_path=tmp_path / "w.log")
    try:
        source_db.execute("INSERT INTO t VALUES (1)")
        goal = source_db.query("SELECT pg_current_wal_lsn()::text")[0][0]
        wait_for(lambda: source_db.query(
            "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots "
            "WHERE slot_name = 's'", (goal,)) == [(True,)],
            timeout=5, what="the slot to confirm the row, well before the WAL writer's 10 s")
        # The batch's transaction wrote the row and the progress row; the rewrite, a later
        # transaction, wrote the progress row again.
        row_xid, progress_xid = target_db.query(
            "SELECT (SELECT xmin::text::bigint FROM t WHERE id = 1), "
            "(SELECT xmin::text::bigint FROM applier.progress WHERE slot_name = 's')")[0]
        assert progress_xid > row_xid
    finally:
        assert stop_worker(worker) == 0
        with target_db.connect() as admin:
            admin.execute("ALTER SYSTEM RESET wal_writer_delay")
            admin.execute("SELECT pg_reload_conf()")


def test_a_released_worker_lock_is_free_at_once(target_db) -> None:
    """applier sync hands over to the worker in the same process right after releasing the lock
    for the slot: the release must not depend on the server noticing a closed connection."""
    for _ in range(20):
        lock = WorkerLock(target_db.dsn, "s")
        lock.acquire()
        lock.release()
    assert target_db.query("SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                           "WHERE l.locktype = 'advisory' AND d.datname = current_database()") == [(0,)]
