"""bench/apply.py's drains: each contender drains the same backlog from its own slot.

Owns nothing the product uses; it only measures. For one workload, ``run_workload`` prepares a
fresh source database and two identical target databases, creates one slot per contender at the
same point, writes the backlog on the source, then drains one slot with ``applier run
--exit-when-caught-up``, another with a native ``CREATE SUBSCRIPTION`` (``copy_data = false`` on
the pre-made slot), and, for a detailed workload (``Workload.marker``), a third with
``pg_recvlogical`` writing to /dev/null (the walsender alone, sending to a client that applies
nothing). It verifies both targets against the source and measures the two physical ceilings
(the source decoding alone, a binary COPY into the target).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from apply_measure import MachineCpu, cores_busy, exited_cpu, peak_kb
from apply_workloads import (
    MARKER_TABLE,
    Workload,
    _with_work_mem,
    checkpoint,
    drop_applier_origins,
    prepare,
    published_tables,
    same,
    stream_dsn,
    stream_protocol,
)
from psycopg import sql

from applier.embedded import Database, PostgresServer
from applier.progress.schema import make_engine, upgrade_schema

ROOT = Path(__file__).resolve().parent.parent

#: How often the watch of a detailed drain looks at the target's marker row and the source's slot.
WATCH_INTERVAL = 0.01
#: How long a drain may wait for the slot's confirmed position after the last row is visible.
CONFIRM_TIMEOUT = 60.0


@dataclass
class Result:
    """One contender's drain. ``seconds`` is the classic figure: our process from start to exit,
    the native subscription from ENABLE until its origin has passed the end of the backlog."""

    seconds: float
    peak_mb: float | None = None
    equal: bool = False
    # CPU seconds the source's and the target's server processes spent on this drain (None
    # where the servers run in containers): the source's is almost all one walsender, a single
    # process, so no subscriber can drain the backlog in less time than that.
    source_cpu: float | None = None
    target_cpu: float | None = None
    # Detailed drains only (Workload.marker), from the start of the drain:
    visible: float | None = None     # seconds until the marker row (the last one) is visible on the target
    confirmed: float | None = None   # seconds until the slot's confirmed_flush_lsn passed the end of the backlog
    cores: float | None = None       # machine cores busy on average until the last row was visible
    worker_cpu: float | None = None  # our worker process's CPU seconds (user + system, start-up included)

    @property
    def gap(self) -> float | None:
        """Seconds from the last row visible to the slot confirming it."""
        return None if self.visible is None or self.confirmed is None else self.confirmed - self.visible


@dataclass
class Run:
    """Everything one run of a workload measured: our drain, the native one, the source decoding
    alone (seconds), the COPY ceiling (seconds, rows), and the pg_recvlogical floor (detailed
    workloads)."""

    mine: Result
    theirs: Result
    alone: float
    ceiling: tuple[float, int]
    floor: Result | None = None
    each: list[Run] = field(default_factory=list)  # for a median: the runs it is the median of
    baseline: Result | None = None  # our worker from another checkout (--baseline), same backlog
    feed: Result | None = None  # our worker with --change-feed all (--change-feed), same backlog
    baseline_feed: Result | None = None  # the --baseline checkout's worker with --change-feed all


class DrainWatch:
    """Looks every ``WATCH_INTERVAL`` at the target's marker row and the source's slot, from
    ``start`` on, and notes when the row became visible (with the machine's CPU counters then)
    and when the slot's confirmed_flush_lsn passed ``end_lsn``. Its connections are made before
    the clock starts; their backends never exit, so their CPU is in no contender's figures."""

    def __init__(self, source: Database, target: Database | None, slot: str, end_lsn: str) -> None:
        self._source = source.connect()
        self._target = target.connect() if target is not None else None
        self._slot = slot
        self._end = end_lsn
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-watch", daemon=True)
        self.started = 0.0
        self.machine_before: MachineCpu | None = None
        self.visible: float | None = None
        self.confirmed: float | None = None
        self.machine_at_visible: MachineCpu | None = None

    def start(self) -> float:
        """Start the clock (and the machine's CPU counters); returns the start time."""
        self.machine_before = MachineCpu.now()
        self.started = time.monotonic()
        self._thread.start()
        return self.started

    def _run(self) -> None:
        marker = sql.SQL("SELECT EXISTS (SELECT FROM {})").format(sql.Identifier(MARKER_TABLE))
        while not self._stop.is_set():
            if self.visible is None and self._target is not None:
                if self._target.execute(marker).fetchone()[0]:
                    now = time.monotonic()
                    self.machine_at_visible = MachineCpu.now()
                    self.visible = now - self.started
            if self.confirmed is None:
                passed = self._source.execute(
                    "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots "
                    "WHERE slot_name = %s", (self._end, self._slot)).fetchone()
                if passed and passed[0]:
                    self.confirmed = time.monotonic() - self.started
            if self.confirmed is not None and (self.visible is not None or self._target is None):
                self._done.set()
                return
            time.sleep(WATCH_INTERVAL)

    def wait(self, timeout: float = CONFIRM_TIMEOUT) -> None:
        """Wait until both have happened, or ``timeout``; then stop looking."""
        self._done.wait(timeout)
        self._stop.set()
        self._thread.join()
        self._source.close()
        if self._target is not None:
            self._target.close()

    def fill(self, result: Result) -> None:
        """Copy what was seen into ``result``."""
        result.visible, result.confirmed = self.visible, self.confirmed
        if self.visible is not None:
            result.cores = cores_busy(self.machine_before, self.machine_at_visible, self.visible)


def released(source: Database, slot: str) -> None:
    """Wait until no walsender holds ``slot`` (it exits once its client has gone), then give the
    postmaster a moment to collect it, so that its CPU time is counted."""
    while source.query("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,))[0][0]:
        time.sleep(0.01)
    time.sleep(0.2)


def _cpu_now(source: Database, target: Database) -> tuple[float | None, float | None]:
    return exited_cpu(source.cluster), exited_cpu(target.cluster)


def _cpu_since(before: tuple[float | None, float | None], source: Database, target: Database
               ) -> tuple[float | None, float | None]:
    after = _cpu_now(source, target)
    return tuple(None if b is None or a is None else a - b  # type: ignore[return-value]
                 for b, a in zip(before, after))


def worker_command(hooks: Path | None) -> tuple[list[str], dict[str, str]]:
    """How to start our worker: ``python -m applier``, or with ``hooks`` (a file to write them
    to) through bench/probe_hooks.py, which counts its commits and reads; and the environment
    to add."""
    if hooks is None:
        return [sys.executable, "-m", "applier"], {}
    return [sys.executable, str(ROOT / "bench" / "probe_hooks.py")], {"APPLIER_PROBE_OUT": str(hooks)}


_UPGRADE = """
import sys
try:
    from applier.progress.schema import make_engine, upgrade_schema
except ImportError:  # before the bookkeeping schema had a module of its own
    from applier.progress.store import make_engine, upgrade_schema
upgrade_schema(make_engine(sys.argv[1]))
"""


def bookkeeping(dsn: str, tree: Path = ROOT) -> None:
    """Create the bookkeeping schema in ``dsn`` before the clock starts, as the native subscription
    has its catalogs: with this checkout's code, or the one in ``tree`` (its own migrations)."""
    if tree == ROOT:
        upgrade_schema(make_engine(dsn))
    else:
        subprocess.run([sys.executable, "-c", _UPGRADE, dsn], cwd=tree, check=True)


def drain_ours(source: Database, source_dsn: str, target: Database, slot: str, work_mem: str,
               end_lsn: str, detailed: bool, hooks: Path | None = None, tree: Path = ROOT,
               extra: Sequence[str] = ()) -> Result:
    """``applier run --exit-when-caught-up`` on ``slot`` (with ``extra`` options), from process
    start to exit (the applier of the checkout in ``tree``: this one by default)."""
    start, env = worker_command(hooks)
    command = [*start, "run", "--source", _with_work_mem(source_dsn, work_mem),
               "--target", target.dsn, "--slot", slot, "--publication", "bench",
               "--exit-when-caught-up", "--log-level", "WARNING", *extra]
    bookkeeping(target.dsn, tree)
    watch = DrainWatch(source, target, slot, end_lsn) if detailed else None
    cpu = _cpu_now(source, target)
    started = watch.start() if watch is not None else time.monotonic()
    proc = subprocess.Popen(command, cwd=tree, env={**os.environ, **env})
    peak = 0
    while True:  # the peak resident size (VmHWM) as last seen before the worker exits
        peak = max(peak, peak_kb(proc.pid))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"applier run failed with status {proc.returncode}")
    if watch is not None:
        watch.wait()
    released(source, slot)
    source_cpu, target_cpu = _cpu_since(cpu, source, target)
    # Not ru_maxrss: it counts the fork of this process that ran until exec.
    result = Result(elapsed, peak_mb=peak / 1024, source_cpu=source_cpu,
                    target_cpu=target_cpu, worker_cpu=usage.ru_utime + usage.ru_stime)
    if watch is not None:
        watch.fill(result)
    return result


def drain_native(source: Database, source_dsn: str, target: Database, slot: str, work_mem: str,
                 end_lsn: str, binary: bool, detailed: bool) -> Result:
    """A native subscription on ``slot``, from ENABLE until its origin has passed ``end_lsn`` (and,
    for a detailed drain, until the slot confirmed it too)."""
    conninfo = _with_work_mem(source_dsn, work_mem)
    with target.connect() as conn:
        conn.execute(sql.SQL("CREATE SUBSCRIPTION bench_native CONNECTION {} PUBLICATION bench WITH "
                             "(create_slot = false, slot_name = {}, copy_data = false, enabled = false, "
                             "binary = {})")
                     .format(sql.Literal(conninfo), sql.Literal(slot), sql.Literal(binary)))
        origin = conn.execute("SELECT 'pg_' || oid FROM pg_subscription WHERE subname = 'bench_native'").fetchone()[0]
        watch = DrainWatch(source, target, slot, end_lsn) if detailed else None
        cpu = _cpu_now(source, target)
        started = watch.start() if watch is not None else time.monotonic()
        conn.execute("ALTER SUBSCRIPTION bench_native ENABLE")
        while True:
            done = conn.execute("SELECT remote_lsn >= %s::pg_lsn FROM pg_replication_origin_status "
                                "WHERE external_id = %s", (end_lsn, origin)).fetchone()
            if done and done[0]:
                break
            time.sleep(0.02)
        elapsed = time.monotonic() - started
        if watch is not None:
            watch.wait()
        conn.execute("ALTER SUBSCRIPTION bench_native DISABLE")
        released(source, slot)
        source_cpu, target_cpu = _cpu_since(cpu, source, target)
        conn.execute("ALTER SUBSCRIPTION bench_native SET (slot_name = NONE)")
        conn.execute("DROP SUBSCRIPTION bench_native")
    result = Result(elapsed, source_cpu=source_cpu, target_cpu=target_cpu)
    if watch is not None:
        watch.fill(result)
    return result


def drain_recvlogical(source: Database, source_dsn: str, target: Database, slot: str, work_mem: str,
                      end_lsn: str, pg_version: int) -> Result | None:
    """The walsender alone: ``pg_recvlogical`` drains ``slot`` up to ``end_lsn`` into /dev/null
    with the pgoutput options our worker uses (binary values), over the same transport. Seconds
    from process start to exit; ``worker_cpu`` is pg_recvlogical's own CPU. None where the
    server's binaries are not on this machine."""
    tool = Path(source.cluster.pgbench_path).with_name("pg_recvlogical")
    if not tool.exists():
        return None
    proto, streaming = stream_protocol(pg_version)
    command = [str(tool), "--dbname", _with_work_mem(source_dsn, work_mem), "--slot", slot,
               "--start", "--no-loop", "--file", "/dev/null", "--fsync-interval", "0",
               "--endpos", end_lsn, "--option", f"proto_version={proto}",
               "--option", "publication_names=bench", "--option", f"streaming={streaming}",
               "--option", "binary=true"]
    watch = DrainWatch(source, None, slot, end_lsn)
    cpu = _cpu_now(source, target)
    machine = MachineCpu.now()
    started = watch.start()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.monotonic() - started
    after = MachineCpu.now()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"pg_recvlogical failed with status {proc.returncode}")
    watch.wait(timeout=1.0)  # it reports its position at exit; the slot may not show it
    released(source, slot)
    source_cpu, _ = _cpu_since(cpu, source, target)
    return Result(elapsed, equal=True, source_cpu=source_cpu, confirmed=watch.confirmed,
                  cores=cores_busy(machine, after, elapsed),
                  worker_cpu=usage.ru_utime + usage.ru_stime)


