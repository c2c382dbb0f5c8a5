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
the example (its apply worker errors), with the source itself. Everything is dropped afterwards.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from oracle_execute import Script, run_workload
from oracle_schema import MARKER, Schema
from oracle_values import TYPES, ident, literal, qualified
from oracle_workload import Workload

from applier.embedded import PostgresServer
from applier.progress.schema import ensure_schema

__all__ = ["ROUTES", "SOAK_ROUTES", "Oracle", "Outcome", "Route"]

REPO = Path(__file__).resolve().parents[2]
_PUBLICATIONS = "oracle_leaf,oracle_root"
#: Settings of every comparing session, so that text forms are the same on every database.
_COMPARE_SETUP = ("SET TimeZone = 'UTC'", "SET extra_float_digits = 3", "SET DateStyle = 'ISO'",
                  "SET IntervalStyle = 'postgres'")
CATCH_UP_SECONDS = 180.0


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
    #: Where target A and the source differ (as they may: a partition truncated alone is not
    #: published through its root).
    native_vs_source: str | None = None
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
        self._log_seen = {id(server): _log_size(server) for server in (source, target)}
        self.tag = f"o{os.getpid()}"
        self.base = f"{self.tag}_base"
        _admin(target, f"CREATE DATABASE {ident(self.base)}")
        ensure_schema(target.dsn(self.base))

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
        workers: dict[str, subprocess.Popen] = {}
        outcome = Outcome()
        clock = _Clock(outcome.seconds)
        try:
            self._create(schema, source_db, names, routes, clock)
            self._subscribe(names["native"], source_db)
            clock.lap("subscribe")
            if live:
                workers = self._start(routes, names, source_db, logs, exit_when_caught_up=False)
            outcome.script = run_workload(self.source.dsn(source_db), schema, workload)
            _execute(self.source.dsn(source_db), f"INSERT INTO {qualified(*MARKER)} VALUES (1)")
            clock.lap("workload")
            if not live:
                workers = self._start(routes, names, source_db, logs, exit_when_caught_up=True)
            failures, outcome.native_refused = self._wait(names, workers, logs)
            clock.lap("wait")
            self._compare(schema, source_db, names, failures, outcome)
            clock.lap("compare")
            return outcome
        finally:
            try:
                self._drop(source_db, names, workers)
                clock.lap("drop")
            finally:
                self._check_servers()

    def _check_servers(self) -> None:
        """A server process that crashed (the postmaster then restarts every session) is a
        finding of its own, whoever caused it: say so with the server's log."""
        for server in (self.source, self.target):
            text = self._new_log(server)
            self._log_seen[id(server)] += len(text.encode())
            lines = text.splitlines()
            crashed = [i for i, line in enumerate(lines)
                       if "terminated by signal" in line or "PANIC:" in line]
            if crashed:
                first = crashed[0]
                raise AssertionError(f"{server.name} crashed:\n"
                                     + "\n".join(lines[max(0, first - 30):first + 5]))

    # -- set-up ----------------------------------------------------------------------------------
    def _create(self, schema: Schema, source_db: str, names: dict[str, str],
                routes: list[Route], clock) -> None:
        _admin(self.source, f"CREATE DATABASE {ident(source_db)}")
        _execute(self.source.dsn(source_db), *schema.source_ddl(), *schema.publications())
        clock.lap("source")
        template = f"{names['native']}_t"
        _admin(self.target, f"CREATE DATABASE {ident(template)} TEMPLATE {ident(self.base)}")
        try:
            _execute(self.target.dsn(template), *schema.target_ddl())
            # A few at once: a copy of a small database is mostly waiting.
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda db: _admin(self.target, f"CREATE DATABASE {ident(db)} "
                                                             f"TEMPLATE {ident(template)}"),
                              names.values()))
        finally:
            self.target.drop_database(template)
        clock.lap("targets")
        two_phase = {names["native"]: True} | {names[r.name]: r.two_phase for r in routes}
        _execute(self.source.dsn(source_db), *(
            f"SELECT pg_create_logical_replication_slot({literal(slot)}, 'pgoutput', false, "
            f"{str(tp).lower()})" for slot, tp in two_phase.items()))
        clock.lap("slots")

    def _subscribe(self, native: str, source_db: str) -> None:
        streaming = "parallel" if self.target.version >= 16 else "on"
        _execute(self.target.dsn(native),
                 f"CREATE SUBSCRIPTION oracle CONNECTION {literal(self.source.dsn(source_db))} "
                 f"PUBLICATION oracle_leaf, oracle_root WITH (create_slot = false, "
                 f"slot_name = {literal(native)}, copy_data = false, two_phase = true, "
                 f"streaming = {streaming})")

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
    def _wait(self, names: dict[str, str], workers: dict[str, subprocess.Popen], logs: Path
              ) -> tuple[dict[str, str], str | None]:
        """Until every consumer holds the marker. Returns the routes that failed (why) and why
        the native subscriber could not take the example (None: it could)."""
        failures: dict[str, str] = {}
        refused = None
        pending = set(names)
        started = time.monotonic()
        deadline = started + CATCH_UP_SECONDS
        self.caught_up: dict[str, float] = {}
        with _sessions(self.target, names) as sessions:
            while pending and time.monotonic() < deadline:
                for name in sorted(pending):
                    if _has_marker(sessions[name]):
                        pending.discard(name)
                        self.caught_up[name] = time.monotonic() - started
                        continue
                    worker = workers.get(name)
                    if worker is not None and worker.poll() is not None:
                        if not _has_marker(sessions[name]):  # it may have just committed it
                            failures[name] = (f"the worker exited with code {worker.returncode} "
                                              f"before applying everything:\n"
                                              f"{_tail(logs / (names[name] + '.log'))}")
                            pending.discard(name)
                    elif name == "native" and _native_errors(sessions[name]):
                        refused = self._native_error(sessions[name])
                        pending.discard(name)
                time.sleep(0.05)
        for name in pending:
            if name == "native":
                refused = "it did not catch up within the time allowed"
            else:
                failures[name] = (f"the worker did not catch up within {CATCH_UP_SECONDS:.0f} s:\n"
                                  f"{_tail(logs / (names[name] + '.log'))}")
        return failures, refused

    def _native_error(self, session: psycopg.Connection) -> str:
        """The apply worker's error and its context, from the target's log of this example."""
        session.execute("ALTER SUBSCRIPTION oracle DISABLE")
        lines = self._new_log(self.target).splitlines()
        for error, context in zip(lines, lines[1:]):
            if "ERROR:" in error and "processing remote data" in context:
                return (error.partition("ERROR:")[2].strip() + " ("
                        + context.partition("CONTEXT:")[2].strip() + ")")
        return "its apply worker reported an error"

    def _new_log(self, server: PostgresServer) -> str:
        """What ``server`` logged since the last example ended."""
        log = server.log_path
        if log is None:
            return ""
        with open(log, "rb") as file:
            file.seek(self._log_seen[id(server)])
            return file.read().decode(errors="replace")

    # -- comparing -------------------------------------------------------------------------------
    def _compare(self, schema: Schema, source_db: str, names: dict[str, str],
                 failures: dict[str, str], outcome: Outcome) -> None:
        with _sessions(self.target, names) as sessions, \
                psycopg.connect(self.source.dsn(source_db), autocommit=True) as source:
            for statement in _COMPARE_SETUP:
                source.execute(statement)
            truth = _contents(source, schema)
            native = truth if outcome.native_refused else _contents(sessions["native"], schema)
            if not outcome.native_refused:
                outcome.native_vs_source = _difference(truth, native, "the source", "target A")
            for name in names:
                if name == "native":
                    continue
                if name in failures:
                    outcome.differences[name] = failures[name]
                    continue
                found = _difference(native, _contents(sessions[name], schema),
                                    "the oracle", "the route's target")
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
        for database in names.values():
            self.target.drop_database(database)
        self.source.drop_database(source_db)
        _drop_origins(self.target, list(names.values()))


