"""The test rig itself: real servers of the right version and settings, isolated
scratch databases, teardown that copes with replication slots, restarts."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import psycopg
import pytest

from applier.embedded import ClusterError, LocalCluster, selected_backend, start_server

pytestmark = pytest.mark.server


def _setting(db, name: str) -> str:
    return db.query("SELECT current_setting(%s)", (name,))[0][0]


def test_version_is_the_parametrized_one(pg_pair, source_db, target_db) -> None:
    for db in (source_db, target_db):
        num = int(db.query("SHOW server_version_num")[0][0])
        assert num // 10000 == pg_pair.version == db.version == db.cluster.version


def test_replication_settings(source_db, target_db) -> None:
    for db in (source_db, target_db):
        _assert_replication_settings(db)


def _assert_replication_settings(db) -> None:
    assert _setting(db, "wal_level") == "logical"
    assert int(_setting(db, "max_prepared_transactions")) > 0
    assert _setting(db, "logical_decoding_work_mem") == "64kB"
    assert _setting(db, "track_commit_timestamp") == "on"
    assert int(_setting(db, "max_replication_slots")) >= 20
    assert int(_setting(db, "max_wal_senders")) >= 20


def test_server_does_not_run_as_root(source_db, target_db) -> None:
    for db in (source_db, target_db):
        assert db.query("SELECT current_user")[0][0] == "postgres"
        if isinstance(db.cluster, LocalCluster):  # a container's processes are not ours to see
            with db.connect() as conn:  # the backend exits with its connection
                pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
                assert os.stat(f"/proc/{pid}").st_uid != 0


def test_fresh_databases_are_isolated(pg_pair, source_db, target_db) -> None:
    assert source_db.name != target_db.name
    assert source_db.dsn != target_db.dsn
    assert source_db.query("SELECT current_database()") == [(source_db.name,)]
    source_db.execute("CREATE TABLE only_here (id int PRIMARY KEY)")
    assert target_db.query("SELECT to_regclass('only_here')") == [(None,)]
    other = pg_pair.source.create_database(f"iso_{uuid.uuid4().hex[:8]}")
    try:
        assert other.query("SELECT to_regclass('only_here')") == [(None,)]
        assert source_db.query("SELECT to_regclass('only_here')::text") == [("only_here",)]
    finally:
        pg_pair.source.drop_database(other.name)


def test_odd_database_names_are_quoted(pg_pair) -> None:
    name = f'We"ird Name {uuid.uuid4().hex[:6]}'
    db = pg_pair.target.create_database(name)
    try:
        assert db.query("SELECT current_database()") == [(name,)]
    finally:
        pg_pair.target.drop_database(name)
    assert pg_pair.target.drop_database(name) is None  # dropping twice is fine


def _wait_active(db, slot: str, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = db.query("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        if rows and rows[0][0] is not None:
            return int(rows[0][0])
        time.sleep(0.05)
    raise AssertionError(f"slot {slot} never became active")


def test_database_with_active_slot_and_prepared_xact_can_be_dropped(pg_pair) -> None:
    cluster = pg_pair.source
    db = cluster.create_database(f"slotted_{uuid.uuid4().hex[:8]}")
    db.execute("SELECT pg_create_logical_replication_slot('busy', 'pgoutput')")
    db.execute("SELECT pg_create_logical_replication_slot('idle', 'test_decoding')")
    with db.connect(autocommit=False) as conn:
        conn.execute("CREATE TABLE t (id int)")
        conn.execute("PREPARE TRANSACTION 'left_behind'")
    receiver = subprocess.Popen(
        [str(cluster.bin_dir / "pg_recvlogical"), "--dbname", db.dsn, "--slot", "busy",
         "--start", "--no-loop", "-o", "proto_version=1", "-o", "publication_names=none",
         "-f", os.devnull],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_active(db, "busy")
        cluster.drop_database(db.name)
        admin = cluster.database("postgres")
        assert admin.query("SELECT count(*) FROM pg_database WHERE datname = %s", (db.name,)) == [(0,)]
        assert admin.query("SELECT count(*) FROM pg_replication_slots WHERE database = %s",
                           (db.name,)) == [(0,)]
        assert admin.query("SELECT count(*) FROM pg_prepared_xacts WHERE database = %s",
                           (db.name,)) == [(0,)]
        assert receiver.wait(timeout=30) != 0  # its walsender was terminated
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


def test_slot_left_in_fixture_database_is_dropped_at_teardown(source_db) -> None:
    # Nothing to assert here: the fixture's teardown must drop the database anyway.
    source_db.execute("SELECT pg_create_logical_replication_slot('leftover', 'pgoutput')")
    with source_db.connect(autocommit=False) as conn:
        conn.execute("CREATE TABLE t (id int)")
        conn.execute("PREPARE TRANSACTION 'leftover_gid'")


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_restart_keeps_port_and_data(target_db, mode: str) -> None:
    cluster = target_db.cluster
    target_db.execute("CREATE TABLE kept (id int)")
    target_db.execute("INSERT INTO kept VALUES (1), (2)")
    port = cluster.port
    cluster.restart(mode)
    assert cluster.port == port
    assert target_db.query("SELECT count(*) FROM kept") == [(2,)]


def test_stopped_server_refuses_then_starts_again(target_db) -> None:
    cluster = target_db.cluster
    cluster.stop("fast")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(target_db.dsn, connect_timeout=2).close()
    cluster.start()
    assert target_db.query("SELECT 1") == [(1,)]


def test_client_programs_exist(pg_pair) -> None:
    for path in (pg_pair.source.pgbench_path, pg_pair.source.psql_path):
        assert os.access(path, os.X_OK), path
    out = subprocess.run([str(pg_pair.source.psql_path), "-X", "-At", "-c", "SELECT 42",
                          pg_pair.source.dsn()], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "42"


def test_a_cluster_asked_for_a_unix_socket_is_reached_through_it(pg_pair) -> None:
    if selected_backend() == "docker":  # a container's socket is not on this machine
        with pytest.raises(ValueError, match="binaries backend"):
            start_server(pg_pair.version, unix_socket=True)
        return
    cluster = start_server(pg_pair.version, name="rig-socket", unix_socket=True)
    try:
        assert isinstance(cluster, LocalCluster)
        with psycopg.connect(cluster.socket_dsn()) as conn:
            # No server address: the session came through the Unix-domain socket, not TCP.
            assert conn.execute("SELECT inet_server_addr() IS NULL").fetchone() == (True,)
        with psycopg.connect(cluster.dsn()) as conn:
            assert conn.execute("SELECT inet_server_addr()::text").fetchone() == ("127.0.0.1/32",)
    finally:
        cluster.cleanup()
    assert isinstance(pg_pair.source, LocalCluster)
    with pytest.raises(ClusterError, match="TCP only"):  # the fixtures' servers: TCP only
        pg_pair.source.socket_dsn()

