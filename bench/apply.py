"""Apply throughput: applier against PostgreSQL's own subscriber, draining the same backlog.

Owns nothing the product uses; it only measures. One source and one target server (throwaway,
``applier.embedded``, the same settings for both contenders). For each workload it prepares a
fresh source database and two identical target databases, creates two slots at the same point,
writes the workload on the source (the backlog accumulates in both slots), then drains one slot
with ``applier run --exit-when-caught-up`` and the other with a native ``CREATE SUBSCRIPTION``
(``copy_data = false`` on the pre-made slot), verifies both targets equal the source, and prints
elapsed time, rows/s, transactions/s, ours/native, our worker's peak memory, and two physical
limits: the source's (decoding the same backlog from a third slot with
``pg_logical_slot_get_binary_changes``, sending and applying nothing) and the target's (binary
COPY of the same rows). It
also prints the CPU time each contender's drain cost the source's and the target's server
processes: the source's is almost all one walsender, a single process, so it is a floor for
the drain time of any subscriber. The applier package is byte-compiled first, as an installed
wheel is.

Each contender runs with its defaults: applier asks for binary values (``--binary auto``: every
table here has the same built-in types on both sides), the native subscription for text
(``binary = false``) unless ``--native-binary``. Both reach the source over TCP on 127.0.0.1, or
both through a Unix-domain socket with ``--unix-socket`` (README, "A source on the same host").

    .venv/bin/python bench/apply.py [--pg-version 18] [--scale 1.0] [--only oltp,bulk,...] [--repeat 3]
                                    [--native-binary] [--unix-socket]
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from applier.embedded import Database, LocalCluster, PostgresServer, ServerSettings, start_server  # noqa: E402
from applier.progress.store import make_engine, upgrade_schema  # noqa: E402

#: Durable targets, as in production: the commit path is part of what is measured.
#: track_commit_timestamp at PostgreSQL's default (off): the workloads load their starting rows
#: on each target locally, and with it on, both contenders would meet every first update of those
#: rows as an update of another origin's row (update_origin_differs), which a replica started by
#: applier sync never sees.
TARGET_SETTINGS = ServerSettings.target(fsync="on", full_page_writes="on",
                                        track_commit_timestamp="off")
SOURCE_SETTINGS = ServerSettings.source(max_wal_size="4GB")


@dataclass
class Workload:
    name: str
    setup_sql: str                       # schema and initial rows, run on the source and both targets
    write: Callable[[Database], None]    # the backlog, written on the source
    rows: int                            # row changes in the backlog
    transactions: int
    tables: tuple[str, ...]
    decoding_work_mem: str = "64MB"      # the walsender's logical_decoding_work_mem
    pgbench_init: bool = False


@dataclass
class Result:
    seconds: float
    peak_mb: float | None = None
    equal: bool = False
    # CPU seconds the source's and the target's server processes spent on this drain (None
    # where the servers run in containers): the source's is almost all one walsender, a single
    # process, so no subscriber can drain the backlog in less time than that.
    source_cpu: float | None = None
    target_cpu: float | None = None


def _exited_cpu(server: PostgresServer) -> float | None:
    """User + system CPU seconds of every process of ``server`` that has exited so far: backends,
    walsenders and apply workers are the postmaster's children, and the kernel adds each one's
    times to the postmaster's when it collects them. None when the postmaster is not a local
    process (the testcontainers backend)."""
    data_dir = getattr(server, "data_dir", None)  # LocalCluster only
    if data_dir is None:
        return None
    try:
        pid = int((Path(data_dir) / "postmaster.pid").read_text().split()[0])
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime + cstime


def _released(source: Database, slot: str) -> None:
    """Wait until no walsender holds ``slot`` (it exits once its client has gone), then give the
    postmaster a moment to collect it, so that its CPU time is counted."""
    while source.query("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,))[0][0]:
        time.sleep(0.01)
    time.sleep(0.2)


def _cpu_since(before: tuple[float | None, float | None], source: Database, target: Database
               ) -> tuple[float | None, float | None]:
    after = (_exited_cpu(source.cluster), _exited_cpu(target.cluster))
    return tuple(None if b is None or a is None else a - b  # type: ignore[return-value]
                 for b, a in zip(before, after))


def _pgbench(db: Database, *args: str) -> None:
    server = db.cluster
    subprocess.run([str(server.pgbench_path), *args, "-h", server.host, "-p", str(server.port),
                    "-U", "postgres", db.name], check=True, capture_output=True)


def workloads(scale: float) -> list[Workload]:
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

    return [
        Workload("oltp (pgbench TPC-B)", "", write_oltp, oltp * 4, oltp,
                 ("pgbench_accounts", "pgbench_tellers", "pgbench_branches", "pgbench_history"),
                 pgbench_init=True),
        Workload("bulk, 1 transaction", table, write_bulk, bulk, 1, ("items",), "1GB"),
        Workload("bulk, streamed", table, write_bulk, bulk, 1, ("items",), "1MB"),
        Workload("small transactions", "CREATE TABLE small (id bigserial PRIMARY KEY, note text)",
                 write_small, small, small, ("small",)),
        Workload("updates + deletes by key", table + ";" + fill.format(n=bulk), write_upddel,
                 bulk + bulk // 2, 2, ("items",)),
    ]


def _digest(db: Database, table: str) -> tuple[int, str]:
    row = db.query(f"SELECT count(*), coalesce(md5(string_agg(t::text, '|' ORDER BY t::text)), '') "
                   f"FROM {table} t")[0]
    return int(row[0]), str(row[1])


def _same(source: Database, target: Database, tables: Sequence[str]) -> bool:
    return all(_digest(source, t) == _digest(target, t) for t in tables)


def _with_work_mem(dsn: str, work_mem: str) -> str:
    return make_conninfo(dsn, options=f"-c logical_decoding_work_mem={work_mem}")


def stream_dsn(source: Database, unix_socket: bool) -> str:
    """The DSN the contenders stream ``source`` from: TCP, or the server's Unix-domain socket."""
    if not unix_socket:
        return source.dsn
    assert isinstance(source.cluster, LocalCluster)
    return source.cluster.socket_dsn(source.name)


