"""bench/apply.py --sustained: replication lag while the source writes at fixed rates.

Owns nothing the product uses; it only measures. Each contender gets a fresh source database
and a fresh target database (pgbench scale 10 on both, identical starting rows) and its own slot;
our worker (``applier run``, no --exit-when-caught-up) or a native subscription is started and
left to catch up; then, for each rate, pgbench writes TPC-B transactions from several clients at
that rate (pgbench ``--rate``; "max" for no limit) for ``--duration`` seconds, and the
contender is left to catch up again before the next rate.

Lag, the one definition for both contenders: a heartbeat row on the source (its own table, in
the publication) is updated every 50 ms with the source's ``clock_timestamp()``; every 100 ms (at
a random moment of the period, so that the samples do not lock onto the heartbeat's phase) the
target is asked for its ``clock_timestamp()`` and the heartbeat it shows. Both servers run on this
machine, with one clock. A sample's lag is the age of the oldest heartbeat written on the source
and not yet visible on the target (0 when the target shows the last one written): how long the
oldest change still missing on the target has been waiting, to within the 50 ms between
heartbeats, and unaffected by a heartbeat written late (on a busy machine the writer itself
waits for a core). "age" is the other common definition, the age of the newest heartbeat the
target shows: it adds the time since that heartbeat was written (0-50 ms, more when the writer
is late). Samples are taken while pgbench runs. CPU figures cover pgbench's run and the catch-up
after it, divided by the transactions pgbench wrote.
"""

from __future__ import annotations

import functools
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from apply_drain import bookkeeping, released, worker_command
from apply_measure import MachineCpu, cores_busy, delta, load_average, process_cpu, server_cpu
from apply_workloads import PGBENCH_TABLES, _with_work_mem, digest, drop_applier_origins, pgbench, stream_dsn
from psycopg import sql

from applier.embedded import Database, PostgresServer

ROOT = Path(__file__).resolve().parent.parent

HEARTBEAT_TABLE = "bench_heartbeat"
HEARTBEAT_INTERVAL = 0.05
SAMPLE_INTERVAL = 0.1
#: The most a contender may take to catch up after a rate before the run goes on without it.
CATCH_UP_TIMEOUT = 300.0
#: "Holds a rate": the 99th percentile of its lag samples at that rate is under this.
HOLD_LAG = 1.0
PGBENCH_SCALE = 10


def parse_rates(text: str) -> list[int | None]:
    """``--rates``: comma-separated transactions per second; "max" (None) for no limit."""
    rates: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            rates.append(None if part == "max" else int(part))
    return rates


@dataclass
class RateResult:
    """One contender at one rate."""

    rate: int | None
    transactions: int
    seconds: float                      # pgbench's run
    lags: list[float]                   # seconds, one sample every SAMPLE_INTERVAL while pgbench ran
    ages: list[float]                   # the age of the newest heartbeat visible, at the same samples
    catch_up: float | None              # seconds after pgbench ended until caught up; None: not in time
    worker_cpu: float | None            # our worker process; None for the native subscriber
    target_cpu: float | None            # the whole target server
    walsender_cpu: float | None
    cores: float | None                 # the machine's cores busy, pgbench's run and the catch-up
    heartbeat_gap: float = 0.0          # the longest gap between two heartbeats (the lag's resolution)

    @property
    def tps(self) -> float:
        """Transactions per second the source achieved."""
        return self.transactions / self.seconds if self.seconds else 0.0

    def lag(self, quantile: float, ages: bool = False) -> float | None:
        """A quantile of the lag samples (0.5, 0.99) or, for 1.0, the largest; of the ages with
        ``ages``."""
        values = self.ages if ages else self.lags
        if not values:
            return None
        if quantile >= 1.0:
            return max(values)
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]

    def per_thousand(self, cpu: float | None) -> float | None:
        """CPU seconds per 1,000 source transactions."""
        return None if cpu is None or not self.transactions else cpu / self.transactions * 1000


