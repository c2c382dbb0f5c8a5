"""What the apply stage does beyond applying rows, set up once per target session.

Owns reading the target's capabilities (version, ``max_prepared_transactions``,
``track_commit_timestamp``, database), tagging the session with the worker's replication origin,
and building from them and the settings the handlers the apply stage consults: two-phase
handling (``twophase``), origin tracking and filtering (``origins``), logical messages
(``messages``), conflicts (``conflicts``) and skip requests (``skipping``). Also builds the
handlers of a second session of the same worker (``for_second_session``: a transaction applied
as it streams). Must never apply anything itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import parse_conflict_policies
from .conflicts import ConflictHandler
from .messages import MessageSink
from .origins import (
    OriginTag,
    OriginTracker,
    default_origin_name,
    existing_origin,
    legacy_origin_name,
    tag_session,
)
from .skipping import SkipRequests
from .target import TargetSession
from .transaction import TargetTransaction
from .twophase import TwoPhase, resolve_mode

__all__ = ["Handlers", "TargetInfo", "build_handlers", "default_handlers", "probe_target",
           "tag_with_origin"]

log = logging.getLogger(__name__)


@dataclass
class Handlers:
    conflicts: ConflictHandler
    messages: MessageSink
    origins: OriginTracker
    skips: SkipRequests
    two_phase: TwoPhase | None = None

    def for_second_session(self, tx: TargetTransaction) -> Handlers:
        """The handlers of another target session of the same worker, which applies plain row
        changes of a streamed transaction only: the same conflict detection, no messages,
        origin tracking, skip request or two-phase handling of its own."""
        conflicts = self.conflicts
        return Handlers(ConflictHandler(tx, origin_id=conflicts.origin_id,
                                        copy_xids=conflicts.copy_xids),
                        MessageSink(tx.store), OriginTracker(tx.store, OriginTag(None)),
                        SkipRequests(tx.store, None))


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
    values = [(result.get_value(0, i) or b"").decode() for i in range(5)]
    return TargetInfo(int(values[0]), int(values[1]), values[2] == "on", values[3], int(values[4]))


def default_handlers(tx: TargetTransaction) -> Handlers:
    """Defaults without a target probe: conflicts logged under 'apply', messages to the table,
    no origin tag, no skip request, no two-phase."""
    return Handlers(ConflictHandler(tx), MessageSink(tx.store), OriginTracker(tx.store, OriginTag(None)),
                    SkipRequests(tx.store, None))


def tag_with_origin(session: TargetSession, slot: str, replication_origin: str | None,
                    warn: Callable[[str], None] = log.warning) -> tuple[OriginTag, TargetInfo]:
    """Probe the target and tag the session with the worker's replication origin (done before
    the store is made: its progress write also sets the origin's position when tagged)."""
    info = probe_target(session)
    name = replication_origin
    if name is None:
        name = default_origin_name(slot, info.database)
        legacy = legacy_origin_name(slot, info.database)
        if legacy != name:
            name = existing_origin(session, (legacy,)) or name
    return tag_session(session, None if name.lower() == "none" else name, warn), info


def build_handlers(tx: TargetTransaction, tag: OriginTag, info: TargetInfo, *, two_phase: bool,
                   two_phase_mode: str = "auto", skip_origins: Sequence[str] = (),
                   message_sink: str = "table", message_prefixes: Sequence[str] = (),
                   conflict_policy: Sequence[str] = ()) -> Handlers:
    """The handlers of the apply session. Raises ValueError for a setting the target cannot
    honour."""
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
    store = tx.store
    default_policy, table_policies = parse_conflict_policies(list(conflict_policy))
    copy_xids = store.copy_xids() if origin_id is not None else ()
    conflicts = ConflictHandler(tx, default_policy, table_policies, origin_id, copy_xids)
    skip_lsn = store.skip_request()
    if skip_lsn is not None:
        log.warning("will skip the source transaction finishing at %s (applier.skip_requests)",
                    skip_lsn)
    skips = SkipRequests(store, skip_lsn)
    origins = OriginTracker(store, tag, skip_origins)
    handler = None
    if two_phase:
        mode = resolve_mode(two_phase_mode, info.max_prepared_transactions)
        handler = TwoPhase(tx, mode, info.database_oid, skips, origins)
        log.info("two-phase transactions: mode %s (target max_prepared_transactions = %d)", mode,
                 info.max_prepared_transactions)
    return Handlers(conflicts, MessageSink(store, message_sink, message_prefixes), origins, skips,
                    handler)
