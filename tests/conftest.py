"""Shared pytest fixtures: real PostgreSQL source/target pairs and scratch databases.

``pg_pair`` is parametrized over ``APPLIER_TEST_PG_VERSIONS`` (default
``15,18``; ids ``pg15``/``pg18``). Servers start lazily, once per version per
session, only when a test asks for them, and stop at the end of the session;
tests that use none of these fixtures never start a server. Tests using them
are marked ``server`` automatically (so ``-m "not server"`` skips them).
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from applier.embedded import Database, PostgresServer, ServerSettings, start_server

SERVER_FIXTURES = frozenset({"pg_pair", "source_db", "target_db"})


def pg_versions() -> list[int]:
    """The PostgreSQL major versions to test (APPLIER_TEST_PG_VERSIONS, default 15 and 18)."""
    raw = os.environ.get("APPLIER_TEST_PG_VERSIONS", "15,18")
    return [int(v) for v in re.split(r"[,\s]+", raw.strip()) if v]


@dataclass
class PgPair:
    """A source and a target server of the same major version."""

    version: int
    source: PostgresServer
    target: PostgresServer

    def cleanup(self) -> None:
        for server in (self.source, self.target):
            try:
                server.cleanup()
            except Exception:
                pass


class _PairRegistry:
    """Starts each version's pair on first use; stops them all at session end."""

    def __init__(self) -> None:
        self._pairs: dict[int, PgPair] = {}
        self._lock = threading.Lock()

    def get(self, version: int) -> PgPair:
        with self._lock:
            pair = self._pairs.get(version)
            if pair is None:
                pair = self._start(version)
                self._pairs[version] = pair
            return pair

    @staticmethod
    def _start(version: int) -> PgPair:
        with ThreadPoolExecutor(max_workers=2) as pool:
            src = pool.submit(start_server, version, ServerSettings.source(), name=f"src{version}")
            tgt = pool.submit(start_server, version, ServerSettings.target(), name=f"tgt{version}")
            errors = [f.exception() for f in (src, tgt)]
            if any(errors):
                for f in (src, tgt):
                    if f.exception() is None:
                        f.result().cleanup()
                raise next(e for e in errors if e is not None)
            return PgPair(version=version, source=src.result(), target=tgt.result())

    def close(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                pair.cleanup()
            self._pairs.clear()


@pytest.fixture(scope="session")
def _pg_registry() -> Iterator[_PairRegistry]:
    registry = _PairRegistry()
    try:
        yield registry
    finally:
        registry.close()


@pytest.fixture(
    scope="session",
    params=pg_versions(),
    ids=lambda v: f"pg{v}",
)
def pg_pair(request: pytest.FixtureRequest, _pg_registry: _PairRegistry) -> PgPair:
    """Running source and target servers of one PostgreSQL major version."""
    pair = _pg_registry.get(int(request.param))
    for server in (pair.source, pair.target):
        if hasattr(server, "running") and not server.running:  # a test stopped it
            server.start()
    return pair


def _db_name(request: pytest.FixtureRequest, prefix: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower()).strip("_")[:40]
    return f"{prefix}_{stem}_{uuid.uuid4().hex[:8]}"


def _fresh_db(server: PostgresServer, name: str) -> Iterator[Database]:
    db = server.create_database(name)
    try:
        yield db
    finally:
        if hasattr(server, "running") and not server.running:
            server.start()
        server.drop_database(name)
        drop_replication_origins(server, name)


def drop_replication_origins(server: PostgresServer, database: str) -> None:
    """Drop the replication origins workers created for ``database`` (applier_<slot>_<db>).

    Origins are server-wide and outlive the database; PostgreSQL 18 tracks at most
    ``max_active_replication_origins`` (default 10) of them, so every test cleans up its own."""
    import psycopg  # local: keeps collection free of connections

    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        names = [row[0] for row in conn.execute(
            "SELECT roname FROM pg_replication_origin WHERE roname LIKE 'applier%%' "
            "AND right(roname, %s) = %s", (len(database) + 1, "_" + database))]
        for origin in names:
            for attempt in range(100):  # a killed worker's session may still be ending
                try:
                    conn.execute("SELECT pg_replication_origin_drop(%s)", (origin,))
                    break
                except psycopg.errors.ObjectInUse:
                    time.sleep(0.1)
                except psycopg.errors.UndefinedObject:
                    break


@pytest.fixture
def source_db(pg_pair: PgPair, request: pytest.FixtureRequest) -> Iterator[Database]:
    """A fresh database on the pair's source, dropped (with its slots) afterwards."""
    yield from _fresh_db(pg_pair.source, _db_name(request, "src"))


@pytest.fixture
def target_db(pg_pair: PgPair, request: pytest.FixtureRequest) -> Iterator[Database]:
    """A fresh database on the pair's target, dropped afterwards."""
    yield from _fresh_db(pg_pair.target, _db_name(request, "tgt"))


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (by session fixture parameter)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The slowest tests first, so that under pytest-xdist no worker is still on one of them
    # long after the others ran out of tests (each worker starts the servers it needs).
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
        if item.get_closest_marker("spark"):
            # Under pytest-xdist (``--dist loadgroup``) every Spark test runs in one worker, which
            # starts the one JVM (a SparkSession per process) and keeps it for all of them.
            item.add_marker(pytest.mark.xdist_group("spark"))


# -- strict mode ---------------------------------------------------------------------------------
# ``./dev test`` (and so CI) sets APPLIER_TEST_STRICT=1: a skip there means something the suite
# needs is missing (PySpark, a C accelerator that failed to build), and a skipped test proves
# nothing, so it fails instead of passing quietly. Outside strict mode a developer without, say,
# PySpark still gets the rest of the suite, with the skips listed by -ra.
_STRICT = os.environ.get("APPLIER_TEST_STRICT") == "1"


def _strict_failure(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped in strict mode (APPLIER_TEST_STRICT=1): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if _STRICT and report.skipped and not hasattr(report, "wasxfail"):
        _strict_failure(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if _STRICT and report.skipped:
        _strict_failure(report)
