"""Where the time goes in one of bench/apply.py's drains: several drains of one backlog, probed.

Owns nothing the product uses; it only measures. One throwaway source and target (the settings
of bench/apply.py), one backlog (``--workload``, default the 4-client pgbench drain), one slot
per drain, and a fresh target database per drain with the same starting rows. Each drain in
``--variants`` is one of:

* ``plain``: ``applier run --exit-when-caught-up``, timed only;
* ``waits``: the same, with the target's ``pg_stat_activity`` (our sessions) and the source
  walsender's wait events sampled every ``--interval`` ms;
* ``hooks``: the worker run through ``bench/probe_hooks.py``, which counts and times its commits,
  durable WAL flushes, reads and the lane;
* ``pyspy``: the worker under ``py-spy record --idle --nonblocking`` (``--rate`` Hz), collapsed
  stacks summed by function;
* ``strace``: the worker under ``strace -c -f`` (system calls counted and timed);
* ``statements``: our worker with the target's ``pg_stat_statements`` on for its sessions (the
  target server then loads the module, tracking nothing for any other drain), the statements
  that took the most time summed up;
* ``native`` / ``native-waits``: a native subscription, timed / with its apply worker's and
  walsender's wait events sampled.

A variant may carry environment for our worker after ``@``, ``;``-separated (``plain@X=1``), to
try an experimental change to the worker in the same run as the code without it.

For every drain it prints the time until the last row is visible, our process's run time and
CPU, the walsender's and the target's CPU, target commits (``pg_stat_database.xact_commit``) and
WAL flushes (``pg_stat_io`` fsyncs of WAL from PostgreSQL 18; ``pg_stat_wal.wal_sync`` before),
and the vacuums and analyzes autovacuum ran on the target database's tables meanwhile (their CPU is
in the target's).

    .venv/bin/python bench/apply_probe.py [--workload "pgbench 4"] [--variants plain,waits,hooks,native]
"""

from __future__ import annotations

import argparse
import collections
import compileall
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply_drain import DrainWatch, released  # noqa: E402
from apply_measure import exited_cpu, load_average  # noqa: E402
from apply_workloads import (  # noqa: E402
    MARKER_TABLE,
    SOURCE_SETTINGS,
    TARGET_SETTINGS,
    Workload,
    _with_work_mem,
    checkpoint,
    drop_applier_origins,
    prepare,
    published_tables,
    same,
    workloads,
)
from probe_hooks import summary  # noqa: E402
from psycopg import sql  # noqa: E402

from applier.embedded import Database, PostgresServer, start_server  # noqa: E402
from applier.progress.schema import make_engine, upgrade_schema  # noqa: E402


@dataclass
class Probe:
    """What one drain measured."""

    variant: str
    visible: float | None = None
    seconds: float = 0.0
    worker_cpu: float | None = None
    walsender_cpu: float | None = None
    target_cpu: float | None = None
    commits: int | None = None
    wal_fsyncs: int | None = None
    autovacuums: tuple[int, int] = (0, 0)   # (vacuums, analyzes) autovacuum ran on the target's tables
    equal: bool = False
    waits: dict[str, collections.Counter[str]] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)


