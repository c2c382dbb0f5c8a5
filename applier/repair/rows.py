"""``applier verify --repair`` by key: the rows of the keys verify found different, written as the
source had them at one position, while the worker holds there.

Owns one repair round: a source snapshot whose position P the worker is asked to hold at
(``verify.held``); the source rows of the differing keys read from it (published columns, through
the publication's row filter, as COPY text); then, once the worker has applied exactly the
source transactions committing before P, one target transaction that makes those keys equal to
the source at P (updated where the target has the key, inserted where it lacks it, deleted where
the source lacks it; other columns of the target row are kept), records each table's repair in
``applier.repairs`` and its xid as the worker's own (``applier.copy_transactions``), and
commits; the worker then goes on from P. So every change committed before P is in the repaired
rows or was applied before them, and every later one is applied after them: none is lost or
applied twice, and the worker skips nothing. A row locked on the target by a transaction it
holds open (prepared, or applied as it streams) makes the round fail after a lock timeout with
nothing written. Must never compare tables or write outside the keys it was given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from .. import faults
from ..connections import connect
from ..faults import FailPoint
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.repairs import RepairCounts, Repairs
from ..protocol.lsn import LSN
from ..sync.target import target_session
from ..verify.held import held_position
from ..verify.report import TableSpec, VerifyError
from ..verify.snapshots import TEXT_SETTINGS

__all__ = ["KeyedRepair", "RepairRound", "recorded_keys", "repair_rows"]

log = logging.getLogger(__name__)

#: How long the repair waits for a row lock on the target before it gives up (see above).
LOCK_TIMEOUT = "5s"


@dataclass(frozen=True)
class KeyedRepair:
    """One table's differing keys (as text, in ``spec.key`` order)."""

    spec: TableSpec
    keys: list[list[str | None]]


@dataclass(frozen=True)
class RepairRound:
    """What one round wrote: its position, and the rows per table."""

    position: LSN
    counts: dict[str, RepairCounts]


def repair_rows(source_dsn: str, target_dsn: str, slot: str, repairs: list[KeyedRepair], *,
                timeout: float) -> RepairRound:
    """Write the source's rows of every table's keys at one position held by the worker."""
    target = target_session(target_dsn, "applier repair")
    source = connect(source_dsn, autocommit=True, application_name="applier repair")
    try:
        source.execute(TEXT_SETTINGS)
        source.execute(sql.SQL("SET client_encoding = {}").format(
            sql.Literal(target.info.parameter_status("server_encoding") or "UTF8")))
        with held_position(source_dsn, target_dsn, slot, timeout=timeout, purpose="repair",
                           source=source) as held:
            data = {r.spec.display: _source_rows(source, r) for r in repairs}
            held.reached()
            faults.hit(FailPoint.REPAIR_HELD)
            counts = _write(target, slot, held.position, repairs, data)
            faults.hit(FailPoint.AFTER_REPAIR)
        return RepairRound(held.position, counts)
    finally:
        source.close()
        target.close()


def _key_types(source: psycopg.Connection[Any], spec: TableSpec) -> list[str]:
    found = dict(source.execute(
        "SELECT attname::text, pg_catalog.format_type(atttypid, atttypmod) FROM pg_catalog.pg_attribute "
        "WHERE attrelid = pg_catalog.to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
        (spec.qualified.as_string(source),)).fetchall())
    return [found[k] for k in spec.key]


def _source_rows(source: psycopg.Connection[Any], repair: KeyedRepair) -> bytes:
    """The source's rows of the keys in the snapshot, as COPY text of the published columns."""
    spec = repair.spec
    names = [sql.Identifier(f"k{i}") for i in range(len(spec.key))]
    arrays = sql.SQL(", ").join(
        sql.SQL("ARRAY[{}]::text[]").format(sql.SQL(", ").join(sql.Literal(key[i]) for key in repair.keys))
        for i in range(len(spec.key)))
    casts = sql.SQL(", ").join(sql.SQL("{}::{}").format(name, sql.SQL(kind))
                               for name, kind in zip(names, _key_types(source, spec)))
    where = sql.SQL("({}) IN (SELECT {} FROM unnest({}) AS u({}))").format(
        sql.SQL(", ").join(map(sql.Identifier, spec.key)), casts, arrays, sql.SQL(", ").join(names))
    if spec.row_filter:
        where = sql.SQL("{} AND ({})").format(where, sql.SQL(spec.row_filter))
    query = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT").format(
        sql.SQL(", ").join(map(sql.Identifier, spec.columns)), spec.qualified, where)
    out = bytearray()
    with source.cursor().copy(query) as copy:
        for chunk in copy:
            out += chunk
    return bytes(out)


