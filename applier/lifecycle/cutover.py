"""``applier cutover``: is the target, now, a safe replacement for the source?

Run once writes to the source have stopped (the operator stops the application; this command
fences nothing). Owns the order of the checks and the verdict: read the source's current WAL
position; wait (up to ``--timeout``) until the slot has confirmed everything up to it, which the
worker does only once it is durable on the target; set the target's sequences
(:mod:`.sequences`); check that no prepared transaction is pending on the source, nor on the
target (prepared or deferred by the worker), and that no table copy is unfinished; compare the
published tables' schemas (:mod:`.schemas`, every difference listed) and their rows (``--verify
full``, the default: as ``applier verify``, hashes that see a changed row; ``counts``: row
counts only; ``off``); weigh the transactions skipped and the conflicts recorded (each is fine
only where the rows it touched compared equal in full); then report every check with what to do
about a failed one, as text or JSON. SAFE only when every check was made and passed: with rows
only counted or not compared, no check failing is NOT CONFIRMED. Exit status OK only when SAFE,
CHECK otherwise, FAILED when the command could not do its work (a server unreachable, the slot
missing).

Must never write to the source, stop or signal a worker, or change the target beyond its
sequences (and those never backwards).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg

from ..config import Settings
from ..errors import ApplierError
from ..exit_codes import ExitCode
from ..progress.bookkeeping import SqlBookkeeping
from ..protocol.lsn import LSN
from ..source.slots import SlotInfo, slot_info
from ..sync.catalog import published_tables as source_tables
from ..units import readable_size
from ..verify import VerifyError, VerifyReport, count_sql, format_table, published_tables, snapshots, verify
from .schemas import schema_differences
from .sequences import SequencesReport, synchronise_sequences
from .servers import LifecycleError, connect, source_prepared, target_prepared

__all__ = ["Check", "CutoverReport", "cutover", "run_cutover"]

#: How often the wait looks at the slot and the target again.
_POLL_SECONDS = 0.5


@dataclass
class Check:
    """One condition of a safe replacement: ``ok`` None when it was not checked (an earlier
    check failed, or the options left it out); ``action`` says what to do when it is not ok;
    ``lines``: what it found, one thing a line (every schema difference)."""

    name: str
    ok: bool | None
    detail: str
    action: str | None = None
    lines: list[str] = field(default_factory=list)


@dataclass
class CutoverReport:
    slot: str
    source_lsn: LSN
    checks: list[Check] = field(default_factory=list)
    sequences: SequencesReport | None = None
    tables: VerifyReport | None = None

    @property
    def safe(self) -> bool:
        return all(check.ok is True for check in self.checks)

    @property
    def verdict(self) -> str:
        if self.safe:
            return ("SAFE: the target is a safe replacement for the source. Point the application "
                    f"at the target, then retire the replica with applier drop --slot {self.slot}")
        failed = sum(1 for check in self.checks if check.ok is False)
        if failed:
            return (f"NOT SAFE: {failed} check(s) failed; do what each says, then run applier "
                    "cutover again (writes to the source must stay stopped)")
        unchecked = ", ".join(check.name for check in self.checks if check.ok is None)
        return (f"NOT CONFIRMED: no check failed, but not every one was made ({unchecked}); run "
                "applier cutover again with --verify full")

    def render(self) -> str:
        lines = [f"cutover of slot {self.slot!r} at source WAL position {self.source_lsn}"]
        for check in self.checks:
            mark = {True: "ok  ", False: "FAIL", None: "--  "}[check.ok]
            lines.append(f"  [{mark}] {check.name}: {check.detail}")
            lines += [f"         - {line}" for line in check.lines]
            if check.ok is False and check.action:
                lines.append(f"         what to do: {check.action}")
        if self.sequences is not None and self.sequences.results:
            lines.append("sequences:")
            lines += [f"  {line}" for line in self.sequences.render().splitlines()]
        if self.tables is not None:
            lines.append("tables:")
            lines += [f"  {line}" for line in format_table(self.tables).splitlines()]
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "source_lsn": str(self.source_lsn), "safe": self.safe,
                "verdict": self.verdict, "checks": [asdict(check) for check in self.checks],
                "sequences": self.sequences.as_json() if self.sequences else None,
                "tables": json.loads(self.tables.to_json()) if self.tables else None}


def _slot(source: psycopg.Connection[Any], slot: str) -> SlotInfo:
    info = slot_info(source, slot)
    if info is None:
        raise LifecycleError(f"slot {slot!r} does not exist on the source: check --slot (a "
                             "replica without its slot cannot have caught up)")
    if info.database != source.info.dbname:
        raise LifecycleError(f"slot {slot!r} belongs to database {info.database!r}, not "
                             f"{source.info.dbname!r}: point --source at that database")
    return info


def _wait_caught_up(source: psycopg.Connection[Any], target: psycopg.Connection[Any], slot: str,
                    goal: LSN, timeout: float) -> Check:
    """Wait until the slot confirmed ``goal`` (the worker confirms only what the target holds)."""
    name = "replica caught up"
    deadline = time.monotonic() + timeout
    while True:
        info = _slot(source, slot)
        confirmed = info.confirmed_flush_lsn or LSN(0)
        if confirmed >= goal:
            return Check(name, True, f"the slot confirmed {confirmed}, at or past {goal}")
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_SECONDS)
    progress = SqlBookkeeping(target).positions(slot)
    applied = (f"the target applied up to {progress[0].end_lsn}" if progress
               else "the target has applied nothing for this slot")
    behind = int(goal) - int(confirmed)
    worker = (f"a worker streams it (WAL sender PID {info.active_pid})" if info.active else
              "no worker streams it")
    action = ("wait longer (a larger --timeout), and see applier status for why it is slow"
              if info.active else "start the worker (applier run), then run cutover again")
    return Check(name, False, f"after {timeout:g} s the replica is {readable_size(behind)} behind: "
                 f"the slot confirmed {confirmed} of {goal}, {applied}; {worker}", action)


def _prepared_checks(source: psycopg.Connection[Any], target: psycopg.Connection[Any],
                     slot: str) -> list[Check]:
    on_source = source_prepared(source)
    on_target = [p.gid for p in target_prepared(target, slot)] + [
        str(p["gid"]) for p in SqlBookkeeping(target).deferred_prepared(slot)]
    checks = [Check("no prepared transaction on the source", not on_source,
                    f"{len(on_source)} pending" + (f": {', '.join(p.gid for p in on_source)}"
                                                   if on_source else ""),
                    "COMMIT PREPARED or ROLLBACK PREPARED each on the source, let the worker "
                    "apply it, then run cutover again")]
    checks.append(Check("no prepared transaction held on the target", not on_target,
                        f"{len(on_target)} held by the worker" + (f": {', '.join(on_target)}"
                                                                   if on_target else ""),
                        "finish them on the source (COMMIT or ROLLBACK PREPARED) and let the "
                        "worker apply that; one the source no longer has is removed by "
                        "applier drop when the replica is retired"))
    return checks


def _copies_check(target: psycopg.Connection[Any], slot: str) -> Check:
    store = SqlBookkeeping(target)
    copying = sorted(f"{schema}.{name}" for (schema, name), state in
                     store.table_states(slot).items() if state.state != "done") \
        if "table_sync" in store.tables() else []
    copying += sorted(f"{schema}.{name} (added to a publication)" for (schema, name), state in
                      store.publication_tables(slot).items() if state == "copying")
    return Check("no table copy unfinished", not copying,
                 f"{len(copying)} unfinished" + (f": {', '.join(copying)}" if copying else ""),
                 "let the worker (or applier sync) finish copying them, then run cutover again")


def _compare(source_dsn: str, target_dsn: str, publications: list[str], slot: str,
             mode: str) -> VerifyReport:
    if mode == "full":
        return verify(source_dsn, target_dsn, publications, settle=0, max_keys=10, slot=slot)
    with snapshots(source_dsn, target_dsn, slot) as snaps:
        specs = published_tables(snaps.source, publications)
        if not specs:
            raise VerifyError(f"publication(s) {', '.join(publications)} publish no tables")
        results = [count_sql(snaps, spec) for spec in specs]
        return VerifyReport("counts", snaps.source_wal_lsn, snaps.target_positions, 1, results)


def _schemas_check(source_dsn: str, target_dsn: str, publications: list[str]) -> Check:
    with connect(source_dsn, "source", "cutover") as source, \
            connect(target_dsn, "target", "cutover") as target:
        tables = source_tables(source, publications)
        differences = schema_differences(source, target, tables)
    return Check("schemas equal", not differences,
                 f"the definitions of {len(tables)} table(s) are the source's" if not differences
                 else f"{len(differences)} difference(s) in the published tables' definitions",
                 "make the target's definitions the source's (ALTER TABLE, CREATE INDEX, CREATE "
                 "SEQUENCE ... on the target), then run cutover again", differences)


def _weighed(name: str, what: str, touched: dict[str, str], report: CutoverReport,
             mode: str) -> Check:
    """A check of events that may have left rows behind (skipped transactions, conflicts), by
    the tables each touched (``touched``: table -> what happened there): fine where those
    tables compared equal in full."""
    if not touched:
        return Check(name, True, f"no {what}")
    equal = ({t.table for t in report.tables.tables if t.equal}
             if report.tables is not None and mode == "full" else set())
    unsure = sorted(set(touched) - equal)
    lines = [f"{table}: {touched[table]}" for table in sorted(touched)]
    if not unsure:
        return Check(name, True, f"{what} in {len(touched)} table(s), each compared equal in "
                     "full since: nothing of them is missing", lines=lines)
    why = ("they differ or were not compared" if mode == "full" else
           f"the rows were not compared in full (--verify {mode})")
    return Check(name, False, f"{what} in {', '.join(unsure)}, whose rows may differ from the "
                 f"source's: {why}", "compare those tables (applier verify --table ...), "
                 "repair what differs, then run cutover again with --verify full", lines)


def cutover(settings: Settings) -> CutoverReport:
    """Every check, in order; the waiting, sequences and comparisons only once caught up."""
    slot = settings.required("slot")
    source_dsn, target_dsn = settings.required("source"), settings.required("target")
    with connect(source_dsn, "source", "cutover") as source, \
            connect(target_dsn, "target", "cutover") as target:
        _slot(source, slot)
        row = source.execute("SELECT pg_catalog.pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        report = CutoverReport(slot, LSN.parse(row[0]))
        caught_up = _wait_caught_up(source, target, slot, report.source_lsn, settings.timeout)
        report.checks.append(caught_up)
        report.checks += _prepared_checks(source, target, slot)
        report.checks.append(_copies_check(target, slot))
        store = SqlBookkeeping(target)
        skipped: dict[str, str] = {}
        for lsn, changed in store.skipped(slot):
            for table in changed:
                skipped[table] = ", ".join(filter(None, (skipped.get(table), f"skipped at {lsn}")))
        conflicts = {table: ", ".join(f"{count} {kind}" for kind, count in kinds.items())
                     for table, kinds in store.conflicts_by_table(slot).items()}
    if not caught_up.ok:
        report.checks += [Check(name, None, f"not {verb}: the replica has not caught up")
                          for name, verb in (("sequences set", "set"), ("schemas equal", "compared"),
                                             ("tables equal", "compared"),
                                             ("no transaction skipped", "weighed"),
                                             ("no conflict left", "weighed"))]
        return report
    report.sequences = synchronise_sequences(source_dsn, target_dsn, settings.publication,
                                             margin=settings.margin)
    problems = report.sequences.problems
    report.checks.append(Check(
        "sequences set", not problems,
        f"{len(report.sequences.results)} sequence(s) at or past the source's"
        if not problems else "; ".join(problems),
        "fix each sequence as said, then run cutover again"))
    report.checks.append(_schemas_check(source_dsn, target_dsn, settings.publication))
    mode = settings.verify
    if mode == "off":
        report.checks.append(Check("tables equal", None, "not compared (--verify off)"))
    else:
        report.tables = _compare(source_dsn, target_dsn, settings.publication, slot, mode)
        differing = [t.table for t in report.tables.tables if not t.equal]
        count = len(report.tables.tables)
        if differing:
            what = "row counts" if mode == "counts" else "rows"
            compared = Check("tables equal", False, f"{what} differ in {', '.join(differing)}",
                           "find the differing rows (applier verify --table ...), repair them or "
                           "copy the tables again (applier sync), then run cutover again")
        elif mode == "counts":  # a changed row keeps the count: not a verdict
            compared = Check("tables equal", None, f"row counts of {count} table(s) equal; rows "
                           "not compared (--verify counts cannot see a changed row)")
        else:
            compared = Check("tables equal", True, f"rows of {count} table(s) equal")
        report.checks.append(compared)
    report.checks.append(_weighed("no transaction skipped", "transactions skipped", skipped,
                                  report, mode))
    report.checks.append(_weighed("no conflict left", "conflicts recorded", conflicts, report,
                                  mode))
    return report


def run_cutover(settings: Settings) -> int:
    """``applier cutover``: OK only when the target is a safe replacement, CHECK when a check
    failed, FAILED when the checks could not be made."""
    settings.require("source", "target", "slot", "publication")
    try:
        report = cutover(settings)
    except (ApplierError, VerifyError, psycopg.Error) as exc:
        print(f"applier cutover: {' '.join(str(exc).split())}", file=sys.stderr)
        return ExitCode.FAILED
    print(json.dumps(report.as_json(), indent=2) if settings.json else report.render())
    return ExitCode.OK if report.safe else ExitCode.CHECK
