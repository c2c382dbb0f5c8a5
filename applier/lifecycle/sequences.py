"""``applier sequences``: the target's sequences set past the source's, so a switched-over
application never gets a value from ``nextval`` that the source has handed out already.

Owns finding the sequences of the published tables on the source (owned by one of their columns:
identity and serial columns; and named in a column's default, ``nextval('...')``: both are
dependencies in ``pg_depend``), reading them all in one REPEATABLE READ snapshot of the source,
and setting each target sequence of the same name with ``setval`` to the source's value plus
``--margin`` (in the sequence's direction), never moving one backwards: a target sequence
already as far or further stays as it is. Also the command's report (sequence, source value,
target before, target after). ``applier sync`` runs it once its copy is done, ``applier
cutover`` as one of its steps.

Must never write to the source, create or alter a sequence, or set a target sequence to a value
before its current one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql

from ..config import Settings
from ..exit_codes import ExitCode
from ..progress.bookkeeping import SqlBookkeeping
from .servers import LifecycleError, connect

__all__ = ["PublishedSequence", "SequenceResult", "SequenceState", "SequencesReport",
           "published_sequences", "run_sequences", "synchronise_sequences"]

log = logging.getLogger(__name__)

#: The sequences of the published tables: owned by a column (identity 'i', serial and OWNED BY
#: 'a') or named in a column default (the default's normal dependency on the sequence).
_PUBLISHED_SEQUENCES = """
    WITH published AS (
        SELECT DISTINCT c.oid
        FROM pg_catalog.pg_publication_tables pt
        JOIN pg_catalog.pg_namespace n ON n.nspname = pt.schemaname
        JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
        WHERE pt.pubname = ANY(%(publications)s)
    ), uses AS (
        SELECT d.objid AS seq, d.refobjid AS tab
        FROM pg_catalog.pg_depend d
        WHERE d.classid = 'pg_catalog.pg_class'::regclass
          AND d.refclassid = 'pg_catalog.pg_class'::regclass AND d.deptype IN ('a', 'i')
        UNION
        SELECT d.refobjid, ad.adrelid
        FROM pg_catalog.pg_depend d
        JOIN pg_catalog.pg_attrdef ad ON ad.oid = d.objid
        WHERE d.classid = 'pg_catalog.pg_attrdef'::regclass
          AND d.refclassid = 'pg_catalog.pg_class'::regclass
    )
    SELECT sn.nspname::text, s.relname::text,
           array_agg(DISTINCT pg_catalog.format('%%I.%%I', tn.nspname, t.relname))
    FROM uses u
    JOIN published p ON p.oid = u.tab
    JOIN pg_catalog.pg_class s ON s.oid = u.seq AND s.relkind = 'S'
    JOIN pg_catalog.pg_namespace sn ON sn.oid = s.relnamespace
    JOIN pg_catalog.pg_class t ON t.oid = u.tab
    JOIN pg_catalog.pg_namespace tn ON tn.oid = t.relnamespace
    GROUP BY 1, 2 ORDER BY 1, 2
"""


@dataclass(frozen=True)
class SequenceState:
    """A sequence as ``setval`` sets it: ``last_value`` handed out when ``is_called``, else the
    value the next ``nextval`` returns."""

    last_value: int
    is_called: bool
    increment: int

    @property
    def next_value(self) -> int:
        return self.last_value + self.increment if self.is_called else self.last_value

    def reaches(self, other: SequenceState) -> bool:
        """This sequence's next value is ``other``'s or beyond it, in the sequence's direction."""
        return (self.next_value - other.next_value) * (1 if self.increment > 0 else -1) >= 0

    def beyond(self, margin: int) -> SequenceState:
        return replace(self, last_value=self.last_value + margin * (1 if self.increment > 0 else -1))

    @property
    def text(self) -> str:
        return str(self.last_value) if self.is_called else f"unused (next {self.last_value})"


@dataclass
class SequenceResult:
    schema: str
    name: str
    tables: list[str]
    source: SequenceState
    before: SequenceState | None  # None: the target has no such sequence
    after: SequenceState | None
    error: str | None = None

    @property
    def display(self) -> str:
        return sql.Identifier(self.schema, self.name).as_string()

    @property
    def problem(self) -> str | None:
        """What keeps this sequence from being safe on the target, and what to do about it."""
        if self.error:
            return f"sequence {self.display}: {self.error}"
        if self.before is None:
            return (f"sequence {self.display} (of {', '.join(self.tables)}) does not exist on the "
                    "target: create it there (as the source's schema has it), then run applier "
                    "sequences again")
        return None


@dataclass
class SequencesReport:
    results: list[SequenceResult]
    dry_run: bool
    notes: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return [p for p in (r.problem for r in self.results) if p]

    def render(self) -> str:
        header = ("sequence", "source value", "target before", "target after")
        rows = [(r.display, r.source.text, r.before.text if r.before else "MISSING",
                 _after_text(r, self.dry_run)) for r in self.results]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                 for row in [header, *rows]]
        if not self.results:
            lines.append("(the published tables use no sequences)")
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"problem: {problem}" for problem in self.problems]
        return "\n".join(lines)

    def as_json(self) -> list[dict[str, Any]]:
        def state(value: SequenceState | None) -> dict[str, Any] | None:
            return None if value is None else {"last_value": value.last_value,
                                               "is_called": value.is_called}
        return [{"sequence": r.display, "tables": r.tables, "source": state(r.source),
                 "target_before": state(r.before), "target_after": state(r.after),
                 "error": r.error} for r in self.results]


