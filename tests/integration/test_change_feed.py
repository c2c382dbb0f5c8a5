"""The change feed (--change-feed): a change row for every row change applied, in the same target
transaction, on every path (fast, careful, streamed, prepared), exactly once under SIGKILL, and
retention that never drops what a reader's snapshot may read."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import forked
import pytest
from feed_checks import COMMITS, PENDING, change_table, changes, check_feed, ops
from replication import (
    assert_same_rows,
    create_slot,
    prepare_on_source,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
)

from applier.implementation import accelerator

pytestmark = pytest.mark.server

SCHEMA = """
CREATE TABLE pk_t (id int PRIMARY KEY, name text, qty int);
CREATE TABLE idx_t (k1 int NOT NULL, k2 text NOT NULL, v text);
CREATE UNIQUE INDEX idx_t_k ON idx_t (k1, k2);
ALTER TABLE idx_t REPLICA IDENTITY USING INDEX idx_t_k;
CREATE TABLE full_t (a int, b text);
ALTER TABLE full_t REPLICA IDENTITY FULL;
CREATE TABLE nothing_t (v text);
ALTER TABLE nothing_t REPLICA IDENTITY NOTHING;
CREATE TABLE toast_t (id int PRIMARY KEY, big text, small int);
ALTER TABLE toast_t ALTER COLUMN big SET STORAGE EXTERNAL;
"""
WORKLOAD = [
    "INSERT INTO pk_t SELECT g, 'n' || g, g FROM generate_series(1, 300) g",   # a COPY
    "INSERT INTO pk_t SELECT g, 'n' || g, g FROM generate_series(301, 310) g",  # multi-row
    "UPDATE pk_t SET qty = qty + 1 WHERE id <= 10",
    "UPDATE pk_t SET qty = qty + 1 WHERE id <= 5",                               # same rows again
    "UPDATE pk_t SET id = id + 1000 WHERE id BETWEEN 11 AND 13",                 # moved keys
    "DELETE FROM pk_t WHERE id BETWEEN 20 AND 25",
    "INSERT INTO idx_t SELECT g, 'k' || g, 'v' FROM generate_series(1, 10) g",
    "UPDATE idx_t SET v = 'updated' WHERE k1 = 1",
    "UPDATE idx_t SET k2 = 'moved' WHERE k1 = 2",
    "DELETE FROM idx_t WHERE k1 = 3",
    # Text keys with quotes, a backslash, braces and commas, deleted in one statement.
    "INSERT INTO idx_t VALUES (50, 'q\"uote', 'v'), (50, 'back\\slash', 'v'), (50, '{brace,comma}', 'v'), "
    "(50, 'NULL', 'v'), (50, ' spaced ', 'v')",
    "DELETE FROM idx_t WHERE k1 = 50",
    "INSERT INTO full_t VALUES (1, 'dup'), (1, 'dup'), (2, 'x'), (3, NULL)",
    "UPDATE full_t SET b = 'changed' WHERE ctid = (SELECT ctid FROM full_t WHERE a = 1 LIMIT 1)",
    "DELETE FROM full_t WHERE a = 3",
    "INSERT INTO nothing_t VALUES ('a'), ('b')",
    # 96 kB stored out of line; the update leaves it unchanged (pgoutput sends 'u' for it).
    "INSERT INTO toast_t SELECT 1, string_agg(md5(g::text), ''), 1 FROM generate_series(1, 3000) g",
    "UPDATE toast_t SET small = 2 WHERE id = 1",
    "DELETE FROM toast_t WHERE id = 1",
    "INSERT INTO toast_t VALUES (2, 'short', 0)",
    "TRUNCATE idx_t",
    "INSERT INTO idx_t VALUES (7, 'after', 'truncate')",
]
TABLES = ["pk_t", "idx_t", "full_t", "nothing_t", "toast_t"]
KEYS = {"pk_t": ("id",), "idx_t": ("k1", "k2"), "toast_t": ("id",), "full_t": (), "nothing_t": ()}


def _setup(source_db, target_db, two_phase: bool = False) -> None:
    source_db.execute(SCHEMA)
    target_db.execute(SCHEMA)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE pk_t, idx_t, full_t, toast_t")
    source_db.execute("CREATE PUBLICATION pub_ins FOR TABLE nothing_t WITH (publish = 'insert')")
    create_slot(source_db, two_phase=two_phase)


def _check_all(source_db, target_db) -> dict[str, list[tuple]]:
    assert_same_rows(source_db, target_db, *TABLES)
    return {t: check_feed(source_db, target_db, t, KEYS[t]) for t in TABLES}


@pytest.mark.parametrize("path", ["fast", "fast-binary", "careful"])
def test_every_row_shape_on_the_fast_and_the_careful_path(source_db, target_db, path: str) -> None:
    """The careful path: a conflict in the last transaction sends the whole batch back to be
    redone row by row, so every change row there comes from the careful path's statements.
    fast-binary: values in binary, so the lane's change rows carry their meta in send format."""
    _setup(source_db, target_db)
    for statement in WORKLOAD:
        source_db.execute(statement)
    extra: tuple[str, ...] = ()
    if path == "careful":
        target_db.execute("INSERT INTO pk_t VALUES (5000, 'target', 0)")
        source_db.execute("INSERT INTO pk_t VALUES (5000, 'source', 1)")  # insert_exists
        extra = ("--batch-time", "60000", "--streaming", "off")
    elif path == "fast-binary":
        extra = ("--binary", "on")
    proc = run_worker(source_db, target_db, "--change-feed", "all", *extra, publication="pub,pub_ins")
    if path == "careful":
        assert "row by row" in proc.stderr
    found = _check_all(source_db, target_db)
    inserts = 310 + (1 if path == "careful" else 0)
    # Moved keys are recorded as the delete of the old key, then the update.
    assert ops(found["pk_t"]) == {"I": inserts, "U": 10 + 5 + 3, "D": 3 + 6}
    assert ops(found["idx_t"]) == {"I": 11 + 5, "U": 2, "D": 1 + 1 + 5, "T": 1}
    assert ops(found["full_t"]) == {"I": 4, "U": 1, "D": 1}
    assert ops(found["nothing_t"]) == {"I": 2}
    # The update left the TOAST value unchanged: its change row still has the whole value, and
    # so has the delete's (the whole old row).
    toast = changes(target_db, "toast_t", ["id", "length(big)", "small"])
    assert [(r[4], r[5:]) for r in toast] == [("I", ("1", "96000", "1")), ("U", ("1", "96000", "2")),
                                             ("D", ("1", "96000", "2")), ("I", ("2", "5", "0"))]
    moved = [r for r in changes(target_db, "pk_t", ["id", "name"]) if r[5] in ("11", "1011")]
    assert [(r[4], r[5], r[6]) for r in moved] == [("I", "11", "n11"), ("D", "11", None),
                                                   ("U", "1011", "n11")]
    # One transaction's rows share its stamp; its changes are numbered in order.
    updates = [r for r in found["pk_t"] if r[4] == "U"][:10]
    assert len({r[:3] for r in updates}) == 1 and [r[3] for r in updates] == list(range(1, 11))
    if path == "careful":
        conflicted = changes(target_db, "pk_t", ["id", "name"])[-1]
        assert conflicted[4:] == ("I", "5000", "source")


