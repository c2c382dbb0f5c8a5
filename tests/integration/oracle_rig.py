"""The oracle's rig: one example's change stream read by PostgreSQL's subscriber and by applier on
every route, and the targets compared row by row.

For each example: a fresh source database (the schema, two publications: through leaves and
through roots), one target database per consumer cloned from one template (the target schema,
and applier's bookkeeping schema made once, so no worker pays for creating it), and one slot per
consumer, all created before the workload at the same point of a quiet source. The native
subscription (``CREATE SUBSCRIPTION``, two-phase, streaming) reads one slot into target A; an
``applier run`` per route reads its own slot into its own target. With ``live`` the workers (and
the subscription) run while the workload does; otherwise they start after it, on the backlog,
with ``--exit-when-caught-up``. A marker row committed last tells that a consumer is caught up.

Every route's target is compared with target A, or, where PostgreSQL's subscriber cannot take
the example (its apply worker errors, or crashes, or its walsender cannot decode the WAL), with
the source itself; a route that differs from target A where target A differs from the source
passes if it equals the source (PostgreSQL's subscriber was wrong there). Everything is dropped
afterwards, and the workers' logs too unless a route differed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import psycopg
from oracle_compare import columns, contents, difference, has_marker
from oracle_execute import Script, run_workload
from oracle_schema import MARKER, Schema
from oracle_servers import RECOVERY_SECONDS, ServerLog, drop_origins, execute, is_subscriber_crash, sessions
from oracle_values import ident, literal, qualified
from oracle_workload import Op, Savepoint, Truncate, Workload

from applier.embedded import ClusterError, PostgresServer
from applier.progress.schema import ensure_schema

__all__ = ["ROUTES", "SOAK_ROUTES", "Oracle", "Outcome", "RigCycle", "Route"]

REPO = Path(__file__).resolve().parents[2]
_PUBLICATIONS = "oracle_leaf,oracle_root"
#: How long a consumer may take to catch up: a worker that stalls fails the example. A soak
#: (``APPLIER_ORACLE_MINUTES``) shares the machine with other work for hours, so it waits longer
#: before it calls a slow catch-up a stall.
CATCH_UP_SECONDS = 600.0 if float(os.environ.get("APPLIER_ORACLE_MINUTES") or 0) else 180.0
#: How long a target migration waits for a table its own source transaction may hold there
#: (applied early) before the rig calls it a cycle of its own (``RigCycle``).
_CYCLE_SECONDS = 60.0


class RigCycle(Exception):
    """The rig closed a lock cycle of its own: a target's copy of a source transaction that was
    streamed and applied early holds a table, and the rig waits to alter that table on the
    target before the same transaction may go on on the source. No consumer is at fault; the
    example cannot be run."""


@dataclass(frozen=True)
class Route:
    """One way applier can be made to apply: its options, and its environment."""

    name: str
    args: tuple[str, ...] = ()
    #: APPLIER_PURE_PYTHON: "" (every C accelerator built is used), "1" (none), or names.
    pure_python: str = ""
    #: Its slot decodes prepared transactions at PREPARE.
    two_phase: bool = False
    min_version: int = 15


ROUTES = (
    Route("default"),
    Route("no lane", pure_python="apply._lane"),
    Route("careful", ("--batch-rows", "0")),
    Route("streaming off", ("--streaming", "off")),
    Route("streaming on", ("--streaming", "on"), min_version=16),
    Route("at commit, spilled", ("--streamed-apply", "commit", "--memory-budget", "128kB")),
    Route("two-phase", two_phase=True),
    Route("two-phase defer", ("--two-phase-mode", "defer"), two_phase=True),
    Route("change feed", ("--change-feed", "all")),
    Route("pure Python", pure_python="1"),
)
#: ./dev soak: every route above, again in pure Python, and text values.
SOAK_ROUTES = ROUTES + tuple(
    Route(f"pure Python, {r.name}", r.args, "1", r.two_phase, r.min_version)
    for r in ROUTES if not r.pure_python and r.name != "default") + (
    Route("binary off", ("--binary", "off")),
    Route("pure Python, binary off", ("--binary", "off"), pure_python="1"),
)


@dataclass
class Outcome:
    #: Route name -> what differed from the oracle (rows, or the worker's failure).
    differences: dict[str, str] = field(default_factory=dict)
    #: Why PostgreSQL's subscriber could not take the example (the source was the oracle).
    native_refused: str | None = None
    #: PostgreSQL's apply worker crashed after it had taken the example (seen once on 18.6, as
    #: the rig cleaned up): its finding, not a route's; its rows were compared all the same.
    native_crashed: str | None = None
    #: Where target A and the source differ (as they may: a partition truncated alone is not
    #: published through its root).
    native_vs_source: str | None = None
    #: PostgreSQL's decoder refused the WAL of the native subscription's slot (no consumer gets
    #: past it), and the routes whose workers met the same error on their slots.
    undecodable: str | None = None
    undecodable_routes: list[str] = field(default_factory=list)
    #: Routes that differ from target A but equal the source, where target A differs from it.
    source_confirmed: list[str] = field(default_factory=list)
    script: Script | None = None
    #: Seconds each phase took (create, workload, wait, compare, drop).
    seconds: dict[str, float] = field(default_factory=dict)


class _Clock:
    def __init__(self, laps: dict[str, float]) -> None:
        self.laps = laps
        self.last = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now


class Oracle:
    """Runs examples on one source and one target server (the servers are reused)."""

    def __init__(self, source: PostgresServer, target: PostgresServer, workdir: Path) -> None:
        self.source, self.target, self.workdir = source, target, workdir
        self._numbers = itertools.count(1)
        self.logs = {server.name: ServerLog(server) for server in (source, target)}
        self.tag = f"o{os.getpid()}"
        self.base = f"{self.tag}_base"
        execute(target.dsn(), f"CREATE DATABASE {ident(self.base)}")
        ensure_schema(target.dsn(self.base))
        #: Seconds each consumer of the last example took to catch up (after the workload).
        self.caught_up: dict[str, float] = {}

    def close(self) -> None:
        self.target.drop_database(self.base)

    def check(self, schema: Schema, workload: Workload, routes: list[Route], live: bool) -> Outcome:
        number = next(self._numbers)
        prefix = f"{self.tag}_{number}"
        routes = [r for r in routes if self.source.version >= r.min_version]
        names = {"native": f"{prefix}_native"} | {r.name: f"{prefix}_r{i}"
                                                  for i, r in enumerate(routes)}
        source_db = f"{prefix}_src"
        logs = self.workdir / prefix
        logs.mkdir(parents=True, exist_ok=True)
        for log in self.logs.values():
            log.mark()
        workers: dict[str, subprocess.Popen] = {}
        outcome = Outcome()
        clock = _Clock(outcome.seconds)
        try:
            self._create(schema, source_db, names, routes)
            clock.lap("create")
            if live:
                workers = self._start(routes, names, source_db, logs, exit_when_caught_up=False)
            outcome.script = run_workload(self.source.dsn(source_db), schema, workload,
                                          partial(self._on_targets, names))
            execute(self.source.dsn(source_db), f"INSERT INTO {qualified(*MARKER)} VALUES (1)")
            clock.lap("workload")
            if not live:
                workers = self._start(routes, names, source_db, logs, exit_when_caught_up=True)
            failures, outcome.native_refused = self._wait(names, workers, logs, outcome,
                                                          source_db)
            clock.lap("wait")
            self._compare(schema, workload, source_db, names, failures, outcome)
            clock.lap("compare")
            if not outcome.differences:
                shutil.rmtree(logs, ignore_errors=True)
        except BaseException as failure:
            # Cleaning up after a failure must not hide it behind a failure of its own.
            try:
                self._drop(source_db, names, workers)
            except Exception as cleanup:
                failure.add_note(f"cleaning up afterwards failed too: {cleanup!r}")
            raise
        self._drop(source_db, names, workers)
        clock.lap("drop")
        self._check_servers(outcome)
        return outcome

    def _check_servers(self, outcome: Outcome) -> None:
        """A server process that crashed is a finding of its own, whoever caused it: PostgreSQL's
        subscriber's is its refusal (``_wait``) or, after it took the example, noted
        (``outcome.native_crashed``); any other stops the run."""
        for name, log in self.logs.items():
            crashes = log.crashes()
            theirs = [c for c in crashes if is_subscriber_crash(c)]
            if theirs and not outcome.native_refused:
                outcome.native_crashed = theirs[0].splitlines()[-1]
            others = [c for c in crashes if not is_subscriber_crash(c)]
            if others:
                raise AssertionError(f"{name} crashed:\n{others[0]}")

    # -- set-up ----------------------------------------------------------------------------------
    def _create(self, schema: Schema, source_db: str, names: dict[str, str],
                routes: list[Route]) -> None:
        execute(self.source.dsn(), f"CREATE DATABASE {ident(source_db)}")
        execute(self.source.dsn(source_db), *schema.source_ddl(), *schema.publications())
        template = f"{names['native']}_t"
        execute(self.target.dsn(), f"CREATE DATABASE {ident(template)} TEMPLATE {ident(self.base)}")
        try:
            execute(self.target.dsn(template), *schema.target_ddl())
            # A few at once: a copy of a small database is mostly waiting.
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda db: execute(self.target.dsn(), f"CREATE DATABASE {ident(db)} "
                                                                    f"TEMPLATE {ident(template)}"),
                              names.values()))
        finally:
            self.target.drop_database(template)
        # The witness: a slot of the native one's kind that nobody streams; PostgreSQL's own SQL
        # functions read it after the fact when a route's walsender refused its WAL.
        two_phase = ({names["native"]: True, _witness(names): True}
                     | {names[r.name]: r.two_phase for r in routes})
        execute(self.source.dsn(source_db), *(
            f"SELECT pg_create_logical_replication_slot({literal(slot)}, 'pgoutput', false, "
            f"{str(tp).lower()})" for slot, tp in two_phase.items()))
        streaming = "parallel" if self.target.version >= 16 else "on"
        execute(self.target.dsn(names["native"]),
                f"CREATE SUBSCRIPTION oracle CONNECTION {literal(self.source.dsn(source_db))} "
                f"PUBLICATION oracle_leaf, oracle_root WITH (create_slot = false, "
                f"slot_name = {literal(names['native'])}, copy_data = false, two_phase = true, "
                f"streaming = {streaming})")

    def _on_targets(self, names: dict[str, str], statement: str, wrote_before: bool) -> None:
        """Run ``statement`` on every target, as a migration of the replicas would. A consumer
        may hold the table meanwhile; and waiting in the lock queue can close a cycle no deadlock
        detector sees (PostgreSQL's leader apply worker queued behind the ALTER, its parallel
        worker waiting for the leader): so wait a little at a time, and try again (also while
        the target restarts after PostgreSQL's apply worker crashed). Where the
        source transaction at hand wrote the table before (``wrote_before``), a consumer that
        applies it early holds the table until that transaction ends, which waits for this:
        past the deadline that is ``RigCycle``."""
        # A cycle that can close is not waited out as long as a slow consumer is.
        patience = min(CATCH_UP_SECONDS, _CYCLE_SECONDS) if wrote_before else CATCH_UP_SECONDS
        for database in names.values():
            deadline = time.monotonic() + patience
            while True:
                try:
                    execute(self.target.dsn(database), "SET lock_timeout = '1s'", statement)
                    break
                except psycopg.OperationalError as exc:  # a lock, a deadlock, a restart
                    if time.monotonic() > deadline:
                        if wrote_before and isinstance(exc, psycopg.errors.LockNotAvailable):
                            raise RigCycle(f"{database}: {statement}") from exc
                        raise
                    if any(is_subscriber_crash(c) for c in self.logs[self.target.name].crashes()):
                        # PostgreSQL's apply worker crashing restarts the target server again
                        # and again: stop it (its refusal is then read in _wait).
                        _disable_native(lambda q: execute(self.target.dsn(names["native"]), q))
                    time.sleep(0.2)

    def _start(self, routes: list[Route], names: dict[str, str], source_db: str, logs: Path,
               exit_when_caught_up: bool) -> dict[str, subprocess.Popen]:
        workers = {}
        for route in routes:
            env = {k: v for k, v in os.environ.items()
                   if k not in ("APPLIER_PURE_PYTHON", "APPLIER_FAULT")}
            if route.pure_python:
                env["APPLIER_PURE_PYTHON"] = route.pure_python
            database = names[route.name]
            command = [sys.executable, "-m", "applier", "run", "--source",
                       self.source.dsn(source_db), "--target", self.target.dsn(database),
                       "--slot", database, "--publication", _PUBLICATIONS, "--log-level", "INFO",
                       *route.args] + (["--exit-when-caught-up"] if exit_when_caught_up else [])
            with open(logs / f"{database}.log", "wb") as log:
                workers[route.name] = subprocess.Popen(command, stdout=log, stderr=log, env=env,
                                                       cwd=REPO)
        return workers

    # -- waiting ---------------------------------------------------------------------------------
    def _wait(self, names: dict[str, str], workers: dict[str, subprocess.Popen], logs: Path,
              outcome: Outcome, source_db: str) -> tuple[dict[str, str], str | None]:
        """Until every consumer holds the marker. Returns the routes that failed (why) and why
        PostgreSQL's subscriber could not take the example (None: it could). Where the source
        could not decode the WAL (the native slot's, or the witness slot's read after the fact
        by PostgreSQL's own SQL functions), a route whose slot failed the same way is not a
        failure of its own (``outcome.undecodable_routes``)."""
        failures: dict[str, str] = {}
        refused = None
        pending = set(names)
        started = time.monotonic()
        deadline = started + CATCH_UP_SECONDS
        self.caught_up = {}
        with sessions(self.target, names) as polled:
            while pending and time.monotonic() < deadline:
                for name in sorted(pending):
                    if has_marker(lambda q: polled.query(name, q)):
                        pending.discard(name)
                        self.caught_up[name] = time.monotonic() - started
                        continue
                    worker = workers.get(name)
                    refusal = (self.logs[self.source.name].walsender_error(names[name])
                               if name != "native" else None)
                    if refusal is not None and outcome.undecodable is None:
                        outcome.undecodable = self._witness_refusal(source_db, names, refusal)
                    if refusal is not None and refusal == outcome.undecodable:
                        outcome.undecodable_routes.append(name)
                        pending.discard(name)
                    elif worker is not None and worker.poll() is not None:
                        if not has_marker(lambda q: polled.query(name, q)):  # just committed?
                            failures[name] = (f"the worker exited with code {worker.returncode} "
                                              f"before applying everything:\n"
                                              f"{_tail(logs / (names[name] + '.log'))}")
                            pending.discard(name)
                    elif name == "native":
                        refused = self._refusal(lambda q: polled.query(name, q), names[name],
                                                outcome)
                        if refused is not None:
                            pending.discard(name)
                time.sleep(0.1)
        for name in pending:
            if name == "native":
                refused = "it did not catch up within the time allowed"
            else:
                failures[name] = (f"the worker did not catch up within {CATCH_UP_SECONDS:.0f} s:\n"
                                  f"{_tail(logs / (names[name] + '.log'))}")
        return failures, refused

    def _witness_refusal(self, source_db: str, names: dict[str, str], refusal: str) -> str | None:
        """``refusal`` (a route's walsender's error) if PostgreSQL's own SQL functions, reading
        the witness slot from its start, fail the same way: no consumer reading that WAL after
        the fact gets past it, whatever it asks for. None if they decode it."""
        try:
            execute(self.source.dsn(source_db),
                    f"SELECT count(*) FROM pg_logical_slot_peek_binary_changes("
                    f"{literal(_witness(names))}, NULL, NULL, 'proto_version', "
                    f"'{min(self.source.version - 12, 4)}', 'publication_names', "
                    f"{literal(_PUBLICATIONS)}, 'two_phase', 'on')")
        except psycopg.Error as exc:
            error = str(exc).splitlines()[0]
            return refusal if error == refusal else None
        return None

    def _refusal(self, query: Callable[[str], list[tuple]], slot: str,
                 outcome: Outcome) -> str | None:
        """Why PostgreSQL's subscriber stopped (an error, its crash, or its walsender's error:
        the subscription is then disabled, so that it does not go on failing), or None while it
        goes on."""
        crashes = [c for c in self.logs[self.target.name].crashes() if is_subscriber_crash(c)]
        undecodable = self.logs[self.source.name].walsender_error(slot)
        if undecodable is not None:
            outcome.undecodable = undecodable
            reason = f"the source could not decode its slot's WAL: {undecodable}"
        elif crashes:
            what = crashes[0].splitlines()[-1].partition("LOG:")[2].strip()
            reason = f"its apply worker crashed: {what}\n{crashes[0]}"
        elif query("SELECT apply_error_count FROM pg_stat_subscription_stats "
                   "WHERE subname = 'oracle'")[0][0]:
            reason = self.logs[self.target.name].apply_error() or "its apply worker failed"
        else:
            return None
        _disable_native(query)
        return reason

    # -- comparing -------------------------------------------------------------------------------
    def _compare(self, schema: Schema, workload: Workload, source_db: str, names: dict[str, str],
                 failures: dict[str, str], outcome: Outcome) -> None:
        with sessions(self.target, names) as targets, \
                sessions(self.source, {"source": source_db}) as source:
            tables = columns(lambda q: source.query("source", q), schema)
            source_rows = contents(lambda q: source.query("source", q), tables)
            # The source is no oracle for a partition truncated alone whose table is published
            # through its root: that truncate is not published.
            truth = {table: rows for table, rows in source_rows.items()
                     if table not in _unpublished_truncates(schema, workload)}
            native = truth if outcome.native_refused else contents(
                lambda q: targets.query("native", q), tables)
            if not outcome.native_refused:
                outcome.native_vs_source = difference(source_rows, native, "the source",
                                                      "target A")
            for name in names:
                if name == "native" or name in outcome.undecodable_routes:
                    continue  # no consumer gets past WAL the source cannot decode
                if name in failures:
                    outcome.differences[name] = failures[name]
                    continue
                route = contents(lambda q: targets.query(name, q), tables)
                found = difference(native, route, "the oracle", "the route's target")
                if found and outcome.native_vs_source is not None and difference(
                        truth, route, "the source", "the route's target") is None:
                    # PostgreSQL's subscriber went wrong where the route did not (it finds no
                    # row of a FULL identity table whose column a transaction added after an
                    # update of it, oracle_examples): the source decides.
                    outcome.source_confirmed.append(name)
                    continue
                if found:
                    outcome.differences[name] = found

    # -- tearing down ----------------------------------------------------------------------------
    def _drop(self, source_db: str, names: dict[str, str],
              workers: dict[str, subprocess.Popen]) -> None:
        for worker in workers.values():
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers.values():
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        # PostgreSQL's apply worker may be crashing in a loop, each crash restarting the server:
        # its subscription is disabled first (that outlasts the crashes), then each drop is
        # tried again until the server has recovered.
        with sessions(self.target, {"native": names["native"]}) as native:
            _disable_native(lambda q: native.query("native", q))
        for database in names.values():
            _until_recovered(partial(self.target.drop_database, database))
        _until_recovered(partial(self.source.drop_database, source_db))
        drop_origins(self.target, list(names.values()))


def _witness(names: dict[str, str]) -> str:
    return f"{names['native']}_witness"


def _unpublished_truncates(schema: Schema, workload: Workload) -> set[str]:
    """The partitions the workload truncates alone whose tables are published through their
    roots (``schema.name``, as ``oracle_compare.contents`` names them): no consumer is told of
    those truncates."""
    found: set[str] = set()

    def walk(ops: tuple[Op, ...]) -> None:
        for op in ops:
            if isinstance(op, Savepoint):
                walk(op.ops)
            elif isinstance(op, Truncate) and op.one_partition:
                table = schema.tables[op.tables[0]]
                if table.via_root:
                    found.add(f"{table.schema}.{table.leaves()[0]}")

    for transaction in workload.transactions:
        walk(transaction.ops)
    return found


def _until_recovered(action: Callable[[], object]) -> None:
    """``action``, tried again while a server restarts (a crash loop restarts it several times)."""
    deadline = time.monotonic() + RECOVERY_SECONDS
    while True:
        try:
            action()
            return
        except (psycopg.Error, ClusterError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _disable_native(query: Callable[[str], object]) -> None:
    """Disable the native subscription, so that its apply worker stops (or stops crashing):
    tried again while the worker is changing the subscription, or the server restarts. There is
    none when the example failed before creating it."""
    def disable() -> None:
        try:
            query("ALTER SUBSCRIPTION oracle DISABLE")
        except psycopg.errors.UndefinedObject:
            pass
    _until_recovered(disable)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
