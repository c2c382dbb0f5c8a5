"""``applier verify``: compare until equal or out of time, and the command's exit status.

Owns: one comparison run (the tables to compare, then rounds of the chosen engine: while some
tables differ and ``--settle`` seconds are left, those are compared again at fresh snapshots, for
a live replica lags; the last round is reported with the positions both sides were read at), and
the command around it (its settings, its output as a table or JSON, its exit status). Must never
write to either database, nor import PySpark unless ``--engine spark`` was asked for.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Literal

import psycopg

from ..config import Settings
from ..exit_codes import ExitCode
from ..spark.session import SparkUnavailable
from .publications import published_tables
from .report import TableResult, VerifyError, VerifyReport, format_table
from .snapshots import snapshots
from .sql import compare_sql

__all__ = ["run_verify", "verify"]


def _split_names(values: Iterable[str]) -> list[str]:
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def verify(source_dsn: str, target_dsn: str, publications: Sequence[str], tables: Sequence[str] = (),
           *, settle: float, max_keys: int, engine: Literal["sql", "spark"] = "sql",
           slot: str | None = None, master: str | None = None,
           jdbc_jar: str | os.PathLike[str] | None = None) -> VerifyReport:
    """Compare the tables; while some differ and ``settle`` seconds are left, compare those again."""
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
    while True:
        rounds += 1
        if spark is not None:
            from .spark import compare_spark
            report = compare_spark(spark, source_dsn, target_dsn, pending, slot, max_keys)
            wal_lsn, positions = report.source_wal_lsn, report.target_positions
            round_results = report.tables
        else:
            with snapshots(source_dsn, target_dsn, slot) as snaps:
                round_results = [compare_sql(snaps, spec, max_keys) for spec in pending]
                wal_lsn, positions = snaps.source_wal_lsn, snaps.target_positions
        results.update((r.table, r) for r in round_results)
        pending = [s for s, r in zip(pending, round_results) if not r.equal and r.error is None]
        if not pending or time.monotonic() + 1 > deadline:
            break
        time.sleep(1)  # give the worker time to apply what was in flight
    ordered = [results[s.display] for s in specs]
    return VerifyReport(engine, wal_lsn, positions, rounds, ordered)


def run_verify(settings: Settings) -> int:
    """``applier verify``: OK when every table is equal, CHECK when any differs, FAILED when
    comparing was impossible (a server, publication or table missing, no Spark)."""
    settings.require("source", "target", "publication")
    assert settings.source is not None and settings.target is not None  # required just above
    try:
        report = verify(settings.source, settings.target, settings.publication,
                        _split_names(settings.table), engine=settings.engine, slot=settings.slot,
                        settle=settings.settle, max_keys=settings.max_keys, master=settings.master,
                        jdbc_jar=settings.jdbc_jar)
    except (VerifyError, psycopg.Error) as exc:
        print(f"applier verify: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    except SparkUnavailable as exc:
        print(f"applier verify --engine spark: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    print(report.to_json() if settings.json else format_table(report))
    return ExitCode.OK if report.equal else ExitCode.CHECK
