"""``applier verify``: is the replica equal to the source, and if not, exactly where not?

Owns: choosing the tables to compare (every table of the publications, their published columns
and row filters, or a chosen list), reading both sides at consistent points (the source in one
REPEATABLE READ snapshot, the target in one snapshot together with the position it had applied),
comparing row counts and per-key-range hashes, then the rows of the ranges that differ, and
reporting equal or exactly which keys are missing, extra or changed (as a table, or JSON).
Must never write to either database; the SQL engine must never need PySpark (``--engine spark``
lives in :mod:`applier.verify_spark`, imported only when asked for).

How a comparison works: each row's hash is ``md5`` of its published columns' text form (with the
same TimeZone, DateStyle, IntervalStyle, extra_float_digits and bytea_output on both sides, so
text forms agree whenever values do). Rows are grouped into ranges: equal-width ranges of a
single integer key, otherwise buckets of the key's hash (the whole row's, for a table without a
key). Each side returns per range a count and the sum of 60-bit row hashes; only ranges that
differ are read row by row. Keys are compared by their text form.

A live replica lags: a difference found in the first round may be a change still in flight. Up
to ``--settle`` seconds, tables that differ are compared again at fresh snapshots; the last round
is reported, with the positions both sides were read at.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import sql

from .config import Settings
from .connections import connect
from .exit_codes import ExitCode
from .spark.session import SparkUnavailable

__all__ = ["TableResult", "TableSpec", "VerifyReport", "compare_sql", "published_tables",
           "run_verify", "verify"]

#: Rows per range aimed at: small enough that re-reading a differing range is cheap.
ROWS_PER_RANGE = 5_000
MAX_RANGES = 4_096

#: Session settings under which both sides print equal values as equal text.
_TEXT_SETTINGS = ("SET TimeZone = 'UTC'; SET DateStyle = 'ISO, YMD'; SET IntervalStyle = 'postgres'; "
                  "SET extra_float_digits = 3; SET bytea_output = 'hex'")


class VerifyError(RuntimeError):
    """A problem that prevents comparing at all (bad publication, unreachable database)."""


@dataclass(frozen=True)
class TableSpec:
    """What is compared for one table: published columns, key, and the source row filter."""
    schema: str
    name: str
    columns: tuple[str, ...]
    key: tuple[str, ...]  # empty: no key, rows are compared as a multiset
    integer_key: bool  # a single int2/int4/int8 key column: ranges are key ranges
    row_filter: str | None  # the publication's WHERE, applied on the source only

    @property
    def display(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def qualified(self) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(self.schema), sql.Identifier(self.name))


@dataclass
class TableResult:
    table: str
    source_rows: int = 0
    target_rows: int = 0
    ranges: int = 0
    differing_ranges: int = 0
    missing: list[list[str | None]] = field(default_factory=list)  # on the source, not the target
    extra: list[list[str | None]] = field(default_factory=list)    # on the target, not the source
    changed: list[list[str | None]] = field(default_factory=list)  # same key, different values
    missing_count: int = 0
    extra_count: int = 0
    changed_count: int = 0
    key: list[str] = field(default_factory=list)  # the key columns (the whole row without a key)
    error: str | None = None

    @property
    def equal(self) -> bool:
        return self.error is None and not (self.missing_count or self.extra_count or self.changed_count) \
            and self.source_rows == self.target_rows


@dataclass
class VerifyReport:
    engine: str
    source_wal_lsn: str
    target_positions: list[dict[str, Any]]
    rounds: int
    tables: list[TableResult]

    @property
    def equal(self) -> bool:
        return all(t.equal for t in self.tables)

    def to_json(self) -> str:
        data = asdict(self)
        data["equal"] = self.equal
        for table, result in zip(data["tables"], self.tables):
            table["equal"] = result.equal
        return json.dumps(data, indent=2, default=str)


@dataclass
class Snapshots:
    """Both sides, each in one REPEATABLE READ, READ ONLY transaction, and where they were read."""
    source: psycopg.Connection[Any]
    target: psycopg.Connection[Any]
    source_wal_lsn: str
    target_positions: list[dict[str, Any]]


def _connect(dsn: str, side: str) -> psycopg.Connection[Any]:
    try:
        conn = connect(dsn, application_name="applier verify")
    except psycopg.Error as exc:
        raise VerifyError(f"cannot connect to the {side}: {exc}") from exc
    conn.execute(_TEXT_SETTINGS)
    conn.commit()
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = True
    return conn


@contextmanager
def snapshots(source_dsn: str, target_dsn: str, slot: str | None) -> Iterator[Snapshots]:
    """Snapshot the target first, then the source: the source is never behind the target, so a
    row the target has and the source lacks is a real extra row or a delete still in flight."""
    target = _connect(target_dsn, "target")
    source: psycopg.Connection[Any] | None = None
    try:
        positions: list[dict[str, Any]] = []
        if target.execute("SELECT to_regclass('applier.progress')").fetchone() != (None,):
            cur = target.execute("SELECT slot_name, commit_lsn::text, end_lsn::text, commit_time "
                                 "FROM applier.progress WHERE %(slot)s::text IS NULL OR slot_name = %(slot)s "
                                 "ORDER BY slot_name", {"slot": slot})
            positions = [dict(zip(("slot_name", "commit_lsn", "end_lsn", "commit_time"), row))
                         for row in cur.fetchall()]
        source = _connect(source_dsn, "source")
        row = source.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        yield Snapshots(source, target, row[0], positions)
    finally:
        for conn in (source, target):
            if conn is not None:
                conn.close()


def _split_names(values: Iterable[str]) -> list[str]:
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def published_tables(conn: psycopg.Connection[Any], publications: Sequence[str],
                     only: Sequence[str] = ()) -> list[TableSpec]:
    """The tables of ``publications`` (PostgreSQL 15+ catalog), optionally only ``only``."""
    known = {r[0] for r in conn.execute("SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)",
                                        (list(publications),))}
    if unknown := [p for p in publications if p not in known]:
        raise VerifyError(f"no publication {', '.join(map(repr, unknown))} on the source")
    rows = conn.execute(
        "SELECT c.oid::int8, pt.schemaname::text, pt.tablename::text, pt.attnames::text[], pt.rowfilter "
        "FROM pg_publication_tables pt JOIN pg_namespace n ON n.nspname = pt.schemaname "
        "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename "
        "WHERE pt.pubname = ANY(%s) ORDER BY 2, 3", (list(publications),)).fetchall()
    # A table in several publications: the union of their columns, and any row passes that
    # passes one of their filters (no filter at all wins).
    merged: dict[int, tuple[str, str, set[str], list[str | None]]] = {}
    for oid, schema, name, attnames, rowfilter in rows:
        entry = merged.setdefault(oid, (schema, name, set(), []))
        entry[2].update(attnames or ())
        entry[3].append(rowfilter)
    wanted = None
    if only:
        wanted = set()
        for table in only:
            found = conn.execute("SELECT to_regclass(%s)::oid::int8", (table,)).fetchone()
            if not found or found[0] is None or found[0] not in merged:
                raise VerifyError(f"table {table!r} is not in publication(s) {', '.join(publications)}")
            wanted.add(found[0])
    specs = []
    for oid, (schema, name, attnames, filters) in merged.items():
        if wanted is not None and oid not in wanted:
            continue
        columns = conn.execute(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = %s::oid AND attnum > 0 "
            "AND NOT attisdropped AND attgenerated = '' ORDER BY attnum", (oid,)).fetchall()
        key = conn.execute(
            "SELECT a.attname::text, t.typname::text FROM pg_index i "
            "CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, n) "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            "JOIN pg_type t ON t.oid = a.atttypid "
            "WHERE i.indexrelid = (SELECT indexrelid FROM pg_index WHERE indrelid = %s::oid AND "
            "indisvalid AND (indisprimary OR indisreplident) ORDER BY indisprimary DESC LIMIT 1) "
            "ORDER BY k.n", (oid,)).fetchall()
        published = tuple(c for (c,) in columns if not attnames or c in attnames)
        row_filter = None if None in filters else " OR ".join(f"({f})" for f in filters)
        specs.append(TableSpec(schema, name, published, tuple(k for k, _ in key),
                               len(key) == 1 and key[0][1] in ("int2", "int4", "int8"), row_filter))
    return specs


def _row_text(spec: TableSpec) -> sql.Composable:
    return sql.SQL("ROW({})::text").format(sql.SQL(", ").join(map(sql.Identifier, spec.columns)))


def _key_text(spec: TableSpec) -> sql.Composable:
    return (sql.SQL("ROW({})::text").format(sql.SQL(", ").join(map(sql.Identifier, spec.key)))
            if spec.key else _row_text(spec))


@dataclass(frozen=True)
class _Ranges:
    """How rows are assigned to ranges: integer key ranges or hash buckets."""
    count: int
    lower: int = 0
    width: int = 1

    def expression(self, spec: TableSpec) -> sql.Composable:
        if spec.integer_key:
            return sql.SQL("floor(({} - {})::numeric / {})::int8").format(
                sql.Identifier(spec.key[0]), self.lower, self.width)
        return sql.SQL("mod(('x' || lpad(substr(md5({}), 1, 8), 16, '0'))::bit(64)::int8, {})").format(
            _key_text(spec), self.count)

    def predicate(self, spec: TableSpec, ranges: Iterable[int]) -> sql.Composable:
        if spec.integer_key:  # key ranges, so an index on the key serves the drill-down
            key = sql.Identifier(spec.key[0])
            return sql.SQL(" OR ").join(
                sql.SQL("({k} >= {lo} AND {k} < {hi})").format(
                    k=key, lo=self.lower + r * self.width, hi=self.lower + (r + 1) * self.width)
                for r in sorted(ranges))
        return sql.SQL("{} = ANY({})").format(self.expression(spec), sql.Literal(sorted(ranges)))


def _where(spec: TableSpec, side: Literal["source", "target"], *more: sql.Composable) -> sql.Composable:
    parts = list(more)
    if side == "source" and spec.row_filter:
        parts.append(sql.SQL(f"({spec.row_filter})"))
    return sql.SQL(" WHERE ") + sql.SQL(" AND ").join(parts) if parts else sql.SQL("")


def _plan_ranges(snaps: Snapshots, spec: TableSpec) -> _Ranges:
    estimate_sql = "SELECT greatest(reltuples, 0)::int8 FROM pg_class WHERE oid = to_regclass(%s)"
    name = spec.qualified.as_string(snaps.source)
    rows = max(int((conn.execute(estimate_sql, (name,)).fetchone() or (0,))[0] or 0)
               for conn in (snaps.source, snaps.target))
    count = max(1, min(MAX_RANGES, -(-rows // ROWS_PER_RANGE)))
    if not spec.integer_key:
        return _Ranges(count)
    key = sql.Identifier(spec.key[0])
    sides: tuple[tuple[psycopg.Connection[Any], Literal["source", "target"]], ...] = (
        (snaps.source, "source"), (snaps.target, "target"))
    bounds = [conn.execute(sql.SQL("SELECT min({k}), max({k}) FROM {t}{w}").format(
        k=key, t=spec.qualified, w=_where(spec, side))).fetchone() for conn, side in sides]
    lows = [b[0] for b in bounds if b and b[0] is not None]
    highs = [b[1] for b in bounds if b and b[1] is not None]
    if not lows:
        return _Ranges(1)
    lower, upper = min(lows), max(highs)
    return _Ranges(count, lower, max(1, -(-(upper - lower + 1) // count)))


def _range_sums(conn: psycopg.Connection[Any], spec: TableSpec, ranges: _Ranges,
                side: Literal["source", "target"]) -> dict[int, tuple[int, int]]:
    query = sql.SQL(
        "SELECT r, count(*), sum(h) FROM (SELECT {r} AS r, "
        "('x' || substr(md5({row}), 1, 15))::bit(60)::int8 AS h FROM {t}{w}) s GROUP BY r").format(
        r=ranges.expression(spec), row=_row_text(spec), t=spec.qualified, w=_where(spec, side))
    return {r: (int(n), int(h)) for r, n, h in conn.execute(query)}


def _range_rows(conn: psycopg.Connection[Any], spec: TableSpec, ranges: _Ranges, which: set[int],
                side: Literal["source", "target"]) -> list[tuple[Any, ...]]:
    keys = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(k)) for k in spec.key) \
        if spec.key else _row_text(spec)
    query = sql.SQL("SELECT {keys}, md5({row}) FROM {t}{w}").format(
        keys=keys, row=_row_text(spec), t=spec.qualified,
        w=_where(spec, side, sql.SQL("({})").format(ranges.predicate(spec, which))))
    return conn.execute(query).fetchall()


def _missing_columns(conn: psycopg.Connection[Any], spec: TableSpec) -> list[str]:
    found = conn.execute("SELECT array_agg(attname::text) FROM pg_attribute WHERE attrelid = "
                         "to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
                         (spec.qualified.as_string(conn),)).fetchone()
    if not found or found[0] is None:
        return ["(the table itself)"]
    return [c for c in spec.columns if c not in found[0]]


def compare_sql(snaps: Snapshots, spec: TableSpec, max_keys: int) -> TableResult:
    """Compare one table in the databases: range sums first, rows only where they differ; list
    at most ``max_keys`` keys per kind of difference (the counts are always complete)."""
    result = TableResult(spec.display, key=list(spec.key or ["row"]))
    if missing := _missing_columns(snaps.target, spec):
        result.error = f"missing on the target: {', '.join(missing)}"
        return result
    ranges = _plan_ranges(snaps, spec)
    source = _range_sums(snaps.source, spec, ranges, "source")
    target = _range_sums(snaps.target, spec, ranges, "target")
    result.ranges = ranges.count
    result.source_rows = sum(n for n, _ in source.values())
    result.target_rows = sum(n for n, _ in target.values())
    differing = {r for r in source.keys() | target.keys() if source.get(r) != target.get(r)}
    result.differing_ranges = len(differing)
    if not differing:
        return result
    source_rows = _range_rows(snaps.source, spec, ranges, differing, "source")
    target_rows = _range_rows(snaps.target, spec, ranges, differing, "target")
    _classify(result, spec, source_rows, target_rows, max_keys)
    return result


def _classify(result: TableResult, spec: TableSpec, source_rows: Iterable[Sequence[Any]],
              target_rows: Iterable[Sequence[Any]], max_keys: int) -> None:
    """Fill missing/extra/changed from (key text..., row hash) rows of both sides."""
    if spec.key:
        source = {tuple(r[:-1]): r[-1] for r in source_rows}
        target = {tuple(r[:-1]): r[-1] for r in target_rows}
        missing = sorted(source.keys() - target.keys(), key=_sort_key)
        extra = sorted(target.keys() - source.keys(), key=_sort_key)
        changed = sorted((k for k in source.keys() & target.keys() if source[k] != target[k]), key=_sort_key)
    else:  # a multiset of whole rows: a duplicate too many or too few is a difference
        source_count = Counter(r[0] for r in source_rows)
        target_count = Counter(r[0] for r in target_rows)
        missing = sorted(((r,) for r in (source_count - target_count).elements()), key=_sort_key)
        extra = sorted(((r,) for r in (target_count - source_count).elements()), key=_sort_key)
        changed = []
    result.missing_count, result.extra_count, result.changed_count = len(missing), len(extra), len(changed)
    result.missing = [list(k) for k in missing[:max_keys]]
    result.extra = [list(k) for k in extra[:max_keys]]
    result.changed = [list(k) for k in changed[:max_keys]]


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    # Integers in text form sort numerically; anything else by its text.
    return tuple((0, int(v), "") if isinstance(v, str) and v.lstrip("-").isdigit() else (1, 0, str(v))
                 for v in key)


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
        from .spark import spark_session
        spark = spark_session(master, app_name="applier verify", jar=jdbc_jar)
    results: dict[str, TableResult] = {}
    rounds = 0
    pending = specs
    while True:
        rounds += 1
        if spark is not None:
            from .verify_spark import compare_spark
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


def format_table(report: VerifyReport) -> str:
    """The report as an aligned text table, then the differing keys of each table."""
    header = ("table", "source rows", "target rows", "ranges", "differ", "missing", "extra", "changed", "result")
    rows = [(t.table, str(t.source_rows), str(t.target_rows), str(t.ranges), str(t.differing_ranges),
             str(t.missing_count), str(t.extra_count), str(t.changed_count),
             "equal" if t.equal else ("ERROR" if t.error else "DIFFERENT")) for t in report.tables]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                       enumerate(zip(row, widths))) for row in [header, *rows]]
    for t in report.tables:
        if t.error:
            lines.append(f"{t.table}: {t.error}")
        for kind, keys, count in (("missing on target", t.missing, t.missing_count),
                                  ("extra on target", t.extra, t.extra_count),
                                  ("changed", t.changed, t.changed_count)):
            for key in keys:
                lines.append(f"{t.table}: {kind}: " + ", ".join(f"{c}={v}" for c, v in zip(t.key, key)))
            if count > len(keys):
                lines.append(f"{t.table}: {kind}: ... and {count - len(keys)} more")
    slots = (", ".join(f"{p['slot_name']} at {p['commit_lsn']}" for p in report.target_positions)
             or "no applier.progress")
    lines.append(f"source read at WAL {report.source_wal_lsn}; target had applied {slots}; "
                 f"{report.rounds} round(s); engine {report.engine}")
    lines.append("EQUAL" if report.equal else "DIFFERENT")
    return "\n".join(lines)


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
