"""The oracle (issue 42): PostgreSQL's own subscriber applies the same change stream as applier
does on each of its routes, and every route's replica must come out the same, row by row.

``oracle_schema`` and ``oracle_workload`` draw the examples (the shapes users have, the
workloads they run), ``oracle_execute`` runs a workload on the source, ``oracle_rig`` reads its
stream with ``CREATE SUBSCRIPTION`` and with ``applier run`` on every route and compares the
targets, and ``oracle_explore`` drives hypothesis: a difference is shrunk to the smallest
example that still shows it and printed as a script.

``./dev test`` runs a bounded number of examples per PostgreSQL version, from a fixed seed
(``APPLIER_ORACLE_SEED``; ``APPLIER_ORACLE_EXAMPLES`` sets how many), on the routes of
``oracle_rig.ROUTES``. ``./dev soak [--minutes N] [--seed S]`` sets ``APPLIER_ORACLE_MINUTES``:
then this test runs rounds of examples for that long (shared between the versions) on every
route of ``SOAK_ROUTES``, round r drawing from seed S + r, and reports every difference it
shrank; ``./dev soak --seed S+r`` replays round r.
"""

from __future__ import annotations

import os
import random
import re
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from conftest import pg_versions
from oracle_examples import (
    A_COLUMN_ADDED_TO_A_FULL_TABLE,
    A_PARTITION_TRUNCATED_THEN_REFUSED,
    COLUMN_ADDED_ON_THE_SOURCE,
    EVERY_SHAPE,
    FULL_WITHOUT_EQUALITY,
    ONE_PARTITION_TRUNCATED,
    REQUIRED,
)
from oracle_explore import Example, Exploration, explore, report, runtime_features
from oracle_rig import ROUTES, SOAK_ROUTES, Oracle
from oracle_workload import features

from applier.embedded import ServerSettings, start_server

pytestmark = pytest.mark.server

EXAMPLES = int(os.environ.get("APPLIER_ORACLE_EXAMPLES", "4"))
MINUTES = float(os.environ.get("APPLIER_ORACLE_MINUTES", "0"))
SEED = os.environ.get("APPLIER_ORACLE_SEED", "")
#: Examples per soak round: a round is replayed whole by its seed.
ROUND = 5


def _settings(version: int, target: bool) -> ServerSettings:
    """The test servers' settings, with room for a slot, a WAL sender and a replication origin
    per route and the native subscription's workers."""
    extra: dict[str, object] = {"max_wal_senders": 60, "max_replication_slots": 60,
                                "max_connections": 200}
    if target:
        extra |= {"max_logical_replication_workers": 8, "max_worker_processes": 16}
        if version >= 18:
            extra["max_active_replication_origins"] = 60
    return ServerSettings.source(**extra)


@pytest.fixture(scope="module", params=pg_versions(), ids=lambda v: f"pg{v}")
def oracle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Oracle]:
    version = int(request.param)
    source = start_server(version, _settings(version, False), name=f"oracle-src{version}")
    try:
        target = start_server(version, _settings(version, True), name=f"oracle-tgt{version}")
        try:
            rig = Oracle(source, target, tmp_path_factory.mktemp(f"oracle{version}"))
            try:
                yield rig
            finally:
                rig.close()
        finally:
            target.cleanup()
    finally:
        source.cleanup()


def test_every_shape_on_every_route(oracle: Oracle) -> None:
    """One example holding every shape and workload kind of the issue, its consumers running
    while it runs: the routes, PostgreSQL's subscriber and the source all agree."""
    schema, workload = EVERY_SHAPE
    outcome = oracle.check(schema, workload, list(ROUTES), live=True)
    assert outcome.native_refused is None and outcome.native_vs_source is None, outcome
    assert not outcome.differences, report(Example(schema, workload, True), outcome, list(ROUTES), 0)
    assert outcome.script is not None
    covered = features(schema, workload) | runtime_features(outcome.script)
    assert REQUIRED <= covered, f"not covered: {sorted(REQUIRED - covered)}"


def test_a_replica_that_differs_from_its_source_where_the_stream_says_so(oracle: Oracle) -> None:
    """A partition truncated alone, its table published through its root: the truncate is not
    published, so every consumer keeps the partition's rows. The rig tells target A from the
    source, and holds the routes to target A."""
    schema, workload = ONE_PARTITION_TRUNCATED
    outcome = oracle.check(schema, workload, list(ROUTES[:2]), live=False)
    assert outcome.native_refused is None
    assert outcome.native_vs_source is not None and outcome.native_vs_source.startswith(
        "public.rooted_p0: 0 rows in the source, 499 in target A"), outcome.native_vs_source
    assert not outcome.differences, outcome.differences


def test_where_postgresqls_subscriber_goes_wrong_the_source_decides(oracle: Oracle) -> None:
    """A column added with a default to a FULL identity table (targets first) in the transaction
    that updated its rows just before: PostgreSQL's subscriber (15 and 18 alike) finds none of
    those rows and keeps them unchanged; every route equals the source, which the rig then takes
    for the oracle."""
    schema, workload = A_COLUMN_ADDED_TO_A_FULL_TABLE
    outcome = oracle.check(schema, workload, list(ROUTES), live=False)
    assert not outcome.differences, report(Example(schema, workload, False), outcome,
                                           list(ROUTES), 0)
    assert outcome.native_vs_source is not None and outcome.native_vs_source.startswith(
        "public.fa: 5 rows in the source, 5 in target A"), outcome.native_vs_source
    assert sorted(outcome.source_confirmed) == sorted(
        r.name for r in ROUTES if oracle.source.version >= r.min_version), outcome