class WaitSampler:
    """Samples, every ``interval`` seconds in a thread, the wait events of the target's sessions
    in one database (by application name, or the apply worker's backend type) and of the
    walsender holding ``slot``."""

    def __init__(self, source: Database, target: Database, slot: str, interval: float) -> None:
        self._source, self._target = source.connect(), target.connect()
        self._slot, self._dbname, self._interval = slot, target.name, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for role, state, kind, event in self._target.execute(
                    "SELECT coalesce(nullif(application_name, ''), backend_type), state, "
                    "wait_event_type, wait_event FROM pg_stat_activity WHERE datname = %s "
                    "AND pid <> pg_backend_pid() AND backend_type <> 'autovacuum worker'",
                    (self._dbname,)):
                self.counts[f"target: {role}"][_wait(state, kind, event)] += 1
            for state, kind, event in self._source.execute(
                    "SELECT a.state, a.wait_event_type, a.wait_event FROM pg_replication_slots s "
                    "JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = %s",
                    (self._slot,)):
                self.counts["source: walsender"][_wait(state, kind, event)] += 1
            time.sleep(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._source.close()
        self._target.close()


def _wait(state: str | None, kind: str | None, event: str | None) -> str:
    if kind is None:
        return "on CPU" if state != "idle" else "idle"
    return f"{kind}:{event}" + (" (idle)" if state == "idle" else "")


def _statements(target: Database, top: int = 15) -> list[str]:
    """The target statements of the drain that took the most time, from pg_stat_statements."""
    rows = target.query(
        "SELECT calls, total_exec_time, rows, regexp_replace(query, '\\s+', ' ', 'g') "
        "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
        "WHERE datname = current_database()) ORDER BY total_exec_time DESC")
    total = sum(float(r[1]) for r in rows)
    lines = [f"pg_stat_statements: {total:.0f} ms in {sum(int(r[0]) for r in rows)} calls; the most:"]
    lines += [f"  {float(ms):9.1f} ms {int(calls):7d} calls {int(n):9d} rows  {query[:110]}"
              for calls, ms, n, query in rows[:top]]
    return lines


def _target_counters(target: Database) -> tuple[int, int | None, tuple[int, int]]:
    """(commits in the target database, WAL fsyncs of the whole target server, (autovacuums,
    autoanalyzes) of the target database's tables) so far."""
    with target.connect() as conn:
        commits = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                               (target.name,)).fetchone()[0]
        vacuums, analyzes = conn.execute(
            "SELECT coalesce(sum(autovacuum_count), 0)::int, coalesce(sum(autoanalyze_count), 0)::int "
            "FROM pg_stat_user_tables").fetchone()
        if target.version >= 18:
            fsyncs = conn.execute("SELECT sum(fsyncs)::bigint FROM pg_stat_io WHERE object = 'wal'"
                                  ).fetchone()[0]
        else:
            fsyncs = conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()[0]
    return int(commits), None if fsyncs is None else int(fsyncs), (vacuums, analyzes)


def _parse(variant: str) -> tuple[str, dict[str, str]]:
    kind, _, assignments = variant.partition("@")
    env = dict(a.split("=", 1) for a in assignments.split(";") if a)
    return kind, env