def test_commit_lsn_is_the_source_commit_and_history_starts_with_the_feed(source_db, target_db) -> None:
    _setup(source_db, target_db)
    source_db.execute("INSERT INTO pk_t VALUES (1, 'before', 0)")
    run_worker(source_db, target_db, publication="pub,pub_ins")  # no feed yet
    for n, statement in enumerate(["INSERT INTO pk_t VALUES (2, 'a', 0)",
                                   "UPDATE pk_t SET qty = 7 WHERE id = 1",
                                   "DELETE FROM pk_t WHERE id = 2"]):
        source_db.execute(statement)
        run_worker(source_db, target_db, "--change-feed", "public.pk_t", publication="pub,pub_ins")
        applied = target_db.query("SELECT commit_lsn::text, commit_time FROM applier.progress")[0]
        last = changes(target_db, "pk_t")[-1]
        assert (last[0], last[1]) == applied
        # Its end LSN, kept once per source transaction, is the one the progress row has.
        assert target_db.query(f"SELECT k.end_lsn FROM {COMMITS} k JOIN applier.progress p "
                               "ON p.slot_name = k.slot_name AND p.commit_lsn = k.commit_lsn") == \
            target_db.query("SELECT end_lsn FROM applier.progress")
    registry = target_db.query("SELECT created_lsn < retained_after OR created_lsn = retained_after, "
                               "stopped_lsn FROM applier.change_tables")
    assert registry == [(True, None)]
    assert [r[4] for r in changes(target_db, "pk_t")] == ["I", "U", "D"]
    # Switched off, then on again: the gap cannot be recorded, so history starts again.
    source_db.execute("INSERT INTO pk_t VALUES (3, 'unrecorded', 0)")
    run_worker(source_db, target_db, "--change-feed", "public.toast_t", publication="pub,pub_ins")
    assert target_db.query("SELECT stopped_lsn IS NOT NULL FROM applier.change_tables "
                           "WHERE table_name = 'pk_t'") == [(True,)]
    source_db.execute("INSERT INTO pk_t VALUES (4, 'again', 0)")
    run_worker(source_db, target_db, "--change-feed", "all", publication="pub,pub_ins")
    assert [r[4:] for r in changes(target_db, "pk_t", ["id"])] == [("I", "4")]