def source_ceiling(source: Database, slot: str, work_mem: str, end_lsn: str, pg_version: int) -> float:
    """Seconds for the source alone to decode the backlog: ``pg_logical_slot_get_binary_changes``
    runs pgoutput over the slot with our worker's options (binary values: every bench table has
    the same built-in types on both sides) up to ``end_lsn`` in one backend, with
    no network and no client."""
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
                 index: int, pg_version: int, native_binary: bool, unix_socket: bool,
                 hooks_dir: Path | None = None, baseline: Path | None = None,
                 change_feed: bool = False) -> Run:
    """One run of ``workload``: fresh databases, the backlog, every drain, the checks; with
    ``hooks_dir``, our worker's counters (bench/probe_hooks.py) in a file there per run; with
    ``baseline``, one more drain by the applier of the checkout there; with ``change_feed``, one
    more drain of ours with ``--change-feed all`` (and with both, one of the baseline's with it)."""
    source = source_server.create_database(f"bench_src_{index}")
    source_dsn = stream_dsn(source, unix_socket)
    ours = target_server.create_database(f"bench_ours_{index}")
    native = target_server.create_database(f"bench_native_{index}")
    based = target_server.create_database(f"bench_base_{index}") if baseline is not None else None
    fed = target_server.create_database(f"bench_feed_{index}") if change_feed else None
    based_fed = (target_server.create_database(f"bench_base_feed_{index}")
                 if change_feed and baseline is not None else None)
    extra_targets = [db for db in (based, fed, based_fed) if db is not None]
    for db in (source, ours, native, *extra_targets):
        prepare(workload, db)
    detailed = workload.marker
    source.execute(f"CREATE PUBLICATION bench FOR TABLE {', '.join(published_tables(workload))}")
    for slot in (("bench_ours", "bench_native", "bench_source") + (("bench_recv",) if detailed else ())
                 + (("bench_base",) if baseline is not None else ())
                 + (("bench_feed",) if fed is not None else ())
                 + (("bench_base_feed",) if based_fed is not None else ())):
        source.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    print("  writing the backlog on the source ...", flush=True)
    workload.write(source)
    if detailed:  # the last row of the backlog: when it is visible, every earlier one is
        source.execute(f"INSERT INTO {MARKER_TABLE} VALUES (1)")
    end_lsn = source.query("SELECT pg_current_wal_lsn()::text")[0][0]
    source.execute("CHECKPOINT")
    checkpoint(target_server)
    print("  draining with applier ...", flush=True)
    hooks = None
    if hooks_dir is not None:
        hooks = hooks_dir / f"{''.join(c if c.isalnum() else '-' for c in workload.name)}-{index}.json"
    mine = drain_ours(source, source_dsn, ours, "bench_ours", workload.decoding_work_mem, end_lsn,
                      detailed, hooks)
    checkpoint(target_server)
    before = None
    if baseline is not None and based is not None:
        print(f"  draining with the applier in {baseline} ...", flush=True)
        before = drain_ours(source, source_dsn, based, "bench_base", workload.decoding_work_mem, end_lsn,
                            detailed, tree=baseline)
        checkpoint(target_server)
    feed = None
    if fed is not None:
        print("  draining with applier --change-feed all ...", flush=True)
        feed = drain_ours(source, source_dsn, fed, "bench_feed", workload.decoding_work_mem, end_lsn,
                          detailed, extra=("--change-feed", "all"))
        checkpoint(target_server)
    before_feed = None
    if based_fed is not None:
        print(f"  draining with the applier in {baseline} --change-feed all ...", flush=True)
        before_feed = drain_ours(source, source_dsn, based_fed, "bench_base_feed", workload.decoding_work_mem,
                                 end_lsn, detailed, tree=baseline, extra=("--change-feed", "all"))
        checkpoint(target_server)
    print("  draining with CREATE SUBSCRIPTION ...", flush=True)
    theirs = drain_native(source, source_dsn, native, "bench_native", workload.decoding_work_mem,
                          end_lsn, native_binary, detailed)
    floor = None
    if detailed:
        print("  draining with pg_recvlogical to /dev/null ...", flush=True)
        floor = drain_recvlogical(source, source_dsn, ours, "bench_recv", workload.decoding_work_mem,
                                  end_lsn, pg_version)
    print("  decoding on the source alone ...", flush=True)
    alone = source_ceiling(source, "bench_source", workload.decoding_work_mem, end_lsn, pg_version)
    tables = published_tables(workload)
    mine.equal = same(source, ours, tables)
    theirs.equal = same(source, native, tables)
    if before is not None and based is not None:
        before.equal = same(source, based, tables)
    if feed is not None and fed is not None:
        feed.equal = same(source, fed, tables)
    if before_feed is not None and based_fed is not None:
        before_feed.equal = same(source, based_fed, tables)
    ceiling = copy_ceiling(source, ours, workload.tables)
    for db in (source, ours, native, *extra_targets):
        db.cluster.drop_database(db.name)
    drop_applier_origins(target_server)
    return Run(mine, theirs, alone, ceiling, floor, baseline=before, feed=feed, baseline_feed=before_feed)


