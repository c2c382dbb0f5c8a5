"""Every conflict type under every policy, the conflict log, per-table policies, and skipping the
transaction an 'error' policy stopped at."""

from __future__ import annotations

import re
import sys

import forked
import pytest
from replication import REPO, create_slot, run_worker

pytestmark = pytest.mark.server

TABLE = "CREATE TABLE c (id int PRIMARY KEY, v text, n int)"

#: conflict type -> (statement on the target that sets it up, the source statement that meets it)
CASES = {
    "insert_exists": ("INSERT INTO c VALUES (1, 'local', 0)", "INSERT INTO c VALUES (1, 'remote', 1)"),
    "update_missing": ("DELETE FROM c WHERE id = 1", "UPDATE c SET v = 'remote' WHERE id = 1"),
    "delete_missing": ("DELETE FROM c WHERE id = 1", "DELETE FROM c WHERE id = 1"),
    "update_origin_differs": ("UPDATE c SET v = 'local' WHERE id = 1",
                              "UPDATE c SET v = 'remote' WHERE id = 1"),
}
#: (conflict type, policy) -> row 1 on the target afterwards (None: absent)
EXPECTED_ROW = {
    ("insert_exists", "apply"): "remote", ("insert_exists", "keep-local"): "local",
    ("update_missing", "apply"): None, ("update_missing", "keep-local"): None,
    ("delete_missing", "apply"): None, ("delete_missing", "keep-local"): None,
    ("update_origin_differs", "apply"): "remote", ("update_origin_differs", "keep-local"): "local",
}


def _setup(source_db, target_db, kind: str) -> None:
    source_db.execute(TABLE)
    target_db.execute(TABLE)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE c")
    create_slot(source_db)
    if kind != "insert_exists":
        source_db.execute("INSERT INTO c VALUES (1, 'original', 0)")
        run_worker(source_db, target_db)
    target_db.execute(CASES[kind][0])
    with source_db.connect() as conn, conn.transaction():
        conn.execute(CASES[kind][1])
        conn.execute("INSERT INTO c VALUES (100, 'same transaction', 0)")
    source_db.execute("INSERT INTO c VALUES (200, 'later', 0)")


def _row(target_db, id_: int) -> str | None:
    found = target_db.query("SELECT v FROM c WHERE id = %s", (id_,))
    return found[0][0] if found else None


def _logged(target_db) -> list[tuple]:
    return target_db.query(
        "SELECT conflict_type, resolution, table_schema || '.' || table_name, key, local_row, "
        "remote_row, source_xid IS NOT NULL, source_lsn IS NOT NULL, local_origin "
        "FROM applier.conflicts ORDER BY id")


def _detected(kind: str, version: int) -> bool:
    return kind != "update_origin_differs" or version >= 16


@pytest.mark.parametrize("policy", ["apply", "keep-local"])
@pytest.mark.parametrize("kind", list(CASES))
def test_conflict_resolved_by_policy(source_db, target_db, kind: str, policy: str) -> None:
    _setup(source_db, target_db, kind)
    run_worker(source_db, target_db, "--conflict-policy", policy)
    detected = _detected(kind, target_db.version)
    expected = EXPECTED_ROW[(kind, policy)] if detected else "remote"
    assert _row(target_db, 1) == expected
    assert _row(target_db, 100) == "same transaction" and _row(target_db, 200) == "later"
    logged = _logged(target_db)
    if not detected:
        # PostgreSQL 15 cannot tell which origin last wrote a row: the update simply applies.
        assert logged == []
        return
    resolution = {"insert_exists": {"apply": "applied", "keep-local": "kept-local"},
                  "update_origin_differs": {"apply": "applied", "keep-local": "kept-local"}}.get(
                      kind, {"apply": "skipped", "keep-local": "skipped"})[policy]
    assert len(logged) == 1, logged
    type_, resolved, table, key, local, remote, has_xid, has_lsn, local_origin = logged[0]
    assert (type_, resolved, table, key) == (kind, resolution, "public.c", {"id": 1})
    assert has_xid and has_lsn
    if kind == "insert_exists":
        assert local == {"id": 1, "v": "local", "n": 0}
        assert remote == {"id": 1, "v": "remote", "n": 1}
    elif kind == "update_origin_differs":
        assert local == {"id": 1, "v": "local", "n": 0}
        assert remote == {"id": 1, "v": "remote", "n": 0}
        assert local_origin == "local"
    elif kind == "update_missing":
        assert local is None and remote == {"id": 1, "v": "remote", "n": 0}
    else:
        assert local is None and remote == {"id": 1}


