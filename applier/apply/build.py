"""Assembling the apply stage for one target session: session, store, owner, handlers, applier.

Owns the order in which the parts are made (the session is tagged with the worker's replication
origin before the store exists, since the store's progress write then sets the origin's position
too) and the shape of the second session that applies a streamed transaction as it streams.
Must never apply anything.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..progress.feed import ChangeTable
from ..progress.postgres import PostgresApplyStore
from ..progress.records import AppliedPosition
from ..progress.store import ApplyStore
from ..protocol.lsn import LSN
from ..protocol.messages import Relation
from .ddl import DDL_REFUSED
from .dispatch import Applier
from .fast.lane import core
from .fast.path import BatchLimits
from .feed.spool import FeedSpool
from .feed.writer import FeedWriter
from .handlers import build_handlers, tag_with_origin
from .mapping import TargetTable
from .relation_cache import RelationCache
from .schema_follow import ColumnSource
from .streaming import LOCK_TIMEOUT
from .sync_filter import SyncFilter
from .target import TargetSession
from .transaction import OnCommit, TargetTransaction

__all__ = ["ApplyOptions", "main_applier", "second_applier"]


@dataclass(frozen=True)
class ApplyOptions:
    """What the worker's settings decide about the apply stage."""

    slot: str
    limits: BatchLimits | None
    track_target_lsn: bool
    binary_check: bool
    two_phase: bool
    two_phase_mode: str = "auto"
    replication_origin: str | None = None
    skip_origins: Sequence[str] = ()
    message_sink: str = "table"
    message_prefixes: Sequence[str] = ()
    conflict_policy: Sequence[str] = ()
    follow_schema: bool = True
    #: The source's catalog, which says what the rows of a table hold in a column the source
    #: added (None: NULL, as without a default).
    source: ColumnSource | None = None
    #: The change feed: the change table of each recorded table, and the seconds of WAL a new
    #: partition is sized for.
    feeds: dict[tuple[str, str], ChangeTable] = field(default_factory=dict)
    feed_interval: float = 86400.0


def main_applier(session: TargetSession, options: ApplyOptions,
                 reflect: Callable[[str, str], TargetTable], on_commit: OnCommit, *,
                 careful_until: LSN, careful_xids: set[int], warn: Callable[[str], None],
                 on_relation: Callable[[Relation], None] | None = None) -> Applier:
    """The applier of the worker's main target session. Raises ValueError for a setting the
    target cannot honour, ``SyncIncomplete`` while an initial copy is unfinished."""
    # Tables copied by applier sync: their changes from before each copy's LSN are in it. Read
    # before the origin is created: a start refused for an unfinished copy creates nothing.
    sync_filter = SyncFilter(PostgresApplyStore(session, options.slot).table_sync_lsns())
    tag, info = tag_with_origin(session, options.slot, options.replication_origin, warn)
    store = PostgresApplyStore(session, options.slot,
                               origin_xact_setup=tag.name is not None and tag.xact_setup)
    applied = store.read_position() or AppliedPosition(LSN(0), LSN(0))
    tx = TargetTransaction(session, store, applied, on_commit,
                           track_target_lsn=options.track_target_lsn)
    if options.feeds:
        tx.feed = FeedWriter(tx, options.feeds, options.feed_interval, options.slot)
    handlers = build_handlers(tx, tag, info, two_phase=options.two_phase,
                              two_phase_mode=options.two_phase_mode,
                              skip_origins=options.skip_origins, message_sink=options.message_sink,
                              message_prefixes=options.message_prefixes,
                              conflict_policy=options.conflict_policy)
    return Applier(tx, RelationCache(reflect, binary_check=options.binary_check, feeds=options.feeds),
                   handlers,
                   limits=options.limits, careful_until=careful_until, careful_xids=careful_xids,
                   sync_filter=sync_filter,
                   follow_schema=options.follow_schema, source=options.source,
                   on_relation=on_relation)


def second_applier(main: Applier, session: TargetSession,
                   reflect: Callable[[str, str], TargetTable],
                   store: ApplyStore | None = None, spill_dir: Path | None = None) -> Applier:
    """The applier of a second session of the same worker, for one streamed transaction at a
    time applied as it streams: the same store shape and conflict detection, a batch that only
    the Stream Commit commits (parts still go ahead), and ``lock_timeout`` (see ``streaming``).
    ``store``: the session's bookkeeping store (default: the PostgreSQL one on ``session``);
    ``spill_dir``: where the change feed holds the transaction's change rows until its commit
    (``feed.spool``; the system's temporary directory if None)."""
    assert main.fast is not None
    session.sql(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
    tag = main.handlers.origins.tag
    if store is None:
        store = PostgresApplyStore(session, main.tx.store.slot,
                                   origin_xact_setup=tag.name is not None and tag.xact_setup)
    tx = TargetTransaction(session, store, main.tx.applied, main.tx.on_commit,
                           track_target_lsn=main.tx.track_target_lsn)
    if main.tx.feed is not None:
        lane_core = core()  # restamps the held rows; without it they go as PENDING and move
        spool = None if lane_core is None else FeedSpool(lane_core.restamp, spill_dir)
        tx.feed = FeedWriter(tx, main.tx.feed.tables, main.tx.feed.interval, main.tx.feed.slot,
                             spool)
    # A schema change here would hold the table's lock until the Stream Commit while the main
    # session waits for it: such a transaction is applied at its commit instead.
    tx.schema_changes = DDL_REFUSED
    return Applier(tx, RelationCache(reflect, binary_check=main.relations.binary_check,
                                     feeds=main.relations.feeds),
                   main.handlers.for_second_session(tx),
                   limits=BatchLimits(sys.maxsize, main.fast.limits.bytes, math.inf),
                   follow_schema=main.mappings.schema is not None,
                   source=main.mappings.schema.source if main.mappings.schema else None,
                   on_relation=main.on_relation)
