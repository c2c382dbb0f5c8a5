"""A source that fails over, for the tests of issue 41: a primary and its physical standby on this
machine (``applier.embedded.standby``), named together by one connection string, and the load
that runs on whichever is primary: pgbench, and a side load of large (streamed) and prepared
transactions that reconnects after a failover and finishes the prepared transactions the new
primary holds."""

from __future__ import annotations

import os
import random
import re
import subprocess
import threading
import time
from pathlib import Path

import psycopg

from applier.embedded import Database, LocalCluster, ServerSettings
from applier.embedded.standby import attach_standby, fail_over, new_standby, wait_synced

#: The versions the failover tests run on: those of APPLIER_TEST_PG_VERSIONS with failover slots
#: (17+), else 18.
FAILOVER_PG = [v for v in (int(x) for x in re.split(r"[,\s]+", os.environ.get(
    "APPLIER_TEST_PG_VERSIONS", "15,18").strip()) if x) if v >= 17] or [18]

SIDE_TABLES = """
CREATE TABLE side (id bigint PRIMARY KEY, n int NOT NULL, note text);
CREATE TABLE bulk (id bigint PRIMARY KEY, payload text NOT NULL);
"""
PGBENCH_TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history")
TABLES = PGBENCH_TABLES + ("side", "bulk")


class FailingSource:
    """Two local clusters, one primary and one standby at any time, and the database ``dbname``
    on them. ``dsn`` names both (the first listed is A, whichever role it has)."""

    def __init__(self, version: int, dbname: str = "app", protected: bool = True) -> None:
        self.dbname = dbname
        self.primary = LocalCluster.launch(version, ServerSettings.source(), name=f"fo{version}a")
        try:
            self.primary.create_database(dbname)
            self.standby = new_standby(self.primary, name=f"fo{version}b", protected=protected)
        except BaseException:
            self.primary.cleanup()
            raise
        self.first, self.second = self.primary, self.standby

    def url(self) -> str:
        """Both hosts, as a URL without target_session_attrs (applier asks for read-write)."""
        return (f"postgresql://postgres@127.0.0.1:{self.first.port},127.0.0.1:{self.second.port}/"
                f"{self.dbname}")

    def dsn(self) -> str:
        """Both hosts, as key=value with target_session_attrs, as the README shows it."""
        return (f"host=127.0.0.1,127.0.0.1 port={self.first.port},{self.second.port} user=postgres "
                f"dbname={self.dbname} target_session_attrs=read-write")

    def db(self) -> Database:
        """The database on whichever server is primary now."""
        return Database(self.dbname, self.dsn(), self.primary, self.primary.version)

    def fail_over(self) -> None:
        """Promote the standby, stop the old primary -m immediate."""
        fail_over(self.primary, self.standby)
        self.primary, self.standby = self.standby, self.primary

    def remake_standby(self, protected: bool = True) -> None:
        """The old primary, rebuilt as a standby of the new one."""
        attach_standby(self.primary, self.standby, protected=protected)

    def wait_synced(self, slot: str = "s") -> None:
        wait_synced(self.primary, self.standby, slot)

    def cleanup(self) -> None:
        for cluster in (self.first, self.second):
            cluster.cleanup()


class Pgbench:
    """pgbench (TPC-B, rate-limited) on whichever server is primary; after a failover its
    clients abort, and ``ensure_running`` starts it again."""

    def __init__(self, source: FailingSource) -> None:
        self.source = source
        self.path = str(source.primary.pgbench_path)
        self.proc: subprocess.Popen | None = None

    def initialise(self) -> None:
        subprocess.run([self.path, "-i", "-s", "1", "-q", self.source.dsn()], check=True,
                       capture_output=True)

    def ensure_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([self.path, "-n", "-c", "2", "-R", "100", "-T", "600",
                                          self.source.dsn()],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: see test_sync's note on SIGINT
            self.proc.wait(timeout=60)


class SideLoad(threading.Thread):
    """Small transactions, large ones the source streams, and prepared ones (some large, some
    rolled back), on one connection to whichever server is primary."""

    GID = "side_"

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.random = random.Random(seed)
        self.stop_event = threading.Event()
        self.next_id = 0
        self.committed = 0
        self.reconnects = 0
        self.rollback: set[str] = set()  # prepared GIDs this load meant to roll back
        self.error: BaseException | None = None

    def run(self) -> None:
        down_since: float | None = None
        while not self.stop_event.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                    down_since = None
                    finish_prepared(conn, self.GID, self.rollback)
                    while not self.stop_event.is_set():
                        self._one(conn)
                        time.sleep(0.05)  # ~15 transactions/s: the worker keeps up on 2 busy cores
            except psycopg.OperationalError:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > 120:
                    self.error = AssertionError("no primary for 120 s")
                    return
                self.reconnects += 1
                time.sleep(0.3)
            except BaseException as exc:  # surfaced by stop()
                self.error = exc
                return

    def _ids(self, count: int) -> tuple[int, int]:
        first = self.next_id + 1
        self.next_id += count
        return first, self.next_id

    def _one(self, conn: psycopg.Connection) -> None:
        roll = self.random.random()
        if roll < 0.1:  # large: streamed (over the source's 64kB logical_decoding_work_mem)
            first, last = self._ids(1000)
            with conn.transaction():
                conn.execute("INSERT INTO bulk SELECT g, repeat(md5(g::text), 3) "
                             "FROM generate_series(%s::bigint, %s::bigint) g", (first, last))
                low = self.random.randint(1, max(1, first - 50))
                conn.execute("UPDATE side SET n = n + 1 WHERE id BETWEEN %s AND %s", (low, low + 50))
        elif roll < 0.35:  # prepared (some large: streamed and prepared; some rolled back)
            gid = f"{self.GID}{self.next_id + 1}"
            first, last = self._ids(1000 if roll < 0.13 else 3)
            conn.execute("BEGIN")
            conn.execute("INSERT INTO bulk SELECT g, 'prepared ' || g FROM "
                         "generate_series(%s::bigint, %s::bigint) g", (first, last))
            conn.execute("INSERT INTO side VALUES (%s, 0, 'prepared')", (last,))
            conn.execute(f"PREPARE TRANSACTION '{gid}'")
            if self.random.random() < 0.2:
                self.rollback.add(gid)
            conn.execute(f"{'ROLLBACK' if gid in self.rollback else 'COMMIT'} PREPARED '{gid}'")
        else:
            first, last = self._ids(1)
            with conn.transaction():
                conn.execute("INSERT INTO side VALUES (%s, 1, 'small')", (first,))
                conn.execute("UPDATE side SET n = n + 1, note = 'updated' WHERE id = %s",
                             (self.random.randint(1, last),))
                if self.random.random() < 0.1:
                    conn.execute("DELETE FROM side WHERE id = %s", (self.random.randint(1, last),))
        self.committed += 1

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=60)
        assert self.error is None, self.error


def finish_prepared(conn: psycopg.Connection, prefix: str, rollback: set[str]) -> None:
    """Finish the transactions a load prepared and a failover left prepared on the new primary,
    as the load meant to (they hold locks its next transactions would wait on)."""
    for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s) "
                               "AND database = current_database()", (prefix,)).fetchall():
        conn.execute(f"{'ROLLBACK' if gid in rollback else 'COMMIT'} PREPARED '{gid}'")


def worker_log_tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""
