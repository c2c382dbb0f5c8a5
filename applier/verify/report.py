"""What ``applier verify`` compares and what it found, whichever engine compared.

Owns: the description of one table to compare (``TableSpec``), the result per table
(``TableResult``) and for the whole run (``VerifyReport``, also as JSON), the aligned text form
of a report, what ``--repair`` would do to a differing table (``repair_plan``: by key, or a
whole copy beyond ``REPAIR_KEYS``), the range sizes both engines aim at, and ``VerifyError``. Pure
data and formatting: must never connect to a database or import an engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from psycopg import sql

__all__ = ["MAX_RANGES", "REPAIR_KEYS", "ROWS_PER_RANGE", "TableResult", "TableSpec", "VerifyError",
           "VerifyReport", "format_table", "repair_plan"]

#: Rows per range aimed at: small enough that re-reading a differing range is cheap.
ROWS_PER_RANGE = 5_000
MAX_RANGES = 4_096
#: A table with more differing keys than this is copied again whole rather than repaired by key
#: (a repair holds the worker while it writes).
REPAIR_KEYS = 10_000


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
    keyed: bool = True  # False: compared as a multiset of whole rows
    #: Every differing key (missing, extra or changed), as text, up to REPAIR_KEYS + 1: what a
    #: repair rewrites. Not part of the JSON report.
    differing_keys: list[list[str | None]] = field(default_factory=list, repr=False)

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
    #: Both sides were read at one source position, ``source_wal_lsn``, the worker holding there.
    exact: bool = False
    notes: list[str] = field(default_factory=list)
    #: What ``--repair`` did, per table (``applier.repair``).
    repairs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(t.equal for t in self.tables)

    def to_json(self) -> str:
        data = asdict(self)
        data["equal"] = self.equal
        for table, result in zip(data["tables"], self.tables):
            table["equal"] = result.equal
            del table["differing_keys"]
            if not result.equal and result.error is None:
                table["repair"] = repair_plan(result)
        return json.dumps(data, indent=2, default=str)


def repair_plan(result: TableResult) -> str:
    """What ``--repair`` would do to a differing table."""
    keys = result.missing_count + result.extra_count + result.changed_count
    if not result.keyed or keys > REPAIR_KEYS:
        why = "no key" if not result.keyed else f"{keys} keys differ"
        return f"copy the whole table again, as applier resync does ({why})"
    return (f"write {result.missing_count} missing and {result.changed_count} changed row(s) and "
            f"delete {result.extra_count} extra one(s), by key, as the source has them")


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
    for t in report.tables:
        if not t.equal and t.error is None and not report.repairs:
            lines.append(f"{t.table}: --repair would {repair_plan(t)}")
    for done in report.repairs:
        lines.append(f"{done['table']}: {done['outcome']}")
    slots = (", ".join(f"{p['slot_name']} at {p['commit_lsn']}" for p in report.target_positions)
             or "no applier.progress")
    if report.exact:
        lines.append(f"source and target read at source position {report.source_wal_lsn}: the worker "
                     f"held there (target had applied {slots}); engine {report.engine}")
    else:
        lines.append(f"source read at WAL {report.source_wal_lsn}; target had applied {slots}; "
                     f"{report.rounds} round(s); engine {report.engine}")
    lines += [f"note: {note}" for note in report.notes]
    if report.repairs and all(r["action"] != "refused" for r in report.repairs):
        lines.append("DIFFERENT, REPAIRED")
    else:
        lines.append("EQUAL" if report.equal else "DIFFERENT")
    return "\n".join(lines)