def _median(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.median(values)  # type: ignore[type-var]


def _median_result(results: list[Result]) -> Result:
    """Each figure's median; equal only if equal every time; peak memory the largest seen."""
    merged = {f.name: _median([getattr(r, f.name) for r in results])
              for f in dataclasses.fields(Result) if f.name not in ("peak_mb", "equal")}
    return Result(**merged, peak_mb=max(r.peak_mb or 0 for r in results) or None,  # type: ignore[arg-type]
                  equal=all(r.equal for r in results))


def medians(runs: list[Run]) -> Run:
    """Each figure's median over the runs (``_median_result``)."""
    floors = [r.floor for r in runs if r.floor is not None]
    baselines = [r.baseline for r in runs if r.baseline is not None]
    feeds = [r.feed for r in runs if r.feed is not None]
    based_feeds = [r.baseline_feed for r in runs if r.baseline_feed is not None]
    return Run(_median_result([r.mine for r in runs]), _median_result([r.theirs for r in runs]),
               statistics.median(r.alone for r in runs),
               (statistics.median(r.ceiling[0] for r in runs), runs[0].ceiling[1]),
               _median_result(floors) if floors else None, runs,
               _median_result(baselines) if baselines else None,
               _median_result(feeds) if feeds else None,
               _median_result(based_feeds) if based_feeds else None)


def _contenders(run: Run) -> list[tuple[str, Result]]:
    """The drains of one run that are printed, ours first."""
    shown = [("applier", run.mine), ("native", run.theirs)]
    if run.baseline is not None:
        shown.insert(1, ("baseline", run.baseline))
    if run.feed is not None:
        shown.insert(1, ("+feed", run.feed))
    if run.baseline_feed is not None:
        shown.insert(-1, ("base+feed", run.baseline_feed))
    return shown


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_table(rows: list[tuple[Workload, Run]], repeat: int, native_binary: bool) -> bool:
    """The classic table (every workload), then the detailed one (workloads with a marker);
    True if every target equalled its source."""
    runs_note = f" (median of {repeat} runs)" if repeat > 1 else ""
    print(f"\nvalues: applier binary (--binary auto), native {'binary' if native_binary else 'text'} "
          f"(binary = {str(native_binary).lower()})")
    print(f"{'workload':<26} {'contender':<10} {'seconds':>8} {'rows/s':>10} {'txn/s':>9} "
          f"{'ours/native':>11} {'peak MB':>8} {'src CPU':>8} {'tgt CPU':>8} {'wkr CPU':>8} "
          f"{'equal':>6}{runs_note}")
    ok = True
    for workload, run in rows:
        theirs = run.theirs
        for name, result in _contenders(run):
            ratio = f"{theirs.seconds / result.seconds:.2f}x" if name != "native" else ""
            peak = f"{result.peak_mb:.0f}" if result.peak_mb else ""
            print(f"{workload.name:<26} {name:<10} {result.seconds:>8.2f} "
                  f"{workload.rows / result.seconds:>10,.0f} {workload.transactions / result.seconds:>9,.0f} "
                  f"{ratio:>11} {peak:>8} {_seconds(result.source_cpu):>8} {_seconds(result.target_cpu):>8} "
                  f"{_seconds(result.worker_cpu) if name != 'native' else '':>8} {str(result.equal):>6}")
            ok &= result.equal
        if run.feed is not None:
            print(f"{'':<26} {'+feed':<10} {run.feed.seconds / run.mine.seconds:>7.2f}x  (the drain "
                  "with --change-feed all over the plain one: what recording every change costs)")
        if run.baseline_feed is not None and run.baseline is not None:
            print(f"{'':<26} {'base+feed':<10} {run.baseline_feed.seconds / run.baseline.seconds:>7.2f}x  "
                  "(the same for the --baseline checkout)")
        alone = run.alone
        print(f"{'':<26} {'source':<10} {alone:>8.2f} {workload.rows / alone:>10,.0f} "
              f"{workload.transactions / alone:>9,.0f}   (source's physical ceiling: decoding the "
              "backlog, nothing sent or applied)")
        seconds, copied = run.ceiling
        print(f"{'':<26} {'COPY':<10} {seconds:>8.2f} {copied / seconds if seconds else 0:>10,.0f}"
              f"   (target's physical ceiling: binary COPY of the {copied:,} final rows)")
    print("src CPU / tgt CPU: CPU seconds of the source's and the target's server processes during "
          "the drain; the source's is almost all its one walsender, so no subscriber drains faster; "
          "wkr CPU: our worker process's (start-up included)")
    detailed = [(w, r) for w, r in rows if w.marker]
    if detailed:
        _print_details(detailed, runs_note)
    return ok


def _print_details(rows: list[tuple[Workload, Run]], runs_note: str) -> None:
    print(f"\n{'detailed drains':<26} {'contender':<15} {'visible s':>9} {'confirmed s':>11} "
          f"{'gap s':>6} {'cores':>6} {'worker CPU':>10} {'tgt CPU':>8} {'src CPU':>8} "
          f"{'peak MB':>8}{runs_note}")
    for workload, run in rows:
        for name, result in _contenders(run):
            peak = f"{result.peak_mb:.0f}" if result.peak_mb else ""
            worker = _seconds(result.worker_cpu) if name != "native" else "(in tgt)"
            print(f"{workload.name:<26} {name:<15} {_seconds(result.visible):>9} "
                  f"{_seconds(result.confirmed):>11} {_seconds(result.gap):>6} {_seconds(result.cores):>6} "
                  f"{worker:>10} {_seconds(result.target_cpu):>8} {_seconds(result.source_cpu):>8} {peak:>8}")
        floor = run.floor
        if floor is not None:
            print(f"{'':<26} {'pg_recvlogical':<15} {floor.seconds:>9.2f} {_seconds(floor.confirmed):>11} "
                  f"{'':>6} {_seconds(floor.cores):>6} {_seconds(floor.worker_cpu):>10} {'':>8} "
                  f"{_seconds(floor.source_cpu):>8}")
        if len(run.each) > 1:
            def each(pick: str, runs: list = run.each) -> str:  # type: ignore[type-arg]
                return "; ".join(f"{name} " + ", ".join(_seconds(getattr(getattr(r, attr), pick))
                                                         for r in runs)
                                 for name, attr in (("applier", "mine"), ("native", "theirs"),
                                                    ("baseline", "baseline"), ("+feed", "feed"),
                                                    ("base+feed", "baseline_feed"))
                                 if getattr(runs[0], attr) is not None)
            print(f"{'':<26} each run, visible s: {each('visible')}")
            print(f"{'':<26} each run, confirmed s: {each('confirmed')}")
        if run.theirs.visible and run.mine.visible:
            print(f"{'':<26} ours / native: visible {run.theirs.visible / run.mine.visible:.2f}x"
                  + (f", confirmed {run.theirs.confirmed / run.mine.confirmed:.2f}x"
                     if run.theirs.confirmed and run.mine.confirmed else ""))
    print("visible: from the start of the drain (our process's start; the native ENABLE) until the "
          "backlog's last row is visible on the target (a marker row written after it, looked for "
          f"every {WATCH_INTERVAL * 1000:g} ms); confirmed: until the slot's confirmed_flush_lsn "
          "passed the source's WAL position after the backlog; gap: confirmed - visible; cores: the "
          "machine's cores busy on average until visible (every process on the machine); worker "
          "CPU: our process's user + system CPU (the native apply worker is a target process); "
          "pg_recvlogical: the walsender alone sending the same backlog to a client that writes it "
          "to /dev/null (its 'visible s' is its run time, 'worker CPU' its own CPU)")
