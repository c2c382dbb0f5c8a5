"""Both sides of a comparison read at consistent points, with values printed alike.

Owns: connecting to the source and the target for ``applier verify`` (read only, REPEATABLE
READ, with the same TimeZone, DateStyle, IntervalStyle, extra_float_digits and bytea_output on
both, so text forms agree whenever values do), and taking their snapshots: at one source
position while the slot's worker holds there (``held_snapshots``, through ``held``), or, with no
worker to hold, the target's first together with the position it had applied, then the
source's (``snapshots``). Must never write to either database (``held`` writes only the hold
request).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from ..connections import connect
from .held import held_position
from .report import VerifyError

__all__ = ["TEXT_SETTINGS", "Snapshots", "held_snapshots", "snapshots"]

#: Session settings under which both sides print equal values as equal text.
TEXT_SETTINGS = ("SET TimeZone = 'UTC'; SET DateStyle = 'ISO, YMD'; SET IntervalStyle = 'postgres'; "
                  "SET extra_float_digits = 3; SET bytea_output = 'hex'")


@dataclass
class Snapshots:
    """Both sides, each in one REPEATABLE READ, READ ONLY transaction, and where they were read."""
    source: psycopg.Connection[Any]
    target: psycopg.Connection[Any]
    source_wal_lsn: str
    target_positions: list[dict[str, Any]]
    #: Both were read at one source position (``source_wal_lsn``) while the worker held there.
    exact: bool = False


def _connect(dsn: str, side: str) -> psycopg.Connection[Any]:
    try:
        conn = connect(dsn, application_name="applier verify")
    except psycopg.Error as exc:
        raise VerifyError(f"cannot connect to the {side}: {exc}") from exc
    conn.execute(TEXT_SETTINGS)
    conn.commit()
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = True
    return conn


def _positions(target: psycopg.Connection[Any], slot: str | None) -> list[dict[str, Any]]:
    """The applied positions the target's snapshot shows (its first query takes the snapshot)."""
    if target.execute("SELECT to_regclass('applier.progress')").fetchone() == (None,):
        return []
    cur = target.execute("SELECT slot_name, commit_lsn::text, end_lsn::text, commit_time "
                         "FROM applier.progress WHERE %(slot)s::text IS NULL OR slot_name = %(slot)s "
                         "ORDER BY slot_name", {"slot": slot})
    return [dict(zip(("slot_name", "commit_lsn", "end_lsn", "commit_time"), row))
            for row in cur.fetchall()]


@contextmanager
def snapshots(source_dsn: str, target_dsn: str, slot: str | None) -> Iterator[Snapshots]:
    """Snapshot the target first, then the source: the source is never behind the target, so a
    row the target has and the source lacks is a real extra row or a delete still in flight."""
    target = _connect(target_dsn, "target")
    source: psycopg.Connection[Any] | None = None
    try:
        positions = _positions(target, slot)
        source = _connect(source_dsn, "source")
        row = source.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        yield Snapshots(source, target, row[0], positions)
    finally:
        for conn in (source, target):
            if conn is not None:
                conn.close()


@contextmanager
def held_snapshots(source_dsn: str, target_dsn: str, slot: str, timeout: float) -> Iterator[Snapshots]:
    """The source read at a position P, the target when the worker of ``slot`` has applied
    exactly the transactions committing before P (``held``); the worker goes on at once."""
    source = _connect(source_dsn, "source")
    target: psycopg.Connection[Any] | None = None
    try:
        with held_position(source_dsn, target_dsn, slot, timeout=timeout, purpose="verify",
                           source=source) as held:
            target = _connect(target_dsn, "target")
            held.reached()
            positions = _positions(target, slot)
        yield Snapshots(source, target, str(held.position), positions, exact=True)
    finally:
        for conn in (source, target):
            if conn is not None:
                conn.close()
