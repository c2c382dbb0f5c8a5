"""``applier run`` starts its replication stream before loading the worker (applier/headstart.py):
the worker takes that stream only when its first session would have started the same one, and
anything in the way only means no head start."""

from __future__ import annotations

import logging

import pytest
from replication import assert_same_rows, replicated_table, run_worker, slot_of_that_name_elsewhere, wait_for

from applier.config import load_settings
from applier.headstart import start_early
from applier.progress.lock import WorkerLock
from applier.worker import Worker, run

pytestmark = pytest.mark.server

TAKEN = "), started while the worker loaded"  # the end of the "streaming from" line


def _settings(source_db, target_db, **values):
    return load_settings("run", {"source": source_db.dsn, "target": target_db.dsn, "slot": "s",
                                 "publication": ["pub"], "exit_when_caught_up": True, **values}, None)


def _slot_active(source_db) -> bool:
    return source_db.query("SELECT active FROM pg_replication_slots WHERE slot_name = 's'")[0][0]


def test_the_worker_takes_the_stream_started_before_it_loaded(source_db, target_db) -> None:
    replicated_table(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT generate_series(1, 100)")
    # A target without the bookkeeping schema has no recorded position: no head start.
    first = run_worker(source_db, target_db)
    assert TAKEN not in first.stderr
    source_db.execute("INSERT INTO t SELECT generate_series(101, 300)")
    # A new interpreter, as a user starts it: the stream starts while the worker's modules load.
    second = run_worker(source_db, target_db, new_interpreter=True)
    assert TAKEN in second.stderr, second.stderr[-3000:]
    assert "this session applied 1 transaction(s): 200 insert" in second.stderr
    assert_same_rows(source_db, target_db, "t")


def test_a_stream_unlike_the_sessions_is_closed_and_another_started(source_db, target_db,
                                                                     caplog) -> None:
    replicated_table(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT generate_series(1, 10)")
    run_worker(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT generate_series(11, 50)")
    head_start = start_early(_settings(source_db, target_db))
    assert head_start is not None and _slot_active(source_db)
    # The worker asks for text values, the stream was started with binary ones (auto).
    caplog.set_level(logging.INFO, logger="applier")
    assert Worker(_settings(source_db, target_db, binary="off"), head_start).run() == 0
    assert "is not this session's" in caplog.text
    assert TAKEN not in caplog.text
    assert_same_rows(source_db, target_db, "t")


def test_a_stream_started_early_and_never_taken_is_closed(source_db, target_db) -> None:
    replicated_table(source_db, target_db)
    run_worker(source_db, target_db)
    head_start = start_early(_settings(source_db, target_db))
    assert head_start is not None and _slot_active(source_db)
    # The worker stops before its first session: another worker holds the lock for this slot.
    lock = WorkerLock(target_db.dsn, "s")
    lock.acquire()
    try:
        assert run(_settings(source_db, target_db), head_start) == 1
    finally:
        lock.release()
    assert head_start.stream is None
    wait_for(lambda: not _slot_active(source_db), timeout=30, what="the early stream's walsender to end")


def test_anything_in_the_way_means_no_head_start(source_db, target_db) -> None:
    replicated_table(source_db, target_db)
    # No bookkeeping schema on the target yet.
    assert start_early(_settings(source_db, target_db)) is None
    run_worker(source_db, target_db)
    # No such slot.
    assert start_early(_settings(source_db, target_db, slot="missing")) is None
    # The slot in use by another consumer: no head start, and no waiting for the slot.
    holder = start_early(_settings(source_db, target_db))
    assert holder is not None
    try:
        assert start_early(_settings(source_db, target_db)) is None
    finally:
        holder.close()


def test_no_stream_is_started_on_a_server_the_targets_progress_did_not_come_from(
        pg_pair, source_db, target_db) -> None:
    """A slot of that name on another server: no START_REPLICATION there, whose keepalive
    replies would confirm the target's position on that server's slot."""
    replicated_table(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT generate_series(1, 5)")
    run_worker(source_db, target_db)
    with slot_of_that_name_elsewhere(pg_pair, target_db) as other:
        assert start_early(_settings(other, target_db)) is None
        assert other.query("SELECT active FROM pg_replication_slots WHERE slot_name = 's'") == [(False,)]


def test_the_stream_is_received_ahead_within_a_quarter_of_the_memory_budget(source_db, target_db,
                                                                           caplog) -> None:
    """While the worker loads, a thread receives what the source sends into libpq's buffer (the
    walsender need not wait on a full socket); it stops at a quarter of --memory-budget, and the
    worker then applies every transaction from that buffer and the rest of the stream."""
    replicated_table(source_db, target_db)
    run_worker(source_db, target_db)
    # 5,000 single-row transactions: about a megabyte of stream, four times the read-ahead.
    source_db.execute("DO $$ BEGIN FOR i IN 1..5000 LOOP INSERT INTO t VALUES (i); COMMIT; "
                      "END LOOP; END $$")
    settings = _settings(source_db, target_db, memory_budget=1024 * 1024)
    head_start = start_early(settings)
    assert head_start is not None
    # A liveness bound: on a machine busy with other work the walsender may need a while.
    wait_for(lambda: not head_start.reading_ahead, timeout=120, what="the read-ahead to reach its budget")
    assert head_start.received_ahead >= 256 * 1024
    caplog.set_level(logging.INFO, logger="applier")
    assert Worker(settings, head_start).run() == 0
    assert TAKEN in caplog.text
    assert "this session applied 5000 transaction(s): 5000 insert" in caplog.text
    assert_same_rows(source_db, target_db, "t")


def test_taking_the_stream_stops_the_read_ahead(source_db, target_db) -> None:
    replicated_table(source_db, target_db)
    run_worker(source_db, target_db)
    head_start = start_early(_settings(source_db, target_db))
    assert head_start is not None and head_start.reading_ahead  # no backlog: it waits (keepalives)
    head_start.close()
    assert not head_start.reading_ahead and head_start.stream is None
    wait_for(lambda: not _slot_active(source_db), timeout=30, what="the early stream's walsender to end")


def test_a_stream_lost_while_read_ahead_is_started_again_by_the_worker(source_db, target_db) -> None:
    replicated_table(source_db, target_db)
    run_worker(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT generate_series(1, 500)")
    settings = _settings(source_db, target_db)
    head_start = start_early(settings)
    assert head_start is not None
    source_db.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                      "WHERE slot_name = 's'")
    wait_for(lambda: not head_start.reading_ahead, timeout=30, what="the read-ahead to end")
    # The worker takes the dead stream, fails to read it, and starts another session.
    assert Worker(settings, head_start).run() == 0
    assert_same_rows(source_db, target_db, "t")