class Heartbeat:
    """Updates the source's heartbeat row every HEARTBEAT_INTERVAL, in a thread, with its own
    connection; ``seq`` is the last sequence number written, ``written`` the source's clock
    (epoch seconds) at each."""

    def __init__(self, source: Database) -> None:
        self._conn = source.connect()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.seq = 0
        self.written: dict[int, float] = {}
        self._last = 0.0
        self.longest_gap = 0.0

    def start(self) -> None:
        self._thread.start()

    def reset_gap(self) -> None:
        """Measure the longest gap between heartbeats from now on."""
        self.longest_gap = 0.0

    def _run(self) -> None:
        update = sql.SQL("UPDATE {} SET seq = seq + 1, at = clock_timestamp() WHERE id = 1 "
                         "RETURNING seq, extract(epoch FROM at)::float8").format(sql.Identifier(HEARTBEAT_TABLE))
        tick = time.monotonic()
        while not self._stop.is_set():
            seq, at = self._conn.execute(update).fetchone()
            self.written[seq] = at
            self.seq = seq
            now = time.monotonic()
            if self._last:
                self.longest_gap = max(self.longest_gap, now - self._last)
            self._last = now
            tick = max(tick + HEARTBEAT_INTERVAL, now)
            self._stop.wait(tick - now)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()


class LagSampler:
    """Asks the target for its clock and its heartbeat row every SAMPLE_INTERVAL; keeps
    (target clock, heartbeat seq, heartbeat time) while ``sampling``."""

    def __init__(self, target: Database) -> None:
        self._conn = target.connect()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lag-sampler", daemon=True)
        self.sampling = False
        self.samples: list[tuple[float, int, float]] = []
        self.seq = 0

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        query = sql.SQL("SELECT extract(epoch FROM clock_timestamp())::float8, seq, "
                        "extract(epoch FROM at)::float8 FROM {} WHERE id = 1").format(
                            sql.Identifier(HEARTBEAT_TABLE))
        tick = time.monotonic()
        while not self._stop.is_set():
            now, self.seq, at = self._conn.execute(query).fetchone()
            if self.sampling:
                self.samples.append((now, self.seq, at))
            # A random moment in each period: a fixed one would lock onto the heartbeat's phase,
            # and every sample would see the same part of the heartbeat interval.
            tick += SAMPLE_INTERVAL
            now = time.monotonic()
            self._stop.wait(max(0.0, tick - now + random.uniform(-0.5, 0.5) * HEARTBEAT_INTERVAL))

    def take(self, written: dict[int, float]) -> tuple[list[float], list[float]]:
        """(lags, ages) of the samples so far, and start afresh: a lag is the age of the oldest
        heartbeat in ``written`` that the target did not show, 0 if none; an age, that of the
        heartbeat it showed."""
        samples, self.samples = self.samples, []
        lags = []
        for now, seq, _ in samples:
            missing = written.get(seq + 1)
            lags.append(max(0.0, now - missing) if missing is not None else 0.0)
        return lags, [now - at for now, _, at in samples]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()


@dataclass
class Contender:
    """How to start and stop one subscriber on (source, target, slot); ``pid`` is our worker's
    process, None for the native subscriber (a target process)."""

    name: str
    start: Callable[[], None]
    stop: Callable[[], None]
    pid: Callable[[], int | None] = field(default=lambda: None)