def drain(variant: str, source: Database, target: Database, slot: str, work_mem: str, end_lsn: str,
          tables: Sequence[str], interval: float, rate: int, out_dir: Path, marker: bool) -> Probe:
    """One probed drain of ``slot`` into ``target`` (``marker``: the workload writes the marker row,
    so the time its last row became visible is known; otherwise only until the slot is confirmed)."""
    kind, env = _parse(variant)
    probe = Probe(variant)
    native = kind.startswith("native")
    sampler = WaitSampler(source, target, slot, interval) if kind in ("waits", "native-waits") else None
    if not native:
        upgrade_schema(make_engine(target.dsn))
    if kind == "statements":
        target.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        target.execute("SELECT pg_stat_statements_reset()")
        env["PGOPTIONS"] = f"{env.get('PGOPTIONS', '')} -c pg_stat_statements.track=top".strip()
    watch = DrainWatch(source, target if marker else None, slot, end_lsn)
    time.sleep(1.5)  # the statistics of the set-up have been reported
    commits, fsyncs, autovacuums = _target_counters(target)
    cpu = (exited_cpu(source.cluster), exited_cpu(target.cluster))
    dsn = _with_work_mem(source.dsn, work_mem)
    if sampler is not None:
        sampler.start()
    started = watch.start()
    if native:
        target.execute(sql.SQL("CREATE SUBSCRIPTION probe CONNECTION {} PUBLICATION bench WITH "
                               "(create_slot = false, slot_name = {}, copy_data = false)")
                       .format(sql.Literal(dsn), sql.Literal(slot)))
        watch.wait()
        probe.seconds = time.monotonic() - started
        target.execute("ALTER SUBSCRIPTION probe DISABLE")
    else:
        command = [sys.executable, "-m", "applier"]
        if kind == "hooks":
            command = [sys.executable, str(ROOT / "bench" / "probe_hooks.py")]
            env["APPLIER_PROBE_OUT"] = str(out_dir / "hooks.json")
        command += ["run", "--source", dsn, "--target", target.dsn, "--slot", slot,
                    "--publication", "bench", "--exit-when-caught-up", "--log-level", "WARNING"]
        if kind == "pyspy":
            command = [str(Path(sys.executable).with_name("py-spy")), "record", "--idle", "--nonblocking",
                       "--rate", str(rate), "--format", "raw", "--output", str(out_dir / "pyspy.txt"),
                       "--", *command]
        elif kind == "strace":
            command = ["strace", "-c", "-f", "-o", str(out_dir / "strace.txt"), *command]
        proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env},
                                stdout=subprocess.DEVNULL if kind == "pyspy" else None)
        _, status, usage = os.wait4(proc.pid, 0)
        probe.seconds = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{variant}: exited with status {proc.returncode}")
        probe.worker_cpu = usage.ru_utime + usage.ru_stime  # strace's and py-spy's own included
        watch.wait()
    probe.visible = watch.visible
    if sampler is not None:
        sampler.stop()
        probe.waits = dict(sampler.counts)
    released(source, slot)
    after = (exited_cpu(source.cluster), exited_cpu(target.cluster))
    probe.walsender_cpu = None if None in (cpu[0], after[0]) else after[0] - cpu[0]  # type: ignore[operator]
    probe.target_cpu = None if None in (cpu[1], after[1]) else after[1] - cpu[1]  # type: ignore[operator]
    time.sleep(1.5)  # the backends' and the WAL writer's statistics have been reported
    commits_after, fsyncs_after, autovacuums_after = _target_counters(target)
    probe.commits = commits_after - commits
    probe.autovacuums = (autovacuums_after[0] - autovacuums[0], autovacuums_after[1] - autovacuums[1])
    probe.wal_fsyncs = None if fsyncs is None or fsyncs_after is None else fsyncs_after - fsyncs
    if native:
        target.execute("ALTER SUBSCRIPTION probe SET (slot_name = NONE)")
        target.execute("DROP SUBSCRIPTION probe")
    probe.equal = same(source, target, tables)
    probe.extra = _statements(target) if kind == "statements" else _details(kind, out_dir)
    return probe


def _details(kind: str, out_dir: Path) -> list[str]:
    """What the hooks, py-spy or strace wrote, summed up."""
    if kind == "hooks":
        return summary(json.loads((out_dir / "hooks.json").read_text()))
    if kind == "pyspy":
        return _pyspy_summary(out_dir / "pyspy.txt")
    if kind == "strace":
        text = (out_dir / "strace.txt").read_text().splitlines()
        return [line for line in text[:14] if line.strip()]
    return []


def _pyspy_summary(path: Path, top: int = 25) -> list[str]:
    """Samples by the innermost frame of ours (``applier/``), and by leaf function overall."""
    ours: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        leaves[_short(frames[-1])] += n
        mine = [f for f in frames if "applier/" in f]
        ours[_short(mine[-1]) if mine else "(not in applier/)"] += n
    lines = [f"{total} samples; by innermost applier/ frame:"]
    lines += [f"  {n / total:6.1%} {name}" for name, n in ours.most_common(top)]
    lines.append("by leaf frame:")
    lines += [f"  {n / total:6.1%} {name}" for name, n in leaves.most_common(top)]
    return lines