def drain_ours(source: Database, source_dsn: str, target: Database, slot: str, work_mem: str) -> Result:
    command = [sys.executable, "-m", "applier", "run", "--source", _with_work_mem(source_dsn, work_mem),
               "--target", target.dsn, "--slot", slot, "--publication", "bench",
               "--exit-when-caught-up", "--log-level", "WARNING"]
    # The bookkeeping schema is made before the clock starts, as the native subscription is.
    upgrade_schema(make_engine(target.dsn))
    cpu = (_exited_cpu(source.cluster), _exited_cpu(target.cluster))
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT)
    peak_kb = 0
    while True:  # the peak resident size (VmHWM) as last seen before the worker exits
        peak_kb = max(peak_kb, _peak_kb(proc.pid))
        try:
            proc.wait(timeout=0.02)
            break
        except subprocess.TimeoutExpired:
            continue
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"applier run failed with status {proc.returncode}")
    _released(source, slot)
    source_cpu, target_cpu = _cpu_since(cpu, source, target)
    return Result(elapsed, peak_mb=peak_kb / 1024, source_cpu=source_cpu, target_cpu=target_cpu)


def _peak_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # just exited
        return 0
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), "VmHWM: 0 kB")
    return int(line.split()[1])


def drain_native(source: Database, source_dsn: str, target: Database, slot: str, work_mem: str,
                 end_lsn: str, binary: bool) -> Result:
    conninfo = _with_work_mem(source_dsn, work_mem)
    with target.connect() as conn:
        conn.execute(sql.SQL("CREATE SUBSCRIPTION bench_native CONNECTION {} PUBLICATION bench WITH "
                             "(create_slot = false, slot_name = {}, copy_data = false, enabled = false, "
                             "binary = {})")
                     .format(sql.Literal(conninfo), sql.Literal(slot), sql.Literal(binary)))
        origin = conn.execute("SELECT 'pg_' || oid FROM pg_subscription WHERE subname = 'bench_native'").fetchone()[0]
        cpu = (_exited_cpu(source.cluster), _exited_cpu(target.cluster))
        started = time.monotonic()
        conn.execute("ALTER SUBSCRIPTION bench_native ENABLE")
        while True:
            done = conn.execute("SELECT remote_lsn >= %s::pg_lsn FROM pg_replication_origin_status "
                                "WHERE external_id = %s", (end_lsn, origin)).fetchone()
            if done and done[0]:
                break
            time.sleep(0.02)
        elapsed = time.monotonic() - started
        conn.execute("ALTER SUBSCRIPTION bench_native DISABLE")
        _released(source, slot)
        source_cpu, target_cpu = _cpu_since(cpu, source, target)
        conn.execute("ALTER SUBSCRIPTION bench_native SET (slot_name = NONE)")
        conn.execute("DROP SUBSCRIPTION bench_native")
    return Result(elapsed, source_cpu=source_cpu, target_cpu=target_cpu)


def stream_protocol(pg_version: int) -> tuple[int, str]:
    """(proto_version, streaming) our worker asks of a source of this major version by default."""
    return (4, "parallel") if pg_version >= 16 else (3, "on")


