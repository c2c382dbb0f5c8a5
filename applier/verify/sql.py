"""``applier verify`` (the default engine): the comparison computed by the databases themselves.

Owns: per table, only the row counts of both sides (``applier cutover --verify counts``), or
assigning rows to ranges, each side's count and hash sum per range, then the
rows of the ranges that differ, and which keys are missing, extra or changed. Must never write
to either database, or need PySpark.

How a comparison works: each row's hash is ``md5`` of its published columns' text form (both
sides read with the same text settings, see :mod:`.snapshots`). Rows are grouped into ranges:
equal-width ranges of a single integer key, otherwise buckets of the key's hash (the whole
row's, for a table without a key). Each side returns per range a count and the sum of 60-bit row
hashes; only ranges that differ are read row by row. Keys are compared by their text form.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import sql

from .report import MAX_RANGES, REPAIR_KEYS, ROWS_PER_RANGE, TableResult, TableSpec
from .snapshots import Snapshots

__all__ = ["compare_sql", "count_sql"]


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


def count_sql(snaps: Snapshots, spec: TableSpec) -> TableResult:
    """Only the row counts of one table on both sides (the source's through its row filter)."""
    result = TableResult(spec.display, key=list(spec.key or ["row"]))
    if missing := _missing_columns(snaps.target, spec):
        result.error = f"missing on the target: {', '.join(missing)}"
        return result
    sides: tuple[tuple[psycopg.Connection[Any], Literal["source", "target"]], ...] = (
        (snaps.source, "source"), (snaps.target, "target"))
    counts = [conn.execute(sql.SQL("SELECT count(*) FROM {}{}").format(
        spec.qualified, _where(spec, side))).fetchone() for conn, side in sides]
    result.source_rows, result.target_rows = (int(row[0]) if row else 0 for row in counts)
    return result


def compare_sql(snaps: Snapshots, spec: TableSpec, max_keys: int) -> TableResult:
    """Compare one table in the databases: range sums first, rows only where they differ; list
    at most ``max_keys`` keys per kind of difference (the counts are always complete)."""
    result = TableResult(spec.display, key=list(spec.key or ["row"]), keyed=bool(spec.key))
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
    if spec.key:
        result.differing_keys = [list(k) for k in (missing + extra + changed)[:REPAIR_KEYS + 1]]
    result.missing = [list(k) for k in missing[:max_keys]]
    result.extra = [list(k) for k in extra[:max_keys]]
    result.changed = [list(k) for k in changed[:max_keys]]


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    # Integers in text form sort numerically; anything else by its text.
    return tuple((0, int(v), "") if isinstance(v, str) and v.lstrip("-").isdigit() else (1, 0, str(v))
                 for v in key)
