"""bench/apply.py --catchup: the target catching up after downtime, as a user meets it.

Owns nothing the product uses; it only measures. The drain of issue 39's independent harness:
one source and one target server for the whole run, with production settings on both (fsync,
full-page writes, 1 GB of shared buffers, autovacuum off so that nothing runs behind a drain's
back); per run, on both sides ``pgbench -i -s S`` and a bigserial key on pgbench_history, a
publication of the four tables and a marker table, the slot created, then ``pgbench -n -M
prepared -c C -j 2`` on the source with no consumer running, a marker row last, and CHECKPOINT.
Then the contender starts: a new ``applier run`` process with no options beyond source, target,
slot and publication (its bookkeeping schema left as the previous run left it, in the same
target database), or ``ALTER SUBSCRIPTION ... ENABLE`` of a subscription made with ``copy_data =
false, create_slot = false, streaming = parallel, synchronous_commit = off, binary = false``.
Timed from that start until the marker row is visible and until the slot's confirmed_flush_lsn
passes the end; for our worker also until its first row is visible (its start-up). Then both
targets are compared with the source. Contenders alternate (native, applier, native, ...), on the
same servers and databases run after run, so that whatever grows from run to run shows.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from apply_drain import DrainWatch
from apply_measure import load_average
from apply_workloads import MARKER_TABLE, PGBENCH_TABLES, checkpoint, drop_applier_origins, pgbench, same
from psycopg import sql

from applier.embedded import Database, PostgresServer, ServerSettings, start_server

ROOT = Path(__file__).resolve().parent.parent

#: The independent harness's settings, on both servers.
SETTINGS = {
    "wal_level": "logical", "fsync": "on", "synchronous_commit": "on", "full_page_writes": "on",
    "shared_buffers": "1GB", "max_wal_size": "8GB", "min_wal_size": "1GB",
    "checkpoint_timeout": "30min", "maintenance_work_mem": "256MB", "autovacuum": "off",
    "jit": "off", "logical_decoding_work_mem": "64MB",
    "max_parallel_apply_workers_per_subscription": "2", "track_commit_timestamp": "off",
}
SLOT = "catchup"
PUBLICATION = "catchup"
#: The first row the drain makes visible: pgbench's first history row has hid 1.
FIRST_ROW = "SELECT EXISTS (SELECT FROM pgbench_history WHERE hid = 1)"


@dataclass
class Drain:
    contender: str
    visible: float        # seconds from start until the marker row is visible on the target
    confirmed: float      # ... until the slot confirmed the end of the backlog
    first_row: float | None = None  # ours: seconds until the first row is visible (start-up)
    equal: bool = False


def servers(pg_version: int) -> tuple[PostgresServer, PostgresServer]:
    settings = ServerSettings.source(**SETTINGS)
    return (start_server(pg_version, settings, name="bench-catchup-src"),
            start_server(pg_version, settings, name="bench-catchup-tgt"))


def _prepare(db: Database, scale: int) -> None:
    pgbench(db, "-i", "-q", "-s", str(scale))
    db.execute("ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY")
    db.execute(f"DROP TABLE IF EXISTS {MARKER_TABLE}")
    db.execute(f"CREATE TABLE {MARKER_TABLE} (id int PRIMARY KEY)")


def _backlog(source: Database, scale: int, clients: int, transactions: int) -> str:
    """The run's backlog on the source, from a new slot; the end LSN (after the marker row)."""
    _prepare(source, scale)
    source.execute(f"DROP PUBLICATION IF EXISTS {PUBLICATION}")
    source.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {', '.join(PGBENCH_TABLES)}, {MARKER_TABLE}")
    if source.query("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)):
        source.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
    source.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
    pgbench(source, "-n", "-M", "prepared", "-c", str(clients), "-j", "2", "-t",
            str(transactions // clients))
    source.execute(f"INSERT INTO {MARKER_TABLE} VALUES (1)")
    return str(source.query("SELECT pg_current_wal_lsn()::text")[0][0])


def _watch_first_row(target: Database, started: float, stop: list[bool]) -> float | None:
    with target.connect() as conn:
        while not stop[0]:
            if conn.execute(FIRST_ROW).fetchone()[0]:
                return time.monotonic() - started
            time.sleep(0.005)
    return None


#: Our worker with the C lane turned off (issue 43 asks what the lane gains on these drains).
NO_LANE = "no lane"
_ENVIRONMENT = {NO_LANE: {"APPLIER_PURE_PYTHON": "apply._lane"}}


def drain_ours(source: Database, target: Database, end_lsn: str, contender: str = "applier") -> Drain:
    """A new ``applier run`` process, with nothing but its four settings, stopped (SIGTERM) once
    the slot confirmed the end; ``contender`` names it, and chooses its environment."""
    import threading

    command = [sys.executable, "-m", "applier", "run", "--source", source.dsn, "--target", target.dsn,
               "--slot", SLOT, "--publication", PUBLICATION]
    watch = DrainWatch(source, target, SLOT, end_lsn)
    stop = [False]
    first: list[float | None] = [None]
    started = watch.start()
    env = {**os.environ, **_ENVIRONMENT.get(contender, {})}
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    thread = threading.Thread(target=lambda: first.__setitem__(0, _watch_first_row(target, started, stop)))
    thread.start()
    watch.wait(timeout=600)
    stop[0] = True
    thread.join()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode != 0 or watch.visible is None or watch.confirmed is None:
        raise SystemExit(f"applier run failed (status {proc.returncode}):\n{err.decode()[-3000:]}")
    return Drain(contender, watch.visible, watch.confirmed, first[0])


def drain_native(source: Database, target: Database, end_lsn: str) -> Drain:
    with target.connect() as conn:
        conn.execute("DROP SUBSCRIPTION IF EXISTS catchup_native")
        conn.execute(sql.SQL(
            "CREATE SUBSCRIPTION catchup_native CONNECTION {} PUBLICATION {} WITH (copy_data = false, "
            "create_slot = false, enabled = false, slot_name = {}, streaming = parallel, "
            "synchronous_commit = off, binary = false)").format(
                sql.Literal(source.dsn), sql.Identifier(PUBLICATION), sql.Literal(SLOT)))
        watch = DrainWatch(source, target, SLOT, end_lsn)
        watch.start()
        conn.execute("ALTER SUBSCRIPTION catchup_native ENABLE")
        watch.wait(timeout=600)
        conn.execute("ALTER SUBSCRIPTION catchup_native DISABLE")
        while source.query("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))[0][0]:
            time.sleep(0.01)
        conn.execute("ALTER SUBSCRIPTION catchup_native SET (slot_name = NONE)")
        conn.execute("DROP SUBSCRIPTION catchup_native")
    if watch.visible is None or watch.confirmed is None:
        raise SystemExit("the native subscription did not drain the backlog in 600 s")
    return Drain("native", watch.visible, watch.confirmed)


def run_catchup(pg_version: int, scales: Sequence[int], clients: Sequence[int], repeat: int,
                transactions: int = 50_000, without_lane: bool = False) -> bool:
    """Every drain, contenders alternating; ``without_lane`` adds our worker with the lane off
    (``NO_LANE``) as a third. False when a target differed from the source."""
    source_server, target_server = servers(pg_version)
    contenders = ("native", "applier", *((NO_LANE,) if without_lane else ()))
    ok = True
    try:
        source = source_server.create_database("catchup")
        targets = {name: target_server.create_database("catchup_" + name.replace(" ", "_"))
                   for name in contenders}
        for scale in scales:
            for count in clients:
                drains: list[Drain] = []
                for _ in range(repeat):
                    for contender in contenders:
                        target = targets[contender]
                        end = _backlog(source, scale, count, transactions)
                        _prepare(target, scale)
                        checkpoint(source_server)
                        checkpoint(target_server)
                        drain = (drain_native(source, target, end) if contender == "native"
                                 else drain_ours(source, target, end, contender))
                        drain.equal = same(source, target, (*PGBENCH_TABLES, MARKER_TABLE))
                        ok &= drain.equal
                        drains.append(drain)
                        print(f"  scale {scale}, {count} clients, {contender}: visible {drain.visible:.2f} s, "
                              f"confirmed {drain.confirmed:.2f} s"
                              + (f", first row {drain.first_row:.2f} s" if drain.first_row else "")
                              + ("" if drain.equal else ", TARGET DIFFERS"), flush=True)
                _print(scale, count, drains, contenders[1:])
    finally:
        drop_applier_origins(target_server)
        source_server.cleanup()
        target_server.cleanup()
    print(f"load average at the end: {load_average()}")
    return ok


def _print(scale: int, clients: int, drains: list[Drain], ours: Sequence[str]) -> None:
    def each(contender: str, field: str) -> list[float]:
        return [getattr(d, field) for d in drains if d.contender == contender and getattr(d, field) is not None]

    print(f"catch-up, pgbench scale {scale}, {clients} clients, 50,000 transactions (medians; each run):")
    for field, label in (("visible", "until the last row is visible"),
                         ("confirmed", "until the slot confirmed the end")):
        native = each("native", field)
        print(f"  {label:<34} native {statistics.median(native):5.2f} s ({_list(native)})")
        for contender in ours:
            times = each(contender, field)
            ratio = statistics.median(native) / statistics.median(times)
            print(f"  {'':<34} {contender} {statistics.median(times):5.2f} s ({_list(times)})  "
                  f"ours/native {ratio:.2f}x")
    for contender in ours:
        first = each(contender, "first_row")
        if first:
            print(f"  {contender} start-up (start to first row visible): {statistics.median(first):.2f} s "
                  f"({_list(first)})")


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":  # pragma: no cover - use bench/apply.py --catchup
    os.execv(sys.executable, [sys.executable, str(ROOT / "bench" / "apply.py"), "--catchup", *sys.argv[1:]])