def _write(target: psycopg.Connection[Any], slot: str, position: LSN, repairs: list[KeyedRepair],
           data: dict[str, bytes]) -> dict[str, RepairCounts]:
    counts = {}
    try:
        with target.transaction():
            target.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            SqlBookkeeping(target).record_copy_transaction(slot)
            for repair in repairs:
                spec = repair.spec
                counts[spec.display] = written = _write_table(target, repair, data[spec.display])
                Repairs(target).record_repair(slot, (spec.schema, spec.name), position,
                                              recorded_keys(repair), written)
                log.info("repaired %s at %s: %d inserted, %d updated, %d deleted", spec.display,
                         position, written.inserted, written.updated, written.deleted)
    except psycopg.errors.LockNotAvailable as exc:
        raise VerifyError("a row to repair is locked on the target by a transaction it holds "
                          "open (prepared, or being applied as it streams): nothing was written; "
                          "run verify --repair again once that transaction is over") from exc
    return counts


def _write_table(target: psycopg.Connection[Any], repair: KeyedRepair, rows: bytes) -> RepairCounts:
    spec = repair.spec
    table, columns = spec.qualified, sql.SQL(", ").join(map(sql.Identifier, spec.columns))
    keys = sql.SQL(", ").join(map(sql.Identifier, spec.key))

    def match(left: str, right: str) -> sql.Composable:
        return sql.SQL(" AND ").join(
            sql.SQL("{}.{} = {}.{}").format(sql.Identifier(left), sql.Identifier(k),
                                           sql.Identifier(right), sql.Identifier(k)) for k in spec.key)

    source_rows, wanted = sql.Identifier("applier_repair_rows"), sql.Identifier("applier_repair_keys")
    target.execute(sql.SQL("CREATE TEMP TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(
        source_rows, columns, table))
    target.execute(sql.SQL("CREATE TEMP TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(
        wanted, keys, table))
    with target.cursor().copy(sql.SQL("COPY {} ({}) FROM STDIN").format(source_rows, columns)) as copy:
        copy.write(rows)
    with target.cursor().copy(sql.SQL("COPY {} FROM STDIN").format(wanted)) as copy:
        for key in repair.keys:
            copy.write_row(key)
    deleted = target.execute(sql.SQL(
        "DELETE FROM {t} AS t USING {k} AS k WHERE {tk} AND NOT EXISTS "
        "(SELECT FROM {r} AS r WHERE {rt})").format(
        t=table, k=wanted, r=source_rows, tk=match("t", "k"), rt=match("r", "t"))).rowcount
    updated = target.execute(sql.SQL("UPDATE {t} AS t SET ({c}) = ROW({rc}) FROM {r} AS r WHERE {m}").format(
        t=table, c=columns, r=source_rows, m=match("t", "r"),
        rc=sql.SQL(", ").join(sql.SQL("r.{}").format(sql.Identifier(c)) for c in spec.columns))).rowcount
    inserted = target.execute(sql.SQL(
        "INSERT INTO {t} ({c}) SELECT {c} FROM {r} AS r WHERE NOT EXISTS "
        "(SELECT FROM {t} AS t WHERE {m})").format(
        t=table, c=columns, r=source_rows, m=match("t", "r"))).rowcount
    target.execute(sql.SQL("DROP TABLE {}, {}").format(source_rows, wanted))
    return RepairCounts(inserted, updated, deleted)


def recorded_keys(repair: KeyedRepair) -> list[Any]:
    """The keys for the record: [low, high] ranges of a single integer key, else the keys."""
    if not repair.spec.integer_key:
        return [list(key) for key in repair.keys]
    ranges: list[list[int]] = []
    for value in sorted(int(key[0]) for key in repair.keys if key[0] is not None):
        if ranges and value == ranges[-1][1] + 1:
            ranges[-1][1] = value
        else:
            ranges.append([value, value])
    return ranges
