"""Replication origins on the target: tagging our own writes, tracking and filtering the stream's.

Owns three things about origins:

* **Tagging.** The apply session is set up with a replication origin (default
  ``applier_<slot>_<target database>``; origin names are server-wide, so the database is part of
  it), exactly as PostgreSQL's subscriber does with ``pg_<subscription oid>``. Every change the
  worker writes then carries that origin in the target's WAL, so a replication *out of* the
  target with ``origin = none`` (PostgreSQL 16+), or another applier with ``--skip-origin``, does
  not send our writes back: a bidirectional pair does not loop. Each target transaction also
  records the source end LSN and commit time as its origin position
  (``pg_replication_origin_xact_setup``, which the bookkeeping store folds into the progress
  statement), so
  ``pg_replication_origin_status`` on the target shows how far the source has been applied and a
  downstream consumer receives meaningful Origin messages. Without the privilege to do so
  (superuser, or EXECUTE on the origin functions) the worker says so once and runs untagged.
* **Tracking.** A source transaction that arrives with an Origin message (it was itself written
  by a replication) updates ``applier.origins``: per origin name, the origin LSN of the last
  transaction applied from it, in that same target transaction. Prepared transactions record it
  when they commit, never inside a target prepared transaction (that row lock would block every
  later transaction from the same origin until COMMIT PREPARED).
* **Filtering.** ``--skip-origin NAME`` drops whole transactions whose Origin message names NAME.

Must never decide transaction boundaries or positions; the apply stage calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

from ..errors import Cause, TargetError
from ..progress.records import OriginRecord
from ..progress.store import ApplyStore
from ..protocol.lsn import LSN
from .target import TargetSession

__all__ = ["OriginTag", "OriginTracker", "default_origin_name", "existing_origin",
           "legacy_origin_name", "tag_session"]

log = logging.getLogger(__name__)

#: SQLSTATEs meaning "this role may not use replication origins".
_NOT_PERMITTED = {"42501"}
#: The origin is still attached to a session of a worker that just died: retry shortly.
_IN_USE = {"55006", "55000"}


def default_origin_name(slot: str, database: str) -> str:
    """``applier_<slot>_<database>``; a slot already named ``applier_...`` is not prefixed twice."""
    prefix = "" if slot.startswith("applier_") else "applier_"
    return f"{prefix}{slot}_{database}"


def legacy_origin_name(slot: str, database: str) -> str:
    """The name versions before 0.2 gave the origin of a slot named ``applier_...``, kept by a
    target that has it (its id tells this worker's rows from others')."""
    return f"applier_{slot}_{database}"


@dataclass(frozen=True)
class OriginTag:
    """How the apply session is tagged: ``name`` None means untagged."""

    name: str | None
    roident: int | None = None
    xact_setup: bool = False


def _scalar(session: TargetSession, sql: str, *values: str) -> str | None:
    result = session.sql(sql, [v.encode() for v in values])
    if result.ntuples == 0:
        return None
    value = result.get_value(0, 0)
    return None if value is None else value.decode()


def existing_origin(session: TargetSession, names: Iterable[str]) -> str | None:
    """The first of ``names`` that is a replication origin on the target."""
    for name in names:
        if _scalar(session, "SELECT pg_catalog.pg_replication_origin_oid($1)", name) is not None:
            return name
    return None


def tag_session(session: TargetSession, name: str | None, warn: Callable[[str], None]) -> OriginTag:
    """Create the origin if needed and attach the session to it; untagged when not permitted."""
    if name is None:
        return OriginTag(None)
    allowed = _scalar(
        session, "SELECT pg_catalog.has_function_privilege("
        "'pg_catalog.pg_replication_origin_session_setup(text)', 'EXECUTE') AND "
        "pg_catalog.has_function_privilege('pg_catalog.pg_replication_origin_create(text)', "
        "'EXECUTE') AND pg_catalog.has_function_privilege("
        "'pg_catalog.pg_replication_origin_oid(text)', 'EXECUTE')")
    if allowed != "t":
        warn(f"the target role may not use replication origins (needs superuser or EXECUTE on "
             f"pg_replication_origin_create and pg_replication_origin_session_setup): the "
             f"worker's writes are not tagged with origin {name!r}, so a replication out of the "
             "target cannot tell them from local writes")
        return OriginTag(None)
    try:
        roident = _scalar(session, "SELECT pg_catalog.pg_replication_origin_oid($1)", name)
        if roident is None:
            try:
                roident = _scalar(session, "SELECT pg_catalog.pg_replication_origin_create($1)", name)
            except TargetError as exc:
                if exc.sqlstate not in ("23505", "42710"):  # created concurrently: fine
                    raise
                roident = _scalar(session, "SELECT pg_catalog.pg_replication_origin_oid($1)", name)
        session.sql("SELECT pg_catalog.pg_replication_origin_session_setup($1)", [name.encode()])
    except TargetError as exc:
        if exc.sqlstate in _IN_USE:
            # A worker killed a moment ago still has a target backend attached to the origin.
            raise TargetError(f"{exc} (waiting for the previous worker's target session to end)",
                              sqlstate=exc.sqlstate, cause=Cause.BUSY) from exc
        if exc.sqlstate in _NOT_PERMITTED:
            warn(f"cannot use replication origin {name!r} on the target ({exc}); the worker's "
                 "writes are not tagged")
            return OriginTag(None)
        raise
    xact_setup = _scalar(
        session, "SELECT pg_catalog.has_function_privilege("
        "'pg_catalog.pg_replication_origin_xact_setup(pg_lsn, timestamptz)', 'EXECUTE')") == "t"
    return OriginTag(name, int(roident) if roident is not None else None, xact_setup)


class OriginTracker:
    """Records per-origin positions and decides which origins' transactions are dropped."""

    def __init__(self, store: ApplyStore, tag: OriginTag, skip: Iterable[str] = ()) -> None:
        self.store = store
        self.tag = tag
        self.skip = frozenset(skip)

    def record(self, name: str, origin_lsn: LSN, commit_lsn: LSN, commit_time: datetime | None) -> None:
        """Inside the open target transaction: the last transaction applied from origin ``name``."""
        self.store.record_origin(OriginRecord(name, origin_lsn, commit_lsn, commit_time))
