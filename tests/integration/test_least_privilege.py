"""The worker runs with the least-privilege roles README.md documents (PostgreSQL 15 and 18):
a REPLICATION role on the source, a DML-only role plus the bookkeeping schema on the target."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator

import forked
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from replication import REPO, assert_same_rows, run_worker

pytestmark = pytest.mark.server

SCHEMA = ("CREATE TABLE t (id int PRIMARY KEY, v text);"
          "CREATE TABLE u (a int, b text); ALTER TABLE u REPLICA IDENTITY FULL")


def as_role(dsn: str, role: str) -> str:
    params = conninfo_to_dict(dsn)
    params["user"] = role
    return make_conninfo(**params)


class RoleDb:
    """A database reached as another role (same server, same database)."""

    def __init__(self, db, role: str) -> None:
        self.db, self.dsn = db, as_role(db.dsn, role)

    def __getattr__(self, name: str):
        return getattr(self.db, name)


@pytest.fixture
def roles(source_db, target_db) -> Iterator[tuple[str, str]]:
    suffix = uuid.uuid4().hex[:8]
    replicator, writer = f"replicator_{suffix}", f"writer_{suffix}"
    # Source: may replicate and read the published tables, nothing else.
    source_db.execute(f'CREATE ROLE "{replicator}" LOGIN REPLICATION')
    # Target: owns the bookkeeping schema; may only change rows of the replicated tables.
    target_db.execute(f'CREATE ROLE "{writer}" LOGIN')
    yield replicator, writer
    for db, role in ((source_db, replicator), (target_db, writer)):
        db.execute(f'DROP OWNED BY "{role}"')
        db.execute(f'DROP ROLE "{role}"')


def test_worker_with_least_privilege_roles(source_db, target_db, roles) -> None:
    replicator, writer = roles
    source_db.execute(SCHEMA)
    target_db.execute(SCHEMA)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t, u")
    source_db.execute(f'GRANT SELECT ON t, u TO "{replicator}"')
    target_db.execute(f'CREATE SCHEMA applier AUTHORIZATION "{writer}"')
    target_db.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON t, u TO "{writer}"')
    target_db.execute(f'GRANT SET ON PARAMETER session_replication_role TO "{writer}"')
    assert not target_db.query("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (writer,))[0][0]

    source = RoleDb(source_db, replicator)
    target = RoleDb(target_db, writer)
    run_worker(source, target, "--create-slot")  # the replication role creates the slot too
    source_db.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 20) g")
    source_db.execute("UPDATE t SET v = 'changed' WHERE id <= 5")
    source_db.execute("DELETE FROM t WHERE id > 15")
    source_db.execute("INSERT INTO u VALUES (1, 'a'), (1, 'a'), (2, 'b')")
    source_db.execute("UPDATE u SET b = 'c' WHERE a = 2")
    source_db.execute("TRUNCATE t")
    source_db.execute("INSERT INTO t VALUES (100, 'after truncate')")
    run_worker(source, target)
    assert_same_rows(source_db, target_db, "t", "u")
    assert target_db.query("SELECT count(*) FROM applier.progress")[0][0] == 1


def test_missing_replica_grant_is_named(source_db, target_db, roles) -> None:
    replicator, writer = roles
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    target_db.execute(f'CREATE SCHEMA applier AUTHORIZATION "{writer}"')
    proc = run_worker(RoleDb(source_db, replicator), RoleDb(target_db, writer), "--create-slot",
                      expect_rc=1)
    assert "Traceback" not in proc.stderr
    assert (f'GRANT SET ON PARAMETER session_replication_role TO "{writer}"' in proc.stderr), proc.stderr


def test_sync_with_least_privilege_roles_keeps_indexes_it_does_not_own(source_db, target_db,
                                                                       roles) -> None:
    """applier sync as the DML-only target role: tables it does not own keep their indexes
    through the copy (dropping them needs ownership), and the copy and the stream still match."""
    replicator, writer = roles
    source_db.execute(SCHEMA)
    target_db.execute(SCHEMA)
    source_db.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 3000) g")
    source_db.execute("INSERT INTO u SELECT g % 7, 'b' || g FROM generate_series(1, 500) g")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t, u")
    source_db.execute(f'GRANT SELECT ON t, u TO "{replicator}"')
    target_db.execute(f'CREATE SCHEMA applier AUTHORIZATION "{writer}"')
    target_db.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON t, u TO "{writer}"')
    target_db.execute(f'GRANT SET ON PARAMETER session_replication_role TO "{writer}"')
    index_oid = "SELECT indexrelid FROM pg_index WHERE indrelid = 't'::regclass"
    before = target_db.query(index_oid)

    source, target = RoleDb(source_db, replicator), RoleDb(target_db, writer)
    proc = forked.run([sys.executable, "-m", "applier", "sync", "--source", source.dsn,
                       "--target", target.dsn, "--slot", "s", "--publication", "pub",
                       "--exit-when-caught-up"], capture_output=True, text=True, timeout=300,
                      cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert target_db.query(index_oid) == before  # the same index, never dropped and rebuilt
    assert_same_rows(source_db, target_db, "t", "u")
    source_db.execute("UPDATE t SET v = 'changed' WHERE id <= 10")
    source_db.execute("DELETE FROM u WHERE a = 3")
    run_worker(source, target)
    assert_same_rows(source_db, target_db, "t", "u")