def test_schema_changes_reach_the_change_table(source_db, target_db) -> None:
    _setup(source_db, target_db)
    source_db.execute("INSERT INTO pk_t VALUES (1, 'a', 1)")
    run_worker(source_db, target_db, "--change-feed", "all", publication="pub,pub_ins")
    source_db.execute("ALTER TABLE pk_t ADD COLUMN note text, ALTER COLUMN qty TYPE bigint")
    source_db.execute("INSERT INTO pk_t VALUES (2, 'b', 5000000000, 'new column')")
    source_db.execute("UPDATE pk_t SET note = 'set' WHERE id = 1")
    run_worker(source_db, target_db, "--change-feed", "all", publication="pub,pub_ins")
    types = dict(target_db.query(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
        "'applier_changes.\"public.pk_t\"'::regclass AND attnum > 0 AND NOT attisdropped"))
    assert types["note"] == "text" and types["qty"] == "bigint"
    found = check_feed(source_db, target_db, "pk_t")
    assert [r[4:] for r in changes(target_db, "pk_t", ["id", "qty", "note"])] == [
        ("I", "1", "1", None), ("I", "2", "5000000000", "new column"), ("U", "1", "1", "set")]
    assert ops(found) == {"I": 2, "U": 1}


@pytest.mark.parametrize("streamed_apply", ["early", "commit"])
def test_streamed_transactions_with_aborted_subtransactions(source_db, target_db,
                                                            streamed_apply: str) -> None:
    _setup(source_db, target_db)
    with source_db.connect() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO pk_t SELECT g, repeat('x', 200), g FROM generate_series(1, 2000) g")
        conn.execute("SAVEPOINT s1")
        conn.execute("UPDATE pk_t SET qty = -1 WHERE id <= 1000")
        conn.execute("ROLLBACK TO SAVEPOINT s1")
        conn.execute("UPDATE pk_t SET qty = qty * 10 WHERE id <= 500")
        conn.execute("DELETE FROM pk_t WHERE id > 1900")
        conn.execute("COMMIT")
    with source_db.connect() as conn:  # a streamed transaction that aborts: nothing recorded
        conn.execute("BEGIN")
        conn.execute("INSERT INTO pk_t SELECT g, repeat('y', 200), g FROM generate_series(5001, 7000) g")
        conn.execute("ROLLBACK")
    source_db.execute("UPDATE pk_t SET name = 'small' WHERE id = 1")
    proc = run_worker(source_db, target_db, "--change-feed", "all", "--streamed-apply",
                      streamed_apply, publication="pub,pub_ins")
    if streamed_apply == "early":
        assert "streamed transaction(s) applied as they streamed" in proc.stderr
    found = _check_all(source_db, target_db)
    assert ops(found["pk_t"]) == {"I": 2000, "U": 501, "D": 100}
    assert target_db.query(f"SELECT count(*) FROM {change_table('pk_t')} WHERE change_commit_lsn = "
                           f"'{PENDING}'") == [(0,)]
    # Applied as it streamed, the transaction's COPYs of change rows were held back until its
    # commit and written once, with its commit LSN: only its deletes (recorded from the target's
    # old rows) went through the pending partition. Applied at its commit, nothing did.
    # (The spool is the lane's: without it, in pure Python, the rows go through the pending
    # partition and are moved at the commit, as the count of PENDING rows above checks.)
    inserted = _pending_rows_inserted(target_db, "pk_t")
    if streamed_apply == "early" and accelerator("apply._lane") is not None:
        assert inserted == 100, inserted  # its 100 deletes
    elif streamed_apply == "early":
        assert inserted >= 2000 + 500 + 100, inserted  # its inserts, updates and deletes
    else:
        assert inserted == 0


