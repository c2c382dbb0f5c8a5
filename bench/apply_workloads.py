"""bench/apply.py's servers, workloads and small helpers, shared with bench/walsender.py.

Owns nothing the product uses; it only describes what the benchmarks write and where. The server
settings are the same for every contender; each workload is a backlog written on the source with
the tables it touches (``Workload``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from applier.embedded import Database, LocalCluster, PostgresServer, ServerSettings

#: Durable targets, as in production: the commit path is part of what is measured.
#: track_commit_timestamp at PostgreSQL's default (off): the workloads load their starting rows
#: on each target locally, and with it on, both contenders would meet every first update of those
#: rows as an update of another origin's row (update_origin_differs), which a replica started by
#: applier sync never sees.
TARGET_SETTINGS = ServerSettings.target(fsync="on", full_page_writes="on",
                                        track_commit_timestamp="off")
SOURCE_SETTINGS = ServerSettings.source(max_wal_size="4GB")

#: pgbench's tables, in the publication of every pgbench workload.
PGBENCH_TABLES = ("pgbench_accounts", "pgbench_tellers", "pgbench_branches", "pgbench_history")

#: The table of the marker row written after a detailed workload's backlog (``Workload.marker``):
#: the drain has made the last source transaction visible once this row is visible on the target.
MARKER_TABLE = "bench_marker"


@dataclass
class Workload:
    """One backlog: its schema and starting rows (on the source and every target), what writes
    it on the source, and its size."""

    name: str
    setup_sql: str                       # schema and initial rows, run on the source and both targets
    write: Callable[[Database], None]    # the backlog, written on the source
    rows: int                            # row changes in the backlog
    transactions: int
    tables: tuple[str, ...]
    decoding_work_mem: str = "64MB"      # the walsender's logical_decoding_work_mem
    pgbench_init: bool = False
    pgbench_scale: int = 1               # pgbench -i -s, where pgbench_init
    #: Detailed drain figures (time until the last row is visible and until the slot confirms,
    #: machine and per-process CPU, the pg_recvlogical floor): a marker row is written after the
    #: backlog, in a table of its own in the publication.
    marker: bool = False


def pgbench(db: Database, *args: str) -> str:
    """Run the server's pgbench against ``db``; its standard output."""
    server = db.cluster
    done = subprocess.run([str(server.pgbench_path), *args, "-h", server.host, "-p", str(server.port),
                           "-U", "postgres", db.name], check=True, capture_output=True, text=True)
    return done.stdout


def _pgbench(db: Database, *args: str) -> None:
    """pgbench, output discarded (the name bench/walsender.py imports)."""
    pgbench(db, *args)