def _after_text(result: SequenceResult, dry_run: bool) -> str:
    if result.error:
        return "ERROR"
    if result.after is None or result.before is None:
        return "-"
    if result.after == result.before:
        return f"{result.after.text} (kept: already there)"
    return f"{result.after.text}{' (would set)' if dry_run else ''}"


@dataclass(frozen=True)
class PublishedSequence:
    schema: str
    name: str
    tables: list[str]

    @property
    def identifier(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)


def published_sequences(conn: psycopg.Connection[Any], publications: Sequence[str]
                        ) -> list[PublishedSequence]:
    """The sequences the published tables use, each once with the tables that use it."""
    missing = set(publications) - {row[0] for row in conn.execute(
        "SELECT pubname::text FROM pg_catalog.pg_publication WHERE pubname = ANY(%s)",
        (list(publications),))}
    if missing:
        raise LifecycleError(f"source: no publication {', '.join(map(repr, sorted(missing)))} in "
                             f"database {conn.info.dbname!r}: fix --publication")
    return [PublishedSequence(schema, name, list(tables)) for schema, name, tables in
            conn.execute(_PUBLISHED_SEQUENCES, {"publications": list(publications)})]


def _read(conn: psycopg.Connection[Any], sequence: PublishedSequence) -> SequenceState:
    row = conn.execute(sql.SQL(
        "SELECT s.last_value, s.is_called, p.seqincrement FROM {} s, pg_catalog.pg_sequence p "
        "WHERE p.seqrelid = {}::regclass").format(
            sequence.identifier, sql.Literal(sequence.identifier.as_string()))).fetchone()
    assert row is not None
    return SequenceState(int(row[0]), bool(row[1]), int(row[2]))


def _read_source(conn: psycopg.Connection[Any], publications: Sequence[str]
                 ) -> list[tuple[PublishedSequence, SequenceState]]:
    """Every published sequence, all read in one REPEATABLE READ snapshot."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    try:
        sequences = published_sequences(conn, publications)
        return [(sequence, _read(conn, sequence)) for sequence in sequences]
    except psycopg.errors.InsufficientPrivilege as exc:
        raise LifecycleError(f"source: {' '.join(str(exc).split())}: the source role needs "
                             "SELECT on the sequences of the published tables (GRANT SELECT ON "
                             "ALL SEQUENCES IN SCHEMA ... TO ...)") from None
    finally:
        conn.execute("COMMIT")


def _exists(conn: psycopg.Connection[Any], sequence: PublishedSequence) -> bool:
    row = conn.execute("SELECT c.relkind = 'S' FROM pg_catalog.pg_class c WHERE c.oid = "
                       "pg_catalog.to_regclass(%s)", (sequence.identifier.as_string(),)).fetchone()
    return bool(row and row[0])


def _set(conn: psycopg.Connection[Any], sequence: PublishedSequence, source: SequenceState,
         margin: int, dry_run: bool) -> SequenceResult:
    result = SequenceResult(sequence.schema, sequence.name, sequence.tables, source, None, None)
    if not _exists(conn, sequence):
        return result
    result.before = result.after = before = _read(conn, sequence)
    wanted = replace(source, increment=before.increment).beyond(margin)
    if before.reaches(wanted):
        return result
    if dry_run:
        result.after = wanted
        return result
    try:
        conn.execute("SELECT pg_catalog.setval(%s::regclass, %s, %s)",
                     (sequence.identifier.as_string(), wanted.last_value, wanted.is_called))
    except psycopg.Error as exc:
        grant = sql.SQL("GRANT UPDATE ON SEQUENCE {} TO CURRENT_USER").format(sequence.identifier)
        hint = (f": {grant.as_string(conn)}" if isinstance(exc, psycopg.errors.InsufficientPrivilege)
                else "")
        result.error = f"cannot set it on the target: {' '.join(str(exc).split())}{hint}"
        return result
    result.after = _read(conn, sequence)
    return result


def synchronise_sequences(source_dsn: str, target_dsn: str, publications: Sequence[str], *,
                          margin: int = 0, dry_run: bool = False) -> SequencesReport:
    """Set every target sequence of the published tables to the source's value (plus ``margin``),
    never backwards; with ``dry_run`` only say what would be set. Raises ``LifecycleError`` when
    a server cannot be read."""
    source = connect(source_dsn, "source", "sequences")
    try:
        read = _read_source(source, publications)
    finally:
        source.close()
    target = connect(target_dsn, "target", "sequences")
    try:
        return SequencesReport([_set(target, sequence, state, margin, dry_run)
                                for sequence, state in read], dry_run)
    finally:
        target.close()


def _applied_note(target_dsn: str, slot: str) -> str:
    target = connect(target_dsn, "target", "sequences")
    try:
        progress = SqlBookkeeping(target).progress(slot)
    finally:
        target.close()
    if progress is None:
        return f"the target had applied nothing of slot {slot!r} yet"
    return (f"the target had applied slot {slot!r} up to commit LSN {progress.commit_lsn}"
            + (f" (committed {progress.commit_time.isoformat()})" if progress.commit_time else ""))


def run_sequences(settings: Settings) -> int:
    """``applier sequences``: OK when every sequence is set (or already there), FAILED when one
    could not be (missing on the target, not permitted) or a server could not be read."""
    settings.require("source", "target", "publication")
    try:
        report = synchronise_sequences(settings.required("source"), settings.required("target"),
                                       settings.publication, margin=settings.margin,
                                       dry_run=settings.dry_run)
        if settings.slot:
            report.notes.append(_applied_note(settings.required("target"), settings.slot))
    except LifecycleError as exc:
        print(f"applier sequences: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    if settings.dry_run:
        report.notes.append("dry run: nothing was set")
    print(report.render())
    return ExitCode.FAILED if report.problems else ExitCode.OK