def _short(frame: str) -> str:
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    for marker in ("applier/", "site-packages/", "lib/python"):
        if marker in where:
            where = where[where.index(marker):]
            break
    return f"{name} ({where})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="pgbench 4",
                        help="name prefix of one of bench/apply.py's workloads (default: 'pgbench 4', "
                             "the 4-client drain)")
    parser.add_argument("--variants", default="plain,waits,hooks,native,native-waits",
                        help="comma-separated drains of the same backlog, in order: plain, waits, "
                             "hooks, pyspy, strace, statements, native, native-waits; "
                             "'kind@NAME=value;...' "
                             "runs our worker with that environment (default "
                             "plain,waits,hooks,native,native-waits)")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="milliseconds between wait-event samples (default 5)")
    parser.add_argument("--rate", type=int, default=250,
                        help="py-spy samples per second (default 250)")
    parser.add_argument("--pg-version", type=int, choices=(15, 18), default=18,
                        help="PostgreSQL major version of both servers (default 18)")
    parser.add_argument("--keep", default="",
                        help="directory to keep the raw py-spy, strace and hooks output in "
                             "(default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    workload: Workload | None = next((w for w in workloads(1.0) if w.name.startswith(args.workload)), None)
    if workload is None:
        parser.error(f"no workload named {args.workload!r}; see bench/apply.py")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    compileall.compile_dir(str(ROOT / "applier"), quiet=1)
    out_root = Path(args.keep or tempfile.mkdtemp(prefix="applier-probe-"))
    print(f"starting PostgreSQL {args.pg_version} ({os.cpu_count()} cores; load average "
          f"{load_average()}) ...", flush=True)
    source_server: PostgresServer = start_server(args.pg_version, SOURCE_SETTINGS, name="bench-probe-src")
    target_settings = TARGET_SETTINGS
    if any(_parse(v)[0] == "statements" for v in variants):
        target_settings = replace(TARGET_SETTINGS, values={
            **TARGET_SETTINGS.values, "shared_preload_libraries": "pg_stat_statements",
            "pg_stat_statements.track": "none"})
    target_server: PostgresServer = start_server(args.pg_version, target_settings, name="bench-probe-tgt")
    probes: list[Probe] = []
    try:
        source = source_server.create_database("probe_src")
        prepare(workload, source)
        tables = published_tables(workload)
        source.execute(f"CREATE PUBLICATION bench FOR TABLE {', '.join(tables)}")
        slots = [f"probe_{i}" for i in range(len(variants))]
        for slot in slots:
            source.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        print(f"writing {workload.name} ...", flush=True)
        workload.write(source)
        if workload.marker:
            source.execute(f"INSERT INTO {MARKER_TABLE} VALUES (1)")
        end_lsn = source.query("SELECT pg_current_wal_lsn()::text")[0][0]
        source.execute("CHECKPOINT")
        for index, (variant, slot) in enumerate(zip(variants, slots)):
            target = target_server.create_database(f"probe_tgt_{index}")
            prepare(workload, target)
            checkpoint(target_server)
            out_dir = out_root / f"{index}-{_parse(variant)[0]}"
            out_dir.mkdir(parents=True, exist_ok=True)
            print(f"draining: {variant} (load average {load_average()}) ...", flush=True)
            probes.append(drain(variant, source, target, slot, workload.decoding_work_mem, end_lsn,
                                tables, args.interval / 1000, args.rate, out_dir, workload.marker))
            target_server.drop_database(target.name)
            drop_applier_origins(target_server)
    finally:
        source_server.cleanup()
        target_server.cleanup()
        if not args.keep:
            shutil.rmtree(out_root, ignore_errors=True)
    print(f"\n{workload.name}: {workload.transactions:,} transactions (load average {load_average()})")
    for probe in probes:
        def s(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.2f}"
        print(f"{probe.variant}: visible {s(probe.visible)} s, run {probe.seconds:.2f} s, worker CPU "
              f"{s(probe.worker_cpu)}, walsender CPU {s(probe.walsender_cpu)}, target CPU "
              f"{s(probe.target_cpu)}, target commits {probe.commits}, WAL fsyncs {probe.wal_fsyncs}, "
              f"autovacuum {probe.autovacuums[0]} vacuums and {probe.autovacuums[1]} analyzes, "
              f"equal {probe.equal}")
        for who, counts in sorted(probe.waits.items()):
            total = sum(counts.values())
            print(f"  {who} ({total} samples): " + ", ".join(
                f"{event} {n / total:.0%}" for event, n in counts.most_common(8)))
        for line in probe.extra:
            print(f"  {line}")
    return 0 if all(p.equal for p in probes) else 1


if __name__ == "__main__":
    sys.exit(main())
