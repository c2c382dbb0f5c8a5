"""Helpers shared by the worker's integration tests: publications, slots, running the worker,
and row-by-row comparison of source and target."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import forked

REPO = Path(__file__).resolve().parents[2]


def create_slot(source_db, slot: str = "s", two_phase: bool = False) -> None:
    args = "%s, 'pgoutput', false, true" if two_phase else "%s, 'pgoutput'"
    source_db.execute(f"SELECT pg_create_logical_replication_slot({args})", (slot,))


def replicated_table(source_db, target_db, with_slot: bool = True) -> None:
    """The simplest set-up: table ``t (id int PRIMARY KEY)`` on both sides, publication ``pub``
    for it and (``with_slot``) slot ``s``."""
    for db in (source_db, target_db):
        db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    if with_slot:
        create_slot(source_db)


def prepare_on_source(source_db, gid: str, *statements: str) -> None:
    """Run ``statements`` in one transaction and PREPARE it as ``gid`` on the source."""
    with source_db.connect() as conn:
        conn.execute("BEGIN")
        for statement in statements:
            conn.execute(statement)
        conn.execute(f"PREPARE TRANSACTION '{gid}'")


def worker_command(source_db, target_db, *extra: str, slot: str = "s", publication: str = "pub") -> list[str]:
    return [sys.executable, "-m", "applier", "run", "--source", source_db.dsn, "--target",
            target_db.dsn, "--slot", slot, "--publication", publication, "--log-level", "INFO",
            *extra]


def run_worker(source_db, target_db, *extra: str, slot: str = "s", publication: str = "pub",
               expect_rc: int | None = 0, timeout: float = 180, fault: str | None = None,
               new_interpreter: bool = False) -> subprocess.CompletedProcess:
    """Run ``applier run --exit-when-caught-up`` to completion: a forked child (forked.py), or
    with ``new_interpreter`` ``python -m applier`` as a user starts it. ``fault`` sets
    APPLIER_FAULT (the worker kills itself there: expect_rc=-9)."""
    command = worker_command(source_db, target_db, "--exit-when-caught-up", *extra, slot=slot,
                             publication=publication)
    proc = (subprocess.run if new_interpreter else forked.run)(
        command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=worker_env(fault))
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    if proc.returncode == -9:
        wait_slot_inactive(source_db, slot)
    return proc


def start_worker(source_db, target_db, *extra: str, slot: str = "s", publication: str = "pub",
                 log_path: Path | None = None, fault: str | None = None) -> subprocess.Popen:
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return forked.Popen(worker_command(source_db, target_db, *extra, slot=slot,
                                       publication=publication),
                        stdout=out, stderr=out, cwd=REPO, env=worker_env(fault))


def kill_worker(proc: subprocess.Popen, source_db, slot: str = "s") -> None:
    """SIGKILL, then wait until the source has let go of the slot (as a restart would need)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    wait_slot_inactive(source_db, slot)


def wait_slot_inactive(source_db, slot: str = "s", timeout: float = 30) -> None:
    wait_for(lambda: source_db.query("SELECT active FROM pg_replication_slots WHERE slot_name = %s",
                                     (slot,)) in ([(False,)], []),
             timeout=timeout, what=f"slot {slot!r} to be released")


def stop_worker(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def rows(db, table: str, columns: Sequence[str] | None = None) -> list[tuple]:
    """All rows as text, sorted: the comparison is by value, not by physical order."""
    cols = ", ".join(f"{c}::text" for c in columns) if columns else f"{table}::text"
    return sorted(db.query(f"SELECT {cols} FROM {table}"), key=repr)


def source_columns(db, table: str) -> list[str]:
    """Quoted column names of a source table, in order (so target extra columns are ignored)."""
    found = db.query("SELECT quote_ident(attname) FROM pg_attribute WHERE attrelid = %s::regclass "
                     "AND attnum > 0 AND NOT attisdropped ORDER BY attnum", (table,))
    return [row[0] for row in found]


def assert_same_rows(source_db, target_db, *tables: str) -> None:
    for table in tables:
        columns = source_columns(source_db, table)
        expected = rows(source_db, table, columns)
        actual = rows(target_db, table, columns)
        if expected != actual:
            missing = list((Counter(expected) - Counter(actual)).elements())[:5]
            extra = list((Counter(actual) - Counter(expected)).elements())[:5]
            raise AssertionError(f"{table}: {len(expected)} source rows, {len(actual)} target rows; "
                                 f"missing e.g. {missing}; extra e.g. {extra}")


def wait_for(predicate, timeout: float = 60, interval: float = 0.1, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def worker_env(fault: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("APPLIER_FAULT", None)
    if fault:
        env["APPLIER_FAULT"] = fault
    return env


@contextmanager
def slot_of_that_name_elsewhere(pg_pair, target_db) -> Iterator:
    """A database on another server than the source (the target's: another system identifier)
    with table t, publication pub and a slot named 's' of its own: not the slot the target's
    progress came from. Dropped at the end."""
    other = pg_pair.target.create_database(f"other_{target_db.name}"[:60])
    try:
        other.execute("CREATE TABLE t (id int PRIMARY KEY)")
        other.execute("CREATE PUBLICATION pub FOR TABLE t")
        other.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        yield other
    finally:
        pg_pair.target.drop_database(other.name)