# -- helpers -------------------------------------------------------------------------------------

def _admin(server: PostgresServer, *statements: str) -> None:
    _execute(server.dsn(), *statements)


def _execute(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@contextmanager
def _sessions(server: PostgresServer, names: dict[str, str]) -> Iterator[dict[str, psycopg.Connection]]:
    sessions: dict[str, psycopg.Connection] = {}
    try:
        for name, database in names.items():
            sessions[name] = psycopg.connect(server.dsn(database), autocommit=True)
            for statement in _COMPARE_SETUP:
                sessions[name].execute(statement)
        yield sessions
    finally:
        for conn in sessions.values():
            conn.close()


def _log_size(server: PostgresServer) -> int:
    log = server.log_path
    return log.stat().st_size if log is not None and log.exists() else 0


def _has_marker(session: psycopg.Connection) -> bool:
    row = session.execute(f"SELECT count(*) FROM {qualified(*MARKER)}").fetchone()
    return bool(row and row[0])


def _native_errors(session: psycopg.Connection) -> bool:
    row = session.execute("SELECT apply_error_count FROM pg_stat_subscription_stats "
                          "WHERE subname = 'oracle'").fetchone()
    return bool(row and row[0])


def _contents(session: psycopg.Connection, schema: Schema) -> dict[str, Counter[tuple]]:
    """Every table's rows, as the text of each column (large values as their md5)."""
    found: dict[str, Counter[tuple]] = {}
    by_leaf = {(t.schema, leaf): t for t in schema.tables for leaf in t.leaves()}
    for space, name in schema.leaf_tables():
        table = by_leaf.get((space, name))
        if table is None:
            columns = "n::text"
        else:
            columns = ", ".join(f"md5({ident(c.name)}::text)" if TYPES[c.type].toast
                                else f"{ident(c.name)}::text" for c in table.columns)
        rows = session.execute(f"SELECT {columns} FROM {qualified(space, name)}").fetchall()
        found[f"{space}.{name}"] = Counter(rows)
    return found


def _difference(expected: dict[str, Counter[tuple]], actual: dict[str, Counter[tuple]],
                expected_name: str, actual_name: str) -> str | None:
    lines = []
    for table, rows in expected.items():
        other = actual[table]
        if rows == other:
            continue
        missing = list((rows - other).elements())[:3]
        extra = list((other - rows).elements())[:3]
        lines.append(f"{table}: {sum(rows.values())} rows in {expected_name}, "
                     f"{sum(other.values())} in {actual_name}; missing there e.g. "
                     f"{_short(missing)}; extra there e.g. {_short(extra)}")
    return "\n".join(lines) or None


def _short(rows: list[tuple]) -> str:
    text = repr(rows)
    return text if len(text) < 600 else text[:600] + "..."


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _drop_origins(server: PostgresServer, databases: list[str]) -> None:
    """Drop the replication origins workers made for ``databases`` (applier_<slot>_<db>): they
    are server-wide, and PostgreSQL 18 keeps few."""
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        for database in databases:
            for (origin,) in conn.execute(
                    "SELECT roname FROM pg_replication_origin WHERE roname LIKE 'applier%%' "
                    "AND right(roname, %s) = %s", (len(database) + 1, "_" + database)).fetchall():
                conn.execute("SELECT pg_replication_origin_drop(%s)", (origin,))