@pytest.mark.parametrize("kind", list(CASES))
def test_conflict_under_policy_error_stops_then_skip_resumes(source_db, target_db, kind: str) -> None:
    _setup(source_db, target_db, kind)
    if not _detected(kind, target_db.version):
        run_worker(source_db, target_db, "--conflict-policy", "error")
        assert _row(target_db, 1) == "remote" and _logged(target_db) == []
        return
    before = _row(target_db, 1)
    failed = run_worker(source_db, target_db, "--conflict-policy", "error", expect_rc=1)
    assert f"conflict {kind} on table \"public\".\"c\"" in failed.stderr
    match = re.search(r"applier skip --target <target DSN> --slot s --lsn ([0-9A-F]+/[0-9A-F]+)",
                      failed.stderr)
    assert match, failed.stderr
    lsn = match.group(1)
    assert f"commit LSN {lsn}" in failed.stderr
    # Nothing of the failing transaction (or later) is applied; the conflict is on record.
    assert _row(target_db, 1) == before and _row(target_db, 100) is None and _row(target_db, 200) is None
    assert [row[:3] for row in _logged(target_db)] == [(kind, "error", "public.c")]
    # It stops there again until the transaction is skipped.
    run_worker(source_db, target_db, "--conflict-policy", "error", expect_rc=1)

    skip = forked.run([sys.executable, "-m", "applier", "skip", "--target", target_db.dsn,
                       "--slot", "s", "--lsn", lsn], capture_output=True, text=True, cwd=REPO)
    assert skip.returncode == 0, skip.stderr
    assert f"finishing at {lsn} will be skipped" in skip.stdout
    run_worker(source_db, target_db, "--conflict-policy", "error")
    assert _row(target_db, 1) == before and _row(target_db, 100) is None
    assert _row(target_db, 200) == "later"
    assert target_db.query("SELECT finish_lsn = %s::pg_lsn, kind, changes, tables FROM "
                           "applier.skipped_transactions", (lsn,)) == [(True, "commit", 2, ["public.c"])]
    assert target_db.query("SELECT count(*) FROM applier.skip_requests") == [(0,)]


def test_per_table_policy_overrides_the_default(source_db, target_db) -> None:
    ddl = TABLE + "; CREATE TABLE \"Odd\" (id int PRIMARY KEY, v text)"
    source_db.execute(ddl)
    target_db.execute(ddl)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE c, \"Odd\"")
    create_slot(source_db)
    target_db.execute("INSERT INTO c VALUES (1, 'local', 0)")
    target_db.execute("INSERT INTO \"Odd\" VALUES (1, 'local')")
    source_db.execute("INSERT INTO c VALUES (1, 'remote', 1)")
    source_db.execute("INSERT INTO \"Odd\" VALUES (1, 'remote')")
    run_worker(source_db, target_db, "--conflict-policy", "error", "--conflict-policy",
               "public.c=keep-local", "--conflict-policy", 'public."Odd"=apply')
    assert _row(target_db, 1) == "local"
    assert target_db.query("SELECT v FROM \"Odd\"") == [("remote",)]
    assert sorted(row[:3] for row in _logged(target_db)) == [
        ("insert_exists", "applied", "public.Odd"), ("insert_exists", "kept-local", "public.c")]


def test_no_conflicts_from_the_workers_own_rows(source_db, target_db) -> None:
    """Rows the worker wrote itself (in earlier or the same transaction) are never conflicts."""
    source_db.execute(TABLE)
    target_db.execute(TABLE)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE c")
    create_slot(source_db)
    source_db.execute("INSERT INTO c SELECT g, 'a', 0 FROM generate_series(1, 50) g")
    run_worker(source_db, target_db, "--conflict-policy", "error")
    with source_db.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO c VALUES (51, 'b', 0)")
        conn.execute("UPDATE c SET n = n + 1 WHERE id IN (1, 51)")
        conn.execute("UPDATE c SET v = 'c' WHERE id % 2 = 0")
        conn.execute("DELETE FROM c WHERE id = 3")
    source_db.execute("UPDATE c SET n = n + 1")
    run_worker(source_db, target_db, "--conflict-policy", "error")
    assert _logged(target_db) == []
    assert target_db.query("SELECT count(*), sum(n) FROM c") == [(50, 52)]


@pytest.mark.parametrize("kind", ["insert_exists", "update_missing"])
def test_conflict_in_rows_sent_ahead_of_a_large_transactions_commit(source_db, target_db,
                                                                    kind: str) -> None:
    """A transaction larger than --batch-rows is sent in parts whose outcome is read only while
    the next part is prepared (a COPY of inserts, multi-row updates). A conflict in an early part
    is still found, the whole transaction redone row by row, the conflict resolved and logged."""
    source_db.execute(TABLE)
    target_db.execute(TABLE)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE c")
    create_slot(source_db)
    if kind == "update_missing":
        source_db.execute("INSERT INTO c SELECT g, 'original', 0 FROM generate_series(1, 3000) g")
        run_worker(source_db, target_db)
        target_db.execute("DELETE FROM c WHERE id = 7")
        source_db.execute("UPDATE c SET v = 'remote', n = n + 1")
    else:
        target_db.execute("INSERT INTO c VALUES (7, 'local', 0)")
        source_db.execute("INSERT INTO c SELECT g, 'remote', 1 FROM generate_series(1, 3000) g")
    proc = run_worker(source_db, target_db, "--conflict-policy", "apply", "--batch-rows", "500")
    assert "row by row" in proc.stderr  # the fast path met the conflict and handed it over
    rows = target_db.query("SELECT count(*), count(*) FILTER (WHERE v = 'remote' AND n = 1) FROM c")
    assert rows == [(3000, 3000)] if kind == "insert_exists" else [(2999, 2999)]
    assert [row[:2] for row in _logged(target_db)] == [
        (kind, "applied" if kind == "insert_exists" else "skipped")]
