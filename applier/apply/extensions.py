"""What the apply stage does beyond applying rows, set up once per target session.

Owns reading the target's capabilities (version, ``max_prepared_transactions``,
``track_commit_timestamp``, database) and building from them and the settings the parts the
apply stage consults: two-phase handling (``twophase``), the replication origin tag and origin
tracking (``origins``), logical messages (``messages``), conflicts (``conflicts``) and skip
requests (``skipping``). Must never apply anything itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import parse_conflict_policies
from .conflicts import ConflictHandler, read_copy_xids
from .messages import MessageSink
from .origins import PROGRESS_WITH_ORIGIN_SQL, OriginTag, OriginTracker, default_origin_name, tag_session
from .session import TargetError, TargetSession
from .skipping import SkipRequests, read_skip_request
from .twophase import TwoPhase, resolve_mode

__all__ = ["Extensions", "TargetInfo", "default_extensions", "probe_target", "setup_extensions"]

log = logging.getLogger(__name__)


@dataclass
class Extensions:
    conflicts: ConflictHandler
    messages: MessageSink
    origins: OriginTracker
    skips: SkipRequests
    two_phase: TwoPhase | None = None
    #: The progress statement to use instead of the apply stage's own (None: its own).
    progress_sql: str | None = None


@dataclass(frozen=True)
class TargetInfo:
    version_num: int
    max_prepared_transactions: int
    track_commit_timestamp: bool
    database: str
    database_oid: int


def probe_target(session: TargetSession) -> TargetInfo:
    result = session.sql(
        "SELECT pg_catalog.current_setting('server_version_num'), "
        "pg_catalog.current_setting('max_prepared_transactions'), "
        "pg_catalog.current_setting('track_commit_timestamp'), pg_catalog.current_database(), "
        "(SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())")
    values = [result.get_value(0, i).decode() for i in range(5)]
    return TargetInfo(int(values[0]), int(values[1]), values[2] == "on", values[3], int(values[4]))


def default_extensions(session: TargetSession, slot: str) -> Extensions:
    """Defaults without a target probe: conflicts logged under 'apply', messages to the table,
    no origin tag, no skip request, no two-phase."""
    return Extensions(ConflictHandler(session, slot), MessageSink(session, slot),
                      OriginTracker(session, slot, OriginTag(None)), SkipRequests(session, slot, None))


def setup_extensions(session: TargetSession, slot: str, *, two_phase: bool,
                     two_phase_mode: str = "auto", replication_origin: str | None = None,
                     skip_origins: Sequence[str] = (), message_sink: str = "table",
                     message_prefixes: Sequence[str] = (), conflict_policy: Sequence[str] = (),
                     warn: Callable[[str], None] = log.warning) -> Extensions:
    """Probe the target, tag the session with the worker's replication origin, and build the
    extensions. Raises ValueError for a setting the target cannot honour."""
    info = probe_target(session)
    name = replication_origin or default_origin_name(slot, info.database)
    tag = tag_session(session, None if name.lower() == "none" else name, warn)
    origin_id = None
    if tag.name is not None and tag.roident is not None:
        if info.version_num < 160000:
            reason = ("off: PostgreSQL 15 cannot tell which origin wrote a row "
                      "(pg_xact_commit_timestamp_origin is 16+)")
        elif not info.track_commit_timestamp:
            reason = "off: the target has track_commit_timestamp = off"
        else:
            origin_id, reason = tag.roident, "on"
        log.info("writes tagged with replication origin %r (id %s); update_origin_differs "
                 "detection %s", tag.name, tag.roident, reason)
    default_policy, table_policies = parse_conflict_policies(list(conflict_policy))
    copy_xids = read_copy_xids(session, slot) if origin_id is not None else ()
    conflicts = ConflictHandler(session, slot, default_policy, table_policies, origin_id, copy_xids)
    handler = None
    if two_phase:
        mode = resolve_mode(two_phase_mode, info.max_prepared_transactions)
        handler = TwoPhase(session, slot, mode, info.database_oid)
        log.info("two-phase transactions: mode %s (target max_prepared_transactions = %d)", mode,
                 info.max_prepared_transactions)
    try:
        skip_lsn = read_skip_request(session, slot)
    except TargetError as exc:
        raise TargetError(f"{exc} (reading applier.skip_requests)", sqlstate=exc.sqlstate,
                          transient=exc.transient) from exc
    if skip_lsn is not None:
        log.warning("will skip the source transaction finishing at %s (applier.skip_requests)",
                    skip_lsn)
    return Extensions(
        conflicts=conflicts,
        messages=MessageSink(session, slot, message_sink, message_prefixes),
        origins=OriginTracker(session, slot, tag, skip_origins),
        skips=SkipRequests(session, slot, skip_lsn),
        two_phase=handler,
        progress_sql=PROGRESS_WITH_ORIGIN_SQL if tag.name is not None and tag.xact_setup else None)