def ours(source: Database, source_dsn: str, target: Database, slot: str,
         hooks: Path | None = None, extra_env: dict[str, str] | None = None,
         name: str = "applier", tree: Path = ROOT) -> Contender:
    """``applier run`` with its defaults, running until SIGTERM (through bench/probe_hooks.py,
    writing its counters to ``hooks``, if given; with ``extra_env`` in its environment; the
    applier of the checkout in ``tree``, this one by default)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        bookkeeping(target.dsn, tree)
        command, env = worker_command(hooks)
        procs.append(subprocess.Popen(
            [*command, "run", "--source", _with_work_mem(source_dsn, "64MB"),
             "--target", target.dsn, "--slot", slot, "--publication", "bench",
             "--log-level", "WARNING"], cwd=tree, env={**os.environ, **env, **(extra_env or {})}))

    def stop() -> None:
        procs[0].send_signal(signal.SIGTERM)
        if procs[0].wait(timeout=60) != 0:
            raise SystemExit(f"applier run exited with status {procs[0].returncode}")

    return Contender(name, start, stop, lambda: procs[0].pid if procs else None)


def native(source: Database, source_dsn: str, target: Database, slot: str) -> Contender:
    """A native subscription with its defaults (text values) on the pre-made slot."""
    conninfo = _with_work_mem(source_dsn, "64MB")

    def start() -> None:
        target.execute(sql.SQL("CREATE SUBSCRIPTION bench_native CONNECTION {} PUBLICATION bench WITH "
                               "(create_slot = false, slot_name = {}, copy_data = false)")
                       .format(sql.Literal(conninfo), sql.Literal(slot)))

    def stop() -> None:
        with target.connect() as conn:
            conn.execute("ALTER SUBSCRIPTION bench_native DISABLE")
            released(source, slot)
            conn.execute("ALTER SUBSCRIPTION bench_native SET (slot_name = NONE)")
            conn.execute("DROP SUBSCRIPTION bench_native")

    return Contender("native", start, stop)


def hop_floor(source: Database, source_dsn: str, target: Database, slot: str) -> Contender:
    """``bench/lag_floor.py``: each source transaction sent as its Commit arrives, in a pipeline
    never waited on, with no bookkeeping and no batching; the least lag a worker outside the
    target server can have here (``--floor``)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "lag_floor.py"), "--source",
             _with_work_mem(source_dsn, "64MB"), "--target", target.dsn, "--slot", slot,
             "--publication", "bench"], cwd=ROOT))

    def stop() -> None:
        procs[0].send_signal(signal.SIGTERM)
        if procs[0].wait(timeout=60) != 0:
            raise SystemExit(f"bench/lag_floor.py exited with status {procs[0].returncode}")

    return Contender("hop floor", start, stop, lambda: procs[0].pid if procs else None)