def _pending_rows_inserted(target_db, table: str) -> int:
    """Rows ever inserted into the pending partition of ``table``'s change table (the statistics
    of the worker's sessions, reported as they exit)."""
    query = ("SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables WHERE schemaname = "
             f"'applier_changes' AND relname LIKE '%.pending:public.{table}'")
    deadline = time.monotonic() + 10
    with target_db.connect() as conn:
        while True:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            inserted = int(conn.execute(query).fetchone()[0])
            if inserted or time.monotonic() > deadline:
                return inserted
            time.sleep(0.2)


@pytest.mark.parametrize("mode", ["prepare", "defer"])
def test_prepared_transactions_get_the_commit_prepared_lsn(source_db, target_db, mode: str) -> None:
    _setup(source_db, target_db, two_phase=True)
    prepare_on_source(source_db, "keep", "INSERT INTO pk_t VALUES (1, 'one', 1)",
                      "INSERT INTO pk_t SELECT g, 'big', g FROM generate_series(100, 1100) g")
    prepare_on_source(source_db, "drop", "INSERT INTO pk_t VALUES (2, 'two', 2)")
    args = ("--change-feed", "all", "--two-phase-mode", mode)
    run_worker(source_db, target_db, *args, publication="pub,pub_ins")
    assert changes(target_db, "pk_t") == []  # prepared: nothing visible, rows included
    source_db.execute("COMMIT PREPARED 'keep'")
    run_worker(source_db, target_db, *args, publication="pub,pub_ins")
    applied = target_db.query("SELECT commit_lsn::text, commit_time FROM applier.progress")[0]
    found = changes(target_db, "pk_t")
    assert len(found) == 1002 and {(r[0], r[1]) for r in found} == {applied}
    source_db.execute("ROLLBACK PREPARED 'drop'")
    source_db.execute("UPDATE pk_t SET qty = 0 WHERE id = 1")
    run_worker(source_db, target_db, *args, publication="pub,pub_ins")
    found = check_feed(source_db, target_db, "pk_t")
    assert ops(found) == {"I": 1002, "U": 1}