def source_ceiling(source: Database, slot: str, work_mem: str, end_lsn: str, pg_version: int) -> float:
    """Seconds for the source alone to decode the backlog: ``pg_logical_slot_get_binary_changes``
    runs pgoutput over the slot with our worker's options (binary values: every bench table has
    the same built-in types on both sides) up to ``end_lsn`` in one backend, with
    no network and no client (a client such as pg_recvlogical, writing every message out, is
    itself slower than the native subscriber and would measure itself)."""
    proto, streaming = stream_protocol(pg_version)
    with source.connect() as conn:
        conn.execute(sql.SQL("SET logical_decoding_work_mem = {}").format(sql.Literal(work_mem)))
        started = time.monotonic()
        conn.execute("SELECT count(*) FROM pg_logical_slot_get_binary_changes(%s, %s::pg_lsn, NULL, "
                     "'proto_version', %s, 'publication_names', 'bench', 'streaming', %s, "
                     "'binary', 'true')",
                     (slot, end_lsn, str(proto), streaming))
        return time.monotonic() - started


def copy_ceiling(source: Database, target: Database, tables: Sequence[str]) -> tuple[float, int]:
    """(seconds, rows) to binary-COPY the source's rows of ``tables`` into empty copies on the target."""
    total = 0.0
    rows = 0
    with source.connect() as src, target.connect() as tgt:
        for table in tables:
            tgt.execute(f"CREATE TABLE ceiling_copy (LIKE {table} INCLUDING ALL)")
            data = bytearray()
            with src.cursor().copy(f"COPY {table} TO STDOUT (FORMAT binary)") as out:
                for chunk in out:
                    data += chunk
            started = time.monotonic()
            with tgt.transaction(), tgt.cursor().copy("COPY ceiling_copy FROM STDIN (FORMAT binary)") as into:
                into.write(bytes(data))
            total += time.monotonic() - started
            rows += tgt.execute("SELECT count(*) FROM ceiling_copy").fetchone()[0]
            tgt.execute("DROP TABLE ceiling_copy")
    return total, rows


def run_workload(workload: Workload, source_server: PostgresServer, target_server: PostgresServer,
                 index: int, pg_version: int, native_binary: bool, unix_socket: bool
                 ) -> tuple[Result, Result, float, tuple[float, int]]:
    source = source_server.create_database(f"bench_src_{index}")
    source_dsn = stream_dsn(source, unix_socket)
    ours = target_server.create_database(f"bench_ours_{index}")
    native = target_server.create_database(f"bench_native_{index}")
    for db in (source, ours, native):
        if workload.pgbench_init:
            _pgbench(db, "-i", "-s", "1", "-q")
        if workload.setup_sql:
            db.execute(workload.setup_sql)
    tables = ", ".join(workload.tables)
    source.execute(f"CREATE PUBLICATION bench FOR TABLE {tables}")
    source.execute("SELECT pg_create_logical_replication_slot('bench_ours', 'pgoutput')")
    source.execute("SELECT pg_create_logical_replication_slot('bench_native', 'pgoutput')")
    source.execute("SELECT pg_create_logical_replication_slot('bench_source', 'pgoutput')")
    print("  writing the backlog on the source ...", flush=True)
    workload.write(source)
    end_lsn = source.query("SELECT pg_current_wal_lsn()::text")[0][0]
    source.execute("CHECKPOINT")
    target_server_checkpoint(target_server)
    print("  draining with applier ...", flush=True)
    mine = drain_ours(source, source_dsn, ours, "bench_ours", workload.decoding_work_mem)
    target_server_checkpoint(target_server)
    print("  draining with CREATE SUBSCRIPTION ...", flush=True)
    theirs = drain_native(source, source_dsn, native, "bench_native", workload.decoding_work_mem,
                          end_lsn, native_binary)
    print("  decoding on the source alone ...", flush=True)
    alone = source_ceiling(source, "bench_source", workload.decoding_work_mem, end_lsn, pg_version)
    mine.equal = _same(source, ours, workload.tables)
    theirs.equal = _same(source, native, workload.tables)
    ceiling = copy_ceiling(source, ours, workload.tables)
    for db in (source, ours, native):
        db.cluster.drop_database(db.name)
    # Replication origins belong to the cluster, not the database: our worker's would outlive
    # it and, a run at a time, use up max_active_replication_origins (DROP SUBSCRIPTION drops
    # the native one).
    with psycopg.connect(target_server.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin "
                     "WHERE roname LIKE 'applier%'")
    return mine, theirs, alone, ceiling


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