def workloads(scale: float) -> list[Workload]:
    """Every workload of bench/apply.py, sized by ``scale`` (1.0: the sizes of issues 6 and 24)."""
    oltp = max(int(50_000 * scale), 100)
    bulk = max(int(1_000_000 * scale), 1000)
    small = max(int(100_000 * scale), 100)
    table = ("CREATE TABLE items (id int PRIMARY KEY, qty int NOT NULL, label text, "
             "seen timestamptz, price numeric(12, 2))")
    fill = ("INSERT INTO items SELECT g, g % 1000, 'item ' || g, timestamptz '2024-01-01' + g * "
            "interval '1 s', g / 100.0 FROM generate_series(1, {n}) g")

    def write_oltp(db: Database) -> None:
        _pgbench(db, "-n", "-c", "1", "-t", str(oltp))

    def write_bulk(db: Database) -> None:
        db.execute(fill.format(n=bulk))

    def write_small(db: Database) -> None:
        script = Path(os.environ.get("TMPDIR", "/tmp")) / "applier-bench-small.sql"
        script.write_text("INSERT INTO small (note) VALUES ('one row, one transaction');\n")
        _pgbench(db, "-n", "-c", "1", "-t", str(small), "-f", str(script))

    def write_upddel(db: Database) -> None:
        db.execute("UPDATE items SET qty = qty + 1, label = label || '+'")
        db.execute("DELETE FROM items WHERE id % 2 = 0")

    def clients(n: int) -> Workload:
        """pgbench TPC-B at scale 10 from ``n`` clients at once: their transactions interleave in
        the WAL, as in production, and the walsender decodes them in commit order."""
        per_client = max(oltp // n, 1)

        def write(db: Database) -> None:
            _pgbench(db, "-n", "-c", str(n), "-j", str(n), "-t", str(per_client))

        return Workload(f"pgbench {n} client{'s' if n > 1 else ''} (s10)", "", write,
                        per_client * n * 4, per_client * n, PGBENCH_TABLES, pgbench_init=True,
                        pgbench_scale=10, marker=True)

    return [
        Workload("oltp (pgbench TPC-B)", "", write_oltp, oltp * 4, oltp, PGBENCH_TABLES,
                 pgbench_init=True),
        Workload("bulk, 1 transaction", table, write_bulk, bulk, 1, ("items",), "1GB"),
        Workload("bulk, streamed", table, write_bulk, bulk, 1, ("items",), "1MB"),
        Workload("small transactions", "CREATE TABLE small (id bigserial PRIMARY KEY, note text)",
                 write_small, small, small, ("small",)),
        Workload("updates + deletes by key", table + ";" + fill.format(n=bulk), write_upddel,
                 bulk + bulk // 2, 2, ("items",)),
        clients(1),
        clients(4),
        clients(8),
    ]


def prepare(workload: Workload, db: Database) -> None:
    """The workload's schema and starting rows in ``db`` (the source or a target), with the
    marker table where the workload has one."""
    if workload.pgbench_init:
        _pgbench(db, "-i", "-s", str(workload.pgbench_scale), "-q")
    if workload.setup_sql:
        db.execute(workload.setup_sql)
    if workload.marker:
        db.execute(f"CREATE TABLE {MARKER_TABLE} (id int PRIMARY KEY)")


def published_tables(workload: Workload) -> tuple[str, ...]:
    """The tables of the workload's publication (its own, and the marker's)."""
    return workload.tables + ((MARKER_TABLE,) if workload.marker else ())


def digest(db: Database, table: str) -> tuple[int, str]:
    """(rows, md5 of every row in text order) of ``table``."""
    row = db.query(f"SELECT count(*), coalesce(md5(string_agg(t::text, '|' ORDER BY t::text)), '') "
                   f"FROM {table} t")[0]
    return int(row[0]), str(row[1])


def same(source: Database, target: Database, tables: Sequence[str]) -> bool:
    """Every table holds the same rows on both sides."""
    return all(digest(source, t) == digest(target, t) for t in tables)


def _with_work_mem(dsn: str, work_mem: str) -> str:
    """``dsn`` with the walsender's logical_decoding_work_mem set at connection."""
    return make_conninfo(dsn, options=f"-c logical_decoding_work_mem={work_mem}")


def stream_dsn(source: Database, unix_socket: bool) -> str:
    """The DSN the contenders stream ``source`` from: TCP, or the server's Unix-domain socket."""
    if not unix_socket:
        return source.dsn
    assert isinstance(source.cluster, LocalCluster)
    return source.cluster.socket_dsn(source.name)


def stream_protocol(pg_version: int) -> tuple[int, str]:
    """(proto_version, streaming) our worker asks of a source of this major version by default."""
    return (4, "parallel") if pg_version >= 16 else (3, "on")


def transport(unix_socket: bool) -> str:
    """How the stream reaches us, for the header: over TCP, with this machine's congestion control
    (the walsender's cost per message depends on it: README, "Why runs differ"), or through the
    source's Unix-domain socket."""
    if unix_socket:
        return "streaming through a Unix-domain socket"
    try:
        control = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        control = "unknown"
    return f"streaming over TCP, congestion control {control}"


def checkpoint(server: PostgresServer) -> None:
    """CHECKPOINT the whole server, so that no contender pays for the previous one's dirty pages."""
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("CHECKPOINT")


def drop_applier_origins(server: PostgresServer) -> None:
    """Drop our worker's replication origins on ``server``. They belong to the cluster, not the
    database: our worker's would outlive it and, a run at a time, use up
    max_active_replication_origins (DROP SUBSCRIPTION drops the native one)."""
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin "
                     "WHERE roname LIKE 'applier%'")
