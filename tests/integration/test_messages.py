"""Logical decoding messages: transactional ones inside their transaction, in order with its row
changes; non-transactional ones at once; prefix filter; log sink; streamed and prepared ones."""

from __future__ import annotations

import pytest
from replication import create_slot, prepare_on_source, run_worker

pytestmark = pytest.mark.server

SOURCE_TABLE = "CREATE TABLE t (id int PRIMARY KEY, v text)"
# On the target every row takes a number from the sequence applier.messages uses for its ids, so
# rows and messages can be put in the order the worker wrote them.
TARGET_TABLE = ("CREATE TABLE t (id int PRIMARY KEY, v text, "
                "ord bigint DEFAULT nextval('applier.messages_id_seq'))")


def _setup(source_db, target_db, two_phase: bool = False) -> None:
    source_db.execute(SOURCE_TABLE)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db, two_phase=two_phase)
    run_worker(source_db, target_db)  # creates the applier schema on the target
    target_db.execute(TARGET_TABLE)


def _emit(transactional: bool, prefix: str, content: str) -> str:
    return (f"SELECT pg_logical_emit_message({str(transactional).lower()}, '{prefix}', "
            f"convert_to('{content}', 'UTF8'))")


def _applied_order(target_db) -> list[str]:
    """Rows (as 'row <id>') and messages (as their content) in the order they were written."""
    events = target_db.query(
        "SELECT ord, 'row ' || id FROM t UNION ALL "
        "SELECT id, encode(content, 'escape') FROM applier.messages ORDER BY 1")
    return [name for _, name in events]


def test_messages_in_order_with_their_transaction(source_db, target_db) -> None:
    _setup(source_db, target_db)
    with source_db.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        conn.execute(_emit(True, "app", "m1"))
        conn.execute(_emit(False, "app", "non-transactional"))
        conn.execute("INSERT INTO t VALUES (2, 'b')")
        conn.execute(_emit(True, "app.audit", "m2"))
        conn.execute(_emit(True, "other", "filtered out"))
        conn.execute("INSERT INTO t VALUES (3, 'c')")
    with source_db.connect() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (4, 'rolled back')")
        conn.execute(_emit(True, "app", "rolled back"))
        conn.execute(_emit(False, "app", "sent although rolled back"))
        conn.execute("ROLLBACK")
    source_db.execute(_emit(True, "app", "alone"))  # a transaction with a message and nothing else
    source_db.execute("SELECT pg_logical_emit_message(true, 'app', '\\x00ff0a'::bytea)")

    run_worker(source_db, target_db, "--messages", "--message-prefix", "app*")
    assert _applied_order(target_db) == [
        "non-transactional", "row 1", "m1", "row 2", "m2", "row 3", "sent although rolled back",
        "alone", "\\000\\377\n"]
    rows = target_db.query("SELECT prefix, transactional, xid IS NOT NULL, commit_lsn IS NOT NULL, "
                           "content FROM applier.messages ORDER BY id")
    assert [row[:4] for row in rows] == [
        ("app", False, False, False), ("app", True, True, True), ("app.audit", True, True, True),
        ("app", False, False, False), ("app", True, True, True), ("app", True, True, True)]
    assert rows[-1][4] == b"\x00\xff\n"
    # Each message's LSN is its own WAL position, increasing in stream order within a transaction.
    lsns = target_db.query("SELECT lsn FROM applier.messages WHERE transactional ORDER BY id")
    assert lsns[0] < lsns[1]


def test_messages_are_not_applied_twice(source_db, target_db) -> None:
    _setup(source_db, target_db)
    source_db.execute(_emit(False, "app", "once"))
    with source_db.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        conn.execute(_emit(True, "app", "with row 1"))
    # Killed after applying, before telling the source: it resends both messages.
    run_worker(source_db, target_db, "--messages", fault="before_feedback", expect_rc=-9)
    run_worker(source_db, target_db, "--messages")
    assert sorted(r[0] for r in target_db.query("SELECT encode(content, 'escape') "
                                                "FROM applier.messages")) == ["once", "with row 1"]


def test_message_log_sink(source_db, target_db) -> None:
    _setup(source_db, target_db)
    with source_db.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        conn.execute(_emit(True, "app", "to the log"))
    source_db.execute(_emit(False, "ops", "also to the log"))
    done = run_worker(source_db, target_db, "--messages", "--message-sink", "log")
    assert "logical message prefix='app'" in done.stderr and "to the log" in done.stderr
    assert "transactional=False" in done.stderr and "also to the log" in done.stderr
    assert target_db.query("SELECT count(*) FROM applier.messages") == [(0,)]


def test_messages_inside_a_streamed_transaction(source_db, target_db) -> None:
    _setup(source_db, target_db)
    with source_db.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO t SELECT g, repeat(md5(g::text), 4) FROM generate_series(1, 1500) g")
        conn.execute(_emit(True, "app", "middle"))
        conn.execute("INSERT INTO t SELECT g, repeat(md5(g::text), 4) FROM generate_series(2001, 3500) g")
        conn.execute(_emit(True, "app", "end"))
    run_worker(source_db, target_db, "--messages", "--memory-budget", "128kB")
    order = _applied_order(target_db)
    assert len(order) == 3002
    assert order[1500] == "middle" and order[-1] == "end"
    assert order[1499] == "row 1500" and order[1501] == "row 2001"


@pytest.mark.parametrize("mode", ["prepare", "defer"])
def test_messages_of_prepared_transactions_appear_at_commit_prepared(source_db, target_db,
                                                                     mode: str) -> None:
    _setup(source_db, target_db, two_phase=True)
    for id_, gid, content in ((1, "keep", "kept"), (2, "drop", "dropped")):
        prepare_on_source(source_db, gid, f"INSERT INTO t VALUES ({id_}, '{gid}')",
                          _emit(True, "app", content))
    run_worker(source_db, target_db, "--messages", "--two-phase-mode", mode)
    assert target_db.query("SELECT count(*) FROM applier.messages") == [(0,)]
    source_db.execute("COMMIT PREPARED 'keep'")
    source_db.execute("ROLLBACK PREPARED 'drop'")
    run_worker(source_db, target_db, "--messages", "--two-phase-mode", mode)
    assert _applied_order(target_db) == ["row 1", "kept"]