def target_server_checkpoint(server: PostgresServer) -> None:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("CHECKPOINT")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-version", type=int, choices=(15, 18), default=18,
                        help="PostgreSQL major version of both servers (default 18; 15 streams with "
                             "protocol 3, 18 with protocol 4 and parallel streaming)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every workload's size (1.0 = the sizes in the issue)")
    parser.add_argument("--only", default="",
                        help="comma-separated workload name prefixes, e.g. 'oltp,small' (default: all)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each workload this many times (fresh databases each time) and "
                             "report the median of every figure: one run on a shared machine varies")
    parser.add_argument("--native-binary", action="store_true",
                        help="create the native subscription WITH (binary = true); its default is "
                             "false, while applier asks for binary values by default (--binary "
                             "auto) when, as here, every table has the same built-in types")
    parser.add_argument("--unix-socket", action="store_true",
                        help="both contenders stream from the source through its Unix-domain socket "
                             "instead of TCP on 127.0.0.1 (a subscriber on the source's own host); "
                             "needs the binaries backend, not containers")
    args = parser.parse_args(argv)
    chosen = [w for w in workloads(args.scale)
              if not args.only or any(w.name.startswith(p.strip()) for p in args.only.split(","))]
    # An installed wheel has its bytecode; a checkout may not (PYTHONDONTWRITEBYTECODE), and
    # compiling at every start would be measured as our start-up.
    compileall.compile_dir(str(ROOT / "applier"), quiet=1)
    print(f"starting PostgreSQL {args.pg_version} source and target ({os.cpu_count()} cores, "
          f"{transport(args.unix_socket)}) ...", flush=True)
    source_server = start_server(args.pg_version, SOURCE_SETTINGS, name="bench-apply-src",
                                 unix_socket=args.unix_socket)
    target_server = start_server(args.pg_version, TARGET_SETTINGS, name="bench-apply-tgt")
    rows = []
    try:
        index = 0
        for workload in chosen:
            print(f"{workload.name}: {workload.rows:,} row changes in {workload.transactions:,} transactions",
                  flush=True)
            runs = []
            for _ in range(args.repeat):
                runs.append(run_workload(workload, source_server, target_server, index, args.pg_version,
                                         args.native_binary, args.unix_socket))
                index += 1
            rows.append((workload, *_medians(runs)))
    finally:
        source_server.cleanup()
        target_server.cleanup()
    runs_note = f" (median of {args.repeat} runs)" if args.repeat > 1 else ""
    print(f"\nvalues: applier binary (--binary auto), native {'binary' if args.native_binary else 'text'} "
          f"(binary = {str(args.native_binary).lower()})")
    print(f"{'workload':<26} {'contender':<10} {'seconds':>8} {'rows/s':>10} {'txn/s':>9} "
          f"{'ours/native':>11} {'peak MB':>8} {'src CPU':>8} {'tgt CPU':>8} {'equal':>6}{runs_note}")
    ok = True
    for workload, mine, theirs, alone, ceiling in rows:
        for name, result in (("applier", mine), ("native", theirs)):
            ratio = f"{theirs.seconds / mine.seconds:.2f}x" if name == "applier" else ""
            peak = f"{result.peak_mb:.0f}" if result.peak_mb else ""
            print(f"{workload.name:<26} {name:<10} {result.seconds:>8.2f} "
                  f"{workload.rows / result.seconds:>10,.0f} {workload.transactions / result.seconds:>9,.0f} "
                  f"{ratio:>11} {peak:>8} {_seconds(result.source_cpu):>8} {_seconds(result.target_cpu):>8} "
                  f"{str(result.equal):>6}")
            ok &= result.equal
        print(f"{'':<26} {'source':<10} {alone:>8.2f} {workload.rows / alone:>10,.0f} "
              f"{workload.transactions / alone:>9,.0f}   (source's physical ceiling: decoding the "
              "backlog, nothing sent or applied)")
        seconds, copied = ceiling
        print(f"{'':<26} {'COPY':<10} {seconds:>8.2f} {copied / seconds if seconds else 0:>10,.0f}"
              f"   (target's physical ceiling: binary COPY of the {copied:,} final rows)")
    print("src CPU / tgt CPU: CPU seconds of the source's and the target's server processes during "
          "the drain; the source's is almost all its one walsender, so no subscriber drains faster")
    return 0 if ok else 1


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _median(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.median(values)  # type: ignore[type-var]


def _medians(runs: list[tuple[Result, Result, float, tuple[float, int]]]
             ) -> tuple[Result, Result, float, tuple[float, int]]:
    """Each figure's median over the runs; a contender is equal only if it was equal every time.
    Peak memory is the largest seen."""
    mine, theirs = (Result(statistics.median(r[i].seconds for r in runs),
                           peak_mb=max(r[i].peak_mb or 0 for r in runs) or None,
                           equal=all(r[i].equal for r in runs),
                           source_cpu=_median([r[i].source_cpu for r in runs]),
                           target_cpu=_median([r[i].target_cpu for r in runs])) for i in (0, 1))
    return (mine, theirs, statistics.median(r[2] for r in runs),
            (statistics.median(r[3][0] for r in runs), runs[0][3][1]))


if __name__ == "__main__":
    sys.exit(main())