def _walsender_pid(source: Database, slot: str) -> int | None:
    return source.query("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,))[0][0]


def _caught_up(sampler: LagSampler, heartbeat: Heartbeat, timeout: float) -> float | None:
    """Wait until the target shows the heartbeat written now; seconds waited, None if not in time."""
    goal = heartbeat.seq
    started = time.monotonic()
    while sampler.seq < goal:
        if time.monotonic() - started > timeout:
            return None
        time.sleep(0.01)
    return time.monotonic() - started


@dataclass
class _Cpu:
    worker: float | None
    target: float | None
    walsender: float | None
    machine: MachineCpu | None
    at: float


def _cpu(contender: Contender, source: Database, target: Database, slot: str) -> _Cpu:
    pid = contender.pid()
    walsender = _walsender_pid(source, slot)
    return _Cpu(process_cpu(pid) if pid else None, server_cpu(target.cluster),
                process_cpu(walsender) if walsender else None, MachineCpu.now(), time.monotonic())


def run_contender(make: Callable[[Database, str, Database, str], Contender], name: str,
                  source_server: PostgresServer, target_server: PostgresServer, index: int,
                  rates: Sequence[int | None], duration: float, clients: int,
                  unix_socket: bool) -> tuple[list[RateResult], bool]:
    """One contender over every rate, on fresh databases; (results, target equal to source)."""
    source = source_server.create_database(f"bench_sus_src_{index}")
    target = target_server.create_database(f"bench_sus_tgt_{index}")
    heartbeat_ddl = (f"CREATE TABLE {HEARTBEAT_TABLE} (id int PRIMARY KEY, seq bigint NOT NULL, "
                     f"at timestamptz NOT NULL); INSERT INTO {HEARTBEAT_TABLE} VALUES (1, 0, now())")
    for db in (source, target):
        pgbench(db, "-i", "-s", str(PGBENCH_SCALE), "-q")
        db.execute(heartbeat_ddl)
    tables = PGBENCH_TABLES + (HEARTBEAT_TABLE,)
    source.execute(f"CREATE PUBLICATION bench FOR TABLE {', '.join(tables)}")
    slot = f"bench_sus_{_slug(name).replace('-', '_')}"
    source.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    source.execute("CHECKPOINT")
    target.execute("CHECKPOINT")
    contender = make(source, stream_dsn(source, unix_socket), target, slot)
    heartbeat, sampler = Heartbeat(source), LagSampler(target)
    results: list[RateResult] = []
    heartbeat.start()
    sampler.start()
    contender.start()
    try:
        if _caught_up(sampler, heartbeat, CATCH_UP_TIMEOUT) is None:
            raise SystemExit(f"{name} did not catch up with the idle source")
        time.sleep(2)  # past the start-up: steady state
        for rate in rates:
            shown = "max" if rate is None else f"{rate:,}"
            print(f"  {name}: {shown} tx/s from {clients} clients for {duration:g} s ...", flush=True)
            before = _cpu(contender, source, target, slot)
            heartbeat.reset_gap()
            sampler.take(heartbeat.written)
            sampler.sampling = True
            started = time.monotonic()
            output = pgbench(source, "-n", "-c", str(clients), "-j", str(clients), "-T", f"{duration:g}",
                              *(() if rate is None else ("-R", str(rate))))
            seconds = time.monotonic() - started
            sampler.sampling = False
            gap = heartbeat.longest_gap
            catch_up = _caught_up(sampler, heartbeat, CATCH_UP_TIMEOUT)
            lags, ages = sampler.take(heartbeat.written)
            after = _cpu(contender, source, target, slot)
            done = re.search(r"number of transactions actually processed: (\d+)", output)
            results.append(RateResult(
                rate, int(done.group(1)) if done else 0, seconds, lags, ages, catch_up,
                delta(before.worker, after.worker), delta(before.target, after.target),
                delta(before.walsender, after.walsender),
                cores_busy(before.machine, after.machine, after.at - before.at), gap))
            print(f"  {name}: {_episodes(results[-1])}", flush=True)
            if catch_up is None:
                print(f"  {name} did not catch up within {CATCH_UP_TIMEOUT:g} s; higher rates skipped",
                      flush=True)
                break
            time.sleep(1)
    finally:
        heartbeat.stop()
        try:
            _caught_up(sampler, heartbeat, CATCH_UP_TIMEOUT)
        finally:
            sampler.stop()
            contender.stop()
    equal = all(digest(source, t) == digest(target, t) for t in tables)
    source_server.drop_database(source.name)
    target_server.drop_database(target.name)
    drop_applier_origins(target_server)
    return results, equal


def _episodes(result: RateResult) -> str:
    """This run's lag at one rate, to tell a single stall from a steady lag (the table pools
    the runs): p99, the largest and when it was seen, and how many samples lagged 0.1 s or more."""
    lags = result.lags
    if not lags:
        return "no lag samples"
    worst = max(range(len(lags)), key=lags.__getitem__)
    return (f"lag p99 {_f(result.lag(0.99), 3)}, max {lags[worst]:.3f} about {worst * SAMPLE_INTERVAL:.0f} s "
            f"into the rate, {sum(lag >= 0.1 for lag in lags)} of {len(lags)} samples at 0.1 s or more")


def run_sustained(source_server: PostgresServer, target_server: PostgresServer,
                  rates: Sequence[int | None], duration: float, clients: int, repeat: int,
                  unix_socket: bool, hooks_dir: Path | None = None,
                  experiments: Sequence[tuple[str, dict[str, str]]] = (),
                  baseline: Path | None = None, floor: bool = False) -> bool:
    """Every contender over every rate, ``repeat`` times; prints the medians. True if every
    target equalled its source at the end. With ``hooks_dir``, our worker's counters
    (bench/probe_hooks.py) go to a file there per run. Each of ``experiments`` (label,
    environment) is one more contender: our worker with that environment; so is ``baseline``, the
    applier of the checkout there, and with ``floor`` ``bench/lag_floor.py`` (``hop_floor``)."""
    contenders: list[tuple[str, Callable[..., Contender]]] = [("applier", ours), ("native", native)]
    if floor:
        contenders.append(("hop floor", hop_floor))
    if baseline is not None:
        contenders.insert(1, ("baseline", functools.partial(ours, name="baseline", tree=baseline)))
    for label, env in experiments:
        name = f"applier[{label}]"
        contenders.append((name, functools.partial(ours, extra_env=env, name=name)))
    runs: dict[str, list[list[RateResult]]] = {name: [] for name, _ in contenders}
    ok = True
    index = 0
    for _ in range(repeat):
        for name, make in contenders:
            if hooks_dir is not None and name.startswith("applier"):
                make = functools.partial(make, hooks=hooks_dir / f"sustained-{index}-{_slug(name)}.json")
            results, equal = run_contender(make, name, source_server, target_server, index, rates,
                                           duration, clients, unix_socket)
            runs[name].append(results)
            ok &= equal
            index += 1
            print(f"  {name}: target equal to source: {equal} (load average {load_average()})", flush=True)
    print_sustained(runs, rates, duration, clients, repeat)
    return ok


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


def _merge(results: list[RateResult]) -> RateResult:
    """One rate's runs: lag samples pooled, every other figure the median."""
    def med(values: list[float | None]) -> float | None:
        return None if any(v is None for v in values) else statistics.median(values)  # type: ignore[type-var]
    return RateResult(results[0].rate, int(statistics.median(r.transactions for r in results)),
                      statistics.median(r.seconds for r in results),
                      [lag for r in results for lag in r.lags], [age for r in results for age in r.ages],
                      med([r.catch_up for r in results]), med([r.worker_cpu for r in results]),
                      med([r.target_cpu for r in results]), med([r.walsender_cpu for r in results]),
                      med([r.cores for r in results]), max(r.heartbeat_gap for r in results))


def _f(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_sustained(runs: dict[str, list[list[RateResult]]], rates: Sequence[int | None],
                    duration: float, clients: int, repeat: int) -> None:
    """The sustained table: per rate and contender, lag, achieved tps, CPU per 1,000 transactions."""
    note = f" (median of {repeat} runs, lag samples pooled)" if repeat > 1 else ""
    print(f"\nsustained: pgbench TPC-B scale {PGBENCH_SCALE}, {clients} clients, {duration:g} s per rate"
          f"{note}; lag in seconds, CPU seconds per 1,000 source transactions")
    width = max(9, *(len(name) for name in runs))
    print(f"{'rate tx/s':>9} {'contender':<{width}} {'achieved':>9} {'lag p50':>8} {'lag p99':>8} "
          f"{'lag max':>8} {'age p99':>8} {'catch-up s':>10} {'worker':>7} {'target':>7} {'walsender':>9} "
          f"{'cores':>6} {'hb gap':>7}")
    held: dict[str, RateResult | None] = {}
    for position, rate in enumerate(rates):
        for name, per_run in runs.items():
            at_rate = [results[position] for results in per_run if position < len(results)]
            if not at_rate:
                continue
            merged = _merge(at_rate)
            if merged.catch_up is not None and (merged.lag(0.99) or 0) < HOLD_LAG:
                if held.get(name) is None or merged.tps > held[name].tps:  # type: ignore[union-attr]
                    held[name] = merged
            else:
                held.setdefault(name, None)
            shown = "max" if rate is None else f"{rate:,}"
            catch_up = _f(merged.catch_up) if merged.catch_up is not None else "no"
            print(f"{shown:>9} {name:<{width}} {merged.tps:>9,.0f} {_f(merged.lag(0.5), 3):>8} "
                  f"{_f(merged.lag(0.99), 3):>8} {_f(merged.lag(1.0), 3):>8} "
                  f"{_f(merged.lag(0.99, ages=True), 3):>8} {catch_up:>10} "
                  f"{_f(merged.per_thousand(merged.worker_cpu), 3) if name != 'native' else '(in tgt)':>7} "
                  f"{_f(merged.per_thousand(merged.target_cpu), 3):>7} "
                  f"{_f(merged.per_thousand(merged.walsender_cpu), 3):>9} {_f(merged.cores):>6} "
                  f"{merged.heartbeat_gap:>7.3f}")
    for name in runs:
        best = held.get(name)
        print(f"{name}: highest rate held with lag p99 under {HOLD_LAG:g} s: "
              + ("none" if best is None else
                 f"{'max' if best.rate is None else f'{best.rate:,}'} tx/s asked, {best.tps:,.0f} achieved"))
    print("lag: the age of the oldest heartbeat written on the source and not yet visible on the "
          f"target, 0 if none (heartbeats every {HEARTBEAT_INTERVAL * 1000:g} ms, the target asked "
          f"every {SAMPLE_INTERVAL * 1000:g} ms while pgbench ran); age: the age of the newest "
          "heartbeat visible on the target (adds the time since it was written); hb gap: the "
          "longest gap between two heartbeats (the writer waits for a core too); catch-up: "
          "seconds after pgbench ended until the "
          "target showed the heartbeat written then; worker: our process; target: the whole target "
          "server (the native apply worker is one of its processes); walsender: the contender's; "
          "cores: the machine's cores busy, every process counted, pgbench's included")
