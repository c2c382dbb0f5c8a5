"""Exploring with the oracle: hypothesis draws examples (a schema, a workload over it, whether
the consumers run during the workload or after it), every route applies each, and a difference
is shrunk to the smallest example that still shows it, printed as a script to replay.

Examples are drawn from a seed alone (no example database), so a seed replays a run. Once an
example shows a difference on some routes, the examples that follow (shrinking) ask only those
routes, which makes each of them several times cheaper.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, reject, seed, settings
from hypothesis import strategies as st
from oracle_execute import Script
from oracle_rig import Oracle, Outcome, RigCycle, Route
from oracle_schema import Schema, schemas
from oracle_workload import Workload, features, workloads

__all__ = ["Difference", "Example", "Exploration", "examples", "explore", "report", "runtime_features"]


@dataclass(frozen=True)
class Example:
    schema: Schema
    workload: Workload
    #: The consumers run while the workload does (else they read it as a backlog afterwards).
    live: bool


@st.composite
def examples(draw: st.DrawFn, version: int, max_tables: int = 3, max_transactions: int = 10
             ) -> Example:
    schema = draw(schemas(version, max_tables))
    return Example(schema, draw(workloads(schema, max_transactions)), draw(st.booleans()))


class Difference(AssertionError):
    """A route's target differs from the oracle's."""


@dataclass
class Exploration:
    """What a run of examples met."""

    examples: int = 0
    covered: set[str] = field(default_factory=set)
    #: Where PostgreSQL's subscriber could not take an example, why (the source was the oracle).
    native_refused: list[str] = field(default_factory=list)
    #: Where target A differed from the source (informational).
    native_vs_source: list[str] = field(default_factory=list)
    #: Where PostgreSQL's apply worker crashed after taking an example (informational).
    native_crashed: list[str] = field(default_factory=list)
    #: Examples the rig could not run: its own migration of a target waited on a transaction
    #: of the same workload applied early there (``RigCycle``).
    rig_cycles: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: Seconds per phase of an example, over all of them (``Outcome.seconds``).
    phases: dict[str, float] = field(default_factory=dict)


def runtime_features(script: Script) -> set[str]:
    """What only running the workload tells: transactions open at once, a prepared one pending
    while others commit."""
    return ({"interleaved transactions"} if script.most_open > 1 else set()) | (
        {"prepared across commits"} if script.prepared_across_commits else set())


def report(example: Example, outcome: Outcome, routes: list[Route], seed_used: int) -> str:
    """The failing example as a script, and what differed on which route."""
    schema = example.schema
    lines = [f"applier differs from the oracle ({'target A' if not outcome.native_refused else 'the source'})"
             f" on route(s): {', '.join(sorted(outcome.differences))}"
             f" (seed {seed_used}; consumers {'live' if example.live else 'on the backlog'})"]
    if outcome.native_refused:
        lines.append(f"PostgreSQL's subscriber could not take it: {outcome.native_refused}")
    for name, what in sorted(outcome.differences.items()):
        route = next(r for r in routes if r.name == name)
        lines.append(f"--- route {name!r}: applier run {' '.join(route.args)}"
                     + (f" with APPLIER_PURE_PYTHON={route.pure_python}" if route.pure_python else "")
                     + (" (two-phase slot)" if route.two_phase else "") + f"\n{what}")
    lines.append("--- source schema\n" + ";\n".join(schema.source_ddl() + schema.publications()) + ";")
    lines.append("--- target schema\n" + ";\n".join(schema.target_ddl()) + ";")
    if outcome.script is not None:
        lines.append("--- workload (then a row into the marker table)\n" + outcome.script.text())
    return "\n".join(lines)


def explore(oracle: Oracle, routes: list[Route], seed_used: int, max_examples: int,
            found: Exploration) -> None:
    """Run ``max_examples`` examples drawn from ``seed_used``; raise ``Difference`` (shrunk)."""
    focus = list(routes)

    @settings(max_examples=max_examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck),
              phases=(Phase.generate, Phase.shrink))
    @seed(seed_used)
    @given(examples(oracle.source.version))
    def check(example: Example) -> None:
        nonlocal focus
        started = time.monotonic()
        try:
            outcome = oracle.check(example.schema, example.workload, focus, example.live)
        except RigCycle as cycle:
            found.rig_cycles.append(str(cycle))
            reject()
        found.seconds += time.monotonic() - started
        found.examples += 1
        for phase, seconds in outcome.seconds.items():
            found.phases[phase] = found.phases.get(phase, 0.0) + seconds
        found.covered |= features(example.schema, example.workload)
        if outcome.script is not None:
            found.covered |= runtime_features(outcome.script)
        if outcome.native_refused:
            found.native_refused.append(outcome.native_refused)
        if outcome.native_vs_source:
            found.native_vs_source.append(outcome.native_vs_source)
        if outcome.native_crashed:
            found.native_crashed.append(outcome.native_crashed)
        if outcome.differences:
            focus = [r for r in focus if r.name in outcome.differences]
            raise Difference(report(example, outcome, routes, seed_used))

    check()