@pytest.mark.parametrize("example, refusal", [
    (FULL_WITHOUT_EQUALITY, "could not identify an equality operator for type json"),
    (COLUMN_ADDED_ON_THE_SOURCE, 'is missing replicated column: "added 1"'),
    (A_PARTITION_TRUNCATED_THEN_REFUSED, 'is missing replicated column: "added 1"'),
], ids=["json in a FULL table", "a column added on the source",
        "a partition truncated alone, then a column added on the source"])
def test_where_postgresqls_subscriber_refuses_the_source_is_the_oracle(
        oracle: Oracle, example: tuple, refusal: str) -> None:
    """json has no equality operator: PostgreSQL's subscriber cannot find a row of a FULL
    identity table without a key by it, and stops; it stops at a column the target lacks too,
    which applier adds. Every route is held to the source (but for a partition truncated alone
    through its root, which no consumer is told of)."""
    schema, workload = example
    outcome = oracle.check(schema, workload, list(ROUTES), live=False)
    assert outcome.native_refused is not None
    assert refusal in outcome.native_refused, outcome.native_refused
    assert not outcome.differences, report(Example(schema, workload, False), outcome,
                                           list(ROUTES), 0)


def _soak_timeout(test: Callable[..., None]) -> Callable[..., None]:
    """A soak outlasts the suite's per-test timeout (pytest-timeout's alarm would fire inside a
    round, and hypothesis would report that round as flaky): it gets its minutes and a round's
    worth more."""
    return pytest.mark.timeout(MINUTES * 60 + 1800)(test) if MINUTES else test


@_soak_timeout
def test_drawn_examples_on_every_route(oracle: Oracle) -> None:
    """Examples hypothesis draws from a fixed seed (``./dev soak``: for as long as asked)."""
    if MINUTES:
        _soak(oracle, MINUTES / len(pg_versions()))
        return
    found = Exploration()
    explore(oracle, list(ROUTES), int(SEED or 0), EXAMPLES, found)
    print(f"\n{found.examples} examples in {found.seconds:.0f} s "
          f"({', '.join(f'{k} {v:.0f} s' for k, v in found.phases.items())})")


def _soak(oracle: Oracle, minutes: float) -> None:
    first = int(SEED) if SEED else random.randrange(2**31)
    deadline = time.monotonic() + minutes * 60
    found = Exploration()
    differences: list[str] = []
    round_seed = first
    print(f"\nsoak on PostgreSQL {oracle.source.version} for {minutes:g} min from seed {first}")
    while time.monotonic() < deadline:
        try:
            explore(oracle, list(SOAK_ROUTES), round_seed, ROUND, found)
        except Exception as exc:
            differences.append(f"seed {round_seed}: {_describe(exc)}")
            replay = (f"APPLIER_TEST_PG_VERSIONS={oracle.source.version} ./dev soak --seed "
                      f"{round_seed} --minutes 1")
            differences[-1] += f"\nreplay: {replay}"
            print(f"\n=== difference (replay: {replay}) ===\n{differences[-1]}", flush=True)
        round_seed += 1
        print(f"{found.examples} examples in {found.seconds:.0f} s (rounds {first}..{round_seed - 1})",
              flush=True)
    print(f"covered: {sorted(found.covered)}")
    refusals = Counter(_first_line(reason) for reason in found.native_refused)
    print(f"PostgreSQL's subscriber refused {len(found.native_refused)} example(s): "
          f"{refusals.most_common()}")
    print(f"PostgreSQL's apply worker crashed after taking {len(found.native_crashed)} example(s): "
          f"{[_first_line(crash) for crash in found.native_crashed]}")
    print(f"the rig closed a lock cycle of its own in {len(found.rig_cycles)} example(s) (not run): "
          f"{found.rig_cycles}")
    print(f"target A differed from the source {len(found.native_vs_source)} time(s): "
          f"{[_first_line(found) for found in found.native_vs_source]}")
    assert not differences, f"{len(differences)} difference(s):\n\n" + "\n\n".join(differences)


def _first_line(text: str) -> str:
    """A reason's first line, without the LSNs and OIDs that make each one different."""
    line = text.splitlines()[0] if text else ""
    return re.sub(r'"pg_\d+"|\d+/[0-9A-F]+|transaction \d+', "...", line)[:160]


def _describe(exc: BaseException) -> str:
    """What went wrong, with every failure hypothesis grouped (a flaky one's first too)."""
    if isinstance(exc, BaseExceptionGroup):
        return str(exc) + "".join(f"\n--- {i}: {_describe(sub)}"
                                  for i, sub in enumerate(exc.exceptions, 1))
    text = str(exc) + "".join(f"\n{note}" for note in getattr(exc, "__notes__", []))
    if not text and exc.__cause__ is not None:  # hypothesis wraps what is not an Exception
        return f"{type(exc).__name__} of {_describe(exc.__cause__)}"
    if text:
        return f"{type(exc).__name__}: {text}"
    # An exception without words (a bare assert, a timeout): its type and where it was raised.
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    return type(exc).__name__ + "".join(f" at {frame.filename}:{frame.lineno} ({frame.line})"
                                        for frame in where)