@pytest.mark.slow
def test_sigkill_mid_batch_leaves_no_change_row_without_its_data_and_none_twice(
        source_db, target_db, tmp_path: Path) -> None:
    from test_worker_faults import TABLES as BANK_TABLES
    from test_worker_faults import Workload, _bank

    _bank(source_db, target_db)
    workload = Workload(source_db.dsn, seed=5)
    workload.start()
    chooser = random.Random(13)
    log = tmp_path / "worker.log"
    try:
        for _ in range(8):
            proc = start_worker(source_db, target_db, "--change-feed", "all", "--memory-budget",
                                "256kB", "--spill-dir", str(tmp_path / "spill"), log_path=log)
            time.sleep(chooser.uniform(0.8, 2.5))
            assert proc.poll() is None, log.read_text()[-3000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        workload.stop()
    # A last kill at the most dangerous moment: committed on the target, the source not told.
    source_db.execute("UPDATE branches SET bbalance = bbalance + 1 WHERE bid = 1")
    run_worker(source_db, target_db, "--change-feed", "all", "--spill-dir", str(tmp_path / "spill"),
               fault="before_feedback", expect_rc=-9)
    run_worker(source_db, target_db, "--change-feed", "all", "--spill-dir", str(tmp_path / "spill"))
    assert_same_rows(source_db, target_db, *BANK_TABLES)
    keys = {"branches": ("bid",), "tellers": ("tid",), "accounts": ("aid",), "history": ("hid",)}
    for table in BANK_TABLES:
        check_feed(source_db, target_db, table, keys[table])
    # Every update of the hot rows is there: the sum of the recorded deltas is the balance.
    assert ops(changes(target_db, "branches"))["U"] >= workload.committed * 0.9


@pytest.mark.slow
def test_retention_drops_old_partitions_but_never_under_a_reader(source_db, target_db,
                                                                 tmp_path: Path) -> None:
    from applier.spark.changes import HistoryNotRetained, change_range
    from applier.spark.reader import open_snapshot

    _setup(source_db, target_db)
    log = tmp_path / "worker.log"
    proc = start_worker(source_db, target_db, "--change-feed", "public.pk_t",
                        "--change-feed-retention", "3s", publication="pub,pub_ins", log_path=log)
    try:
        def partitions() -> list[tuple]:
            return target_db.query("SELECT partition_name FROM applier.change_partitions "
                                   "ORDER BY from_lsn")

        def retained() -> str:
            return target_db.query("SELECT retained_after::text FROM applier.change_tables")[0][0]

        next_id = 1

        def write(rounds: int) -> None:
            nonlocal next_id
            for _ in range(rounds):
                source_db.execute("INSERT INTO pk_t SELECT g, repeat('w', 500), 0 FROM "
                                  "generate_series(%s::int, %s::int) g", (next_id, next_id + 299))
                next_id += 300
                time.sleep(0.2)

        write(5)
        wait_for(lambda: target_db.query("SELECT count(*) FROM pk_t") == [(next_id - 1,)],
                 what="the first rows")
        snap = open_snapshot(target_db.dsn)
        try:
            held = change_range(snap, "pk_t", retained())
            before = partitions()
            write(25)  # more partitions, and time for the first ones to expire
            time.sleep(4)
            assert partitions()[:len(before)] == before, "a partition dropped under a reader"
            assert retained() == str(held.start)
            # The snapshot still reads all it saw.
            assert snap.query(f"SELECT count(*) FROM {change_table('pk_t')}")[0][0] == 1500
        finally:
            snap.close()
        # The retained range moves with the drops, in their transaction, oldest partition first.
        # Not every partition the reader saw need go: a partition is sized from the WAL rate
        # seen so far, so the last of them may still be the newest, which is never dropped.
        wait_for(lambda: retained() != str(held.start), timeout=30, what="retention after the reader")
        assert partitions()[0] != before[0]
        with open_snapshot(target_db.dsn) as late:
            with pytest.raises(HistoryNotRetained, match="committed after"):
                change_range(late, "pk_t", held.start)
            kept = change_range(late, "pk_t", retained())
            count = late.query(f"SELECT count(*) FROM {change_table('pk_t')} "
                               f"WHERE change_commit_lsn > '{kept.start}'")[0][0]
            total = late.query(f"SELECT count(*) FROM {change_table('pk_t')}")[0][0]
            assert count == total > 0
            # The end LSNs went with the partitions: no row of them wholly at or below the
            # retained range, one for each transaction still held.
            ends = late.query("SELECT (SELECT count(*) FROM applier.change_commits WHERE last_lsn <= "
                              f"%s::pg_lsn), count(*) FILTER (WHERE commit_lsn > %s::pg_lsn) FROM {COMMITS} commits",
                              (str(kept.start), str(kept.start)))[0]
            held_transactions = late.query(f"SELECT count(DISTINCT change_commit_lsn) FROM "
                                           f"{change_table('pk_t')}")[0][0]
            assert ends == (0, held_transactions)
    finally:
        assert stop_worker(proc) == 0, log.read_text()[-3000:]
    assert "dropped" in log.read_text()
    assert_same_rows(source_db, target_db, "pk_t")


def test_status_shows_the_retained_range_and_size(source_db, target_db) -> None:
    import json
    import sys

    from replication import REPO

    _setup(source_db, target_db)
    source_db.execute("INSERT INTO pk_t SELECT g, 'x', g FROM generate_series(1, 100) g")
    run_worker(source_db, target_db, "--change-feed", "all", publication="pub,pub_ins")
    out = forked.run([sys.executable, "-m", "applier", "status", "--source", source_db.dsn,
                      "--target", target_db.dsn, "--slot", "s", "--json"],
                     capture_output=True, text=True, cwd=REPO, timeout=60)
    report = json.loads(out.stdout)
    feed = {row["table"]: row for row in report["change_feed"]}
    assert set(feed) == {f"public.{t}" for t in TABLES}
    assert feed["public.pk_t"]["retained_after"] == "0/0"
    assert feed["public.pk_t"]["bytes"] > 0
    text = forked.run([sys.executable, "-m", "applier", "status", "--source", source_db.dsn,
                       "--target", target_db.dsn, "--slot", "s"],
                      capture_output=True, text=True, cwd=REPO, timeout=60).stdout
    assert "change feed" in text and "public.pk_t" in text


def test_partitions_are_in_lsn_order_across_a_longer_lsn(target_db) -> None:
    """As text 0/10000000 sorts before 0/F000000: the registry orders by the LSN, not its text
    (the newest partition decides where the next one starts)."""
    import psycopg

    from applier.progress.feed_registry import FeedRegistry
    from applier.progress.schema import make_engine, upgrade_schema
    from applier.protocol.lsn import LSN

    upgrade_schema(make_engine(target_db.dsn))
    bounds = [("0/0", "0/F000000"), ("0/F000000", "0/10000000"), ("0/10000000", "1/0")]
    for n, (lower, upper) in enumerate(bounds, 1):
        target_db.execute("INSERT INTO applier.change_partitions VALUES ('t', %s, %s, %s, %s, now())",
                          (f"{n}:t", lower, upper, lower))
    with psycopg.connect(target_db.dsn) as conn:
        found = FeedRegistry(conn).partitions("t")
    assert [(p.from_lsn, p.to_lsn) for p in found] == [(LSN.parse(lo), LSN.parse(hi)) for lo, hi in bounds]


def test_deletes_whose_keys_are_one_row_on_the_target_record_that_row_once(source_db,
                                                                              target_db) -> None:
    """Ten deletes in one statement on the fast path, two of whose keys ('1' and '01', text on
    the source) are one row on the target (an integer key there): the delete finds nine rows for
    ten keys, so the batch goes the careful way instead of recording the one old row twice."""
    source_db.execute("CREATE TABLE k_t (id text PRIMARY KEY, v int)")
    target_db.execute("CREATE TABLE k_t (id integer PRIMARY KEY, v int)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE k_t")
    create_slot(source_db)
    source_db.execute("INSERT INTO k_t SELECT g::text, g FROM generate_series(1, 9) g")
    source_db.execute("INSERT INTO k_t VALUES ('01', 100)")  # the row of key 1 on the target
    run_worker(source_db, target_db, "--change-feed", "all")
    source_db.execute("DELETE FROM k_t")
    proc = run_worker(source_db, target_db, "--change-feed", "all", "--batch-time", "60000",
                      "--streaming", "off")
    assert "row by row" in proc.stderr
    assert target_db.query("SELECT count(*) FROM k_t") == [(0,)]
    deleted = [r[5] for r in changes(target_db, "k_t", ["id", "v"]) if r[4] == "D"]
    assert sorted(deleted) == [str(n) for n in range(1, 10)]


def test_reads_of_fresh_changes_join_their_end_lsns_without_a_nested_loop(source_db, target_db) -> None:
    """Changes just written lie past the change table's statistics, so PostgreSQL underestimates
    them; the reads' settings keep it from joining each change row to the end LSNs by a nested
    loop (which goes through every end LSN of the range for each change row)."""
    from applier.spark.changes import PLAN_SETTINGS, change_queries, change_range
    from applier.spark.reader import open_snapshot

    _setup(source_db, target_db)
    source_db.execute("INSERT INTO pk_t SELECT g, 'n', 0 FROM generate_series(1, 2000) g")
    run_worker(source_db, target_db, "--change-feed", "all", publication="pub,pub_ins")
    start = target_db.query("SELECT commit_lsn::text FROM applier.progress")[0][0]
    for n in range(100):
        source_db.execute("UPDATE pk_t SET qty = qty + 1 WHERE id %% 100 = %s", (n,))
    run_worker(source_db, target_db, "--change-feed", "all", publication="pub,pub_ins")
    with open_snapshot(target_db.dsn) as snap:
        span = change_range(snap, "public.pk_t", start)
        snap.connection.execute(PLAN_SETTINGS)
        for net in (False, True):
            query = change_queries(snap, span, net=net, count=2)[0]
            plan = [line for (line,) in snap.query(f"EXPLAIN SELECT * FROM {query}")]
            outer = next(line for line in plan if "Join" in line)  # the end LSNs' join
            assert "Nested Loop" not in outer, "\n".join(plan)
            assert len(snap.query(f"SELECT * FROM {query}")) > 0
