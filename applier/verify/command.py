"""``applier verify``: compare, and the command's exit status.

Owns: one comparison run (the tables to compare; while the replica's worker runs, one round at
one source position it holds at, so that a difference is a real one; otherwise rounds of the
chosen engine: while some tables differ and ``--settle`` seconds are left, those are compared
again at fresh snapshots, for a live replica lags; the last round is reported with the positions
both sides were read at), and the command around it (which slot's worker to hold, its output as
a table or JSON, ``--repair`` handed to ``applier.repair``, its exit status). Must never write to
either database itself, nor import PySpark unless ``--engine spark`` was asked for.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Literal

import psycopg

from ..config import Settings
from ..connections import connect
from ..errors import ApplierError
from ..exit_codes import ExitCode
from ..progress.bookkeeping import SqlBookkeeping
from ..spark.session import SparkUnavailable
from .held import NoPositionSnapshot, worker_running
from .publications import published_tables
from .report import TableResult, VerifyError, VerifyReport, format_table
from .snapshots import held_snapshots, snapshots
from .sql import compare_sql

__all__ = ["run_verify", "verify"]


def _split_names(values: Iterable[str]) -> list[str]:
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def verify(source_dsn: str, target_dsn: str, publications: Sequence[str], tables: Sequence[str] = (),
           *, settle: float, max_keys: int, engine: Literal["sql", "spark"] = "sql",
           slot: str | None = None, master: str | None = None,
           jdbc_jar: str | os.PathLike[str] | None = None,
           hold_timeout: float | None = None) -> VerifyReport:
    """Compare the tables. With ``hold_timeout`` (and the SQL engine), once, at one source position
    the worker of ``slot`` holds at for the moment the target is read (``held_snapshots``);
    otherwise, while some differ and ``settle`` seconds are left, compare those again."""
    deadline = time.monotonic() + settle
    with snapshots(source_dsn, target_dsn, slot) as snaps:
        specs = published_tables(snaps.source, publications, tables)
    if not specs:
        raise VerifyError(f"publication(s) {', '.join(publications)} publish no tables")
    spark = None
    if engine == "spark":
        from ..spark import spark_session
        spark = spark_session(master, app_name="applier verify", jar=jdbc_jar)
    results: dict[str, TableResult] = {}
    rounds = 0
    pending = specs
    exact = False
    notes: list[str] = []
    while True:
        rounds += 1
        if spark is not None:
            from .spark import compare_spark
            report = compare_spark(spark, source_dsn, target_dsn, pending, slot, max_keys)
            wal_lsn, positions = report.source_wal_lsn, report.target_positions
            round_results = report.tables
        else:
            try:
                opened = (held_snapshots(source_dsn, target_dsn, slot, hold_timeout)
                          if hold_timeout is not None and slot is not None
                          else snapshots(source_dsn, target_dsn, slot))
                with opened as snaps:
                    round_results = [compare_sql(snaps, spec, max_keys) for spec in pending]
                    wal_lsn, positions, exact = snaps.source_wal_lsn, snaps.target_positions, snaps.exact
            except NoPositionSnapshot as exc:
                notes.append(f"{exc}: each side was read as it is instead")
                hold_timeout = None
                rounds -= 1
                continue
        results.update((r.table, r) for r in round_results)
        pending = [s for s, r in zip(pending, round_results) if not r.equal and r.error is None]
        if exact or not pending or time.monotonic() + 1 > deadline:
            break
        time.sleep(1)  # give the worker time to apply what was in flight
    ordered = [results[s.display] for s in specs]
    return VerifyReport(engine, wal_lsn, positions, rounds, ordered, exact=exact, notes=notes)


def _holding_slot(settings: Settings) -> tuple[str | None, str | None]:
    """The slot whose worker can hold at a position for the comparison, or None and why not."""
    if settings.engine == "spark":
        return None, "--engine spark reads each side as it is, without holding the worker"
    with connect(settings.required("target"), autocommit=True) as target:
        slots = [p.slot_name for p in SqlBookkeeping(target).positions(settings.slot)]
        if settings.slot is None and len(slots) != 1:
            return None, (f"the target has {len(slots)} slots' positions: pass --slot to compare at "
                          "one position its worker holds at" if slots else None)
        slot = settings.slot or slots[0]
        if worker_running(target, slot):
            if "position_holds" not in SqlBookkeeping(target).tables():
                return None, ("the target's bookkeeping predates holding at a position (the "
                              "worker upgrades it at its start): each side was read as it is")
            return slot, None
    return None, (f"no worker runs for slot {slot!r}: each side was read as it is, so a change "
                  "not applied yet shows as a difference (start the worker to compare at one "
                  "position)")


def run_verify(settings: Settings) -> int:
    """``applier verify``: OK when every table is equal (with ``--repair``: or was repaired),
    CHECK when any differs (or could not be repaired), FAILED when comparing or repairing was
    impossible (a server, publication or table missing, no Spark, no worker to hold)."""
    settings.require("source", "target", "publication")
    assert settings.source is not None and settings.target is not None  # required just above
    try:
        slot, note = _holding_slot(settings)
        if settings.repair and slot is None:
            raise VerifyError(f"--repair needs the replica's worker running: {note}")
        report = verify(settings.source, settings.target, settings.publication,
                        _split_names(settings.table), engine=settings.engine,
                        slot=slot or settings.slot, settle=settings.settle,
                        max_keys=settings.max_keys, master=settings.master,
                        jdbc_jar=settings.jdbc_jar,
                        hold_timeout=settings.timeout if slot is not None else None)
        if note:
            report.notes.append(note)
        if settings.repair and slot is not None and not report.equal:
            if not report.exact:
                raise VerifyError(f"--repair needs a comparison at one position: {report.notes[-1]}")
            from ..repair import repair_differences  # writes: only with --repair
            report.repairs = repair_differences(settings, slot, report)
    except (VerifyError, psycopg.Error, ApplierError) as exc:
        print(f"applier verify: {' '.join(str(exc).split())}", file=sys.stderr)
        return ExitCode.FAILED
    except SparkUnavailable as exc:
        print(f"applier verify --engine spark: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    print(report.to_json() if settings.json else format_table(report))
    if report.repairs:
        return ExitCode.CHECK if any(r["action"] == "refused" for r in report.repairs) else ExitCode.OK
    return ExitCode.OK if report.equal else ExitCode.CHECK
