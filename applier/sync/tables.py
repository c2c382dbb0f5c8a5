"""Copying published tables from one snapshot: what ``applier sync`` does for every table, and what
the worker does for a table added to a publication or marked by ``applier resync``.

Owns one copy round: the target tables made ready (created from the source's definitions with
``--create-tables``, and each COPY's format chosen), the check that a table about to be emptied
holds nothing but this slot's own rows (or ``--truncate-target``), the tables marked as copying
and emptied in one target transaction, the snapshot taken (the slot itself when it is created
now, else a temporary slot whose consistent point is the copy's sync LSN), the copy in parallel
sessions, each table marked done with that LSN in the transaction of its last rows, and, with
``--create-tables``, the CHECK and foreign key constraints once every table's data is in. A round can
be opened (tables emptied, snapshot taken) and copied later (``open_round``), so the worker knows
the sync LSN before it lets the copy run beside its stream. Must never stream changes or decide
which tables need a copy.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg

from ..config import ConfigError, Settings
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.records import TableName
from ..protocol.lsn import LSN
from ..source.options import UnsupportedOption
from ..source.slots import failover_slot
from .catalog import PublishedTable
from .copy import copy_tables, plan_tasks
from .progress import CopyProgress
from .relay import accelerated
from .snapshot import ExportedSnapshot, source_session, temporary_slot_name
from .target import (
    TargetCheckError,
    TargetPlan,
    add_constraints,
    definitions,
    is_empty,
    prepare_targets,
    target_session,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["CopyRound", "OpenRound", "complete_constraints", "copy_round", "open_round"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyRound:
    """What one round copies, and how."""

    slot: str
    tables: list[PublishedTable]
    #: The slot is created by this round (its snapshot is the copy's); else a temporary slot.
    create_slot: bool
    #: Tables whose target rows are this slot's own (an interrupted copy, a table that was
    #: published before): emptied without asking.
    ours: frozenset[TableName]


def copy_round(settings: Settings, engine: Engine, round_: CopyRound, stop: threading.Event,
               tick: Callable[[], None] | None = None) -> LSN:
    """Copy ``round_.tables`` from one snapshot; returns its consistent point (the tables' sync
    LSN). ``tick`` is called every fraction of a second while the copy runs (the worker keeps
    its replication stream alive with it)."""
    opened = open_round(settings, engine, round_)
    try:
        opened.copy(stop, tick)
    finally:
        opened.close()
    return opened.sync_lsn


class OpenRound:
    """A round whose tables are emptied and whose snapshot is taken (``open_round``): ``copy``
    fills them from it, ``close`` ends the snapshot. The worker copies a table while it streams
    this way: the tables are emptied and the sync LSN known before it goes on."""

    def __init__(self, settings: Settings, round_: CopyRound, plans: list[TargetPlan],
                 snapshot: ExportedSnapshot, block_size: int, encoding: str, relay_in_c: bool) -> None:
        self.settings = settings
        self.round = round_
        self.plans = plans
        self.snapshot = snapshot
        self.block_size = block_size
        self.encoding = encoding
        self.relay_in_c = relay_in_c

    @property
    def sync_lsn(self) -> LSN:
        return self.snapshot.consistent_point

    def copy(self, stop: threading.Event, tick: Callable[[], None] | None = None, *,
             live_display: bool = True) -> None:
        """Copy the tables; progress is drawn live on a terminal (``live_display``: nothing else
        writes to it meanwhile), else logged."""
        settings, tables = self.settings, self.round.tables
        source_dsn, target_dsn = settings.required("source"), settings.required("target")
        tasks = plan_tasks(self.plans, settings.range_size, self.block_size)
        log.info("copying %d table(s) in %d piece(s) with %d job(s) from snapshot %s "
                 "(consistent point %s), relaying in %s", len(tables), len(tasks), settings.jobs,
                 self.snapshot.name, self.sync_lsn, "C" if self.relay_in_c else "Python")
        with CopyProgress(tables, target_dsn, interactive=live_display and sys.stderr.isatty(),
                          interval=settings.progress_interval) as progress:
            copy_tables(source_dsn, target_dsn, self.round.slot, self.snapshot, tasks, settings.jobs,
                        progress, self.encoding, stop, tick)
        if any(plan.definition is not None for plan in self.plans):
            target = target_session(target_dsn, "applier copy")
            try:  # every table's data is in: foreign keys find theirs
                add_constraints(target, self.plans)
            finally:
                target.close()

    def close(self) -> None:
        self.snapshot.close()


def open_round(settings: Settings, engine: Engine, round_: CopyRound) -> OpenRound:
    """Make the target tables ready, mark them copying and empty them in one target transaction,
    then take the snapshot (the slot itself when the round creates it, else a temporary slot)."""
    source_dsn, target_dsn = settings.required("source"), settings.required("target")
    target = target_session(target_dsn, "applier copy")
    encoding = target.info.parameter_status("server_encoding") or "UTF8"
    control = source_session(source_dsn, encoding, "applier copy control")
    tables = round_.tables
    try:
        plans = prepare_targets(control, target, engine, tables, create_tables=settings.create_tables)
        _check_empty(settings, target, tables, round_.ours)
        with target.transaction():
            SqlBookkeeping(target).start_copies(round_.slot, [t.key for t in tables],
                                                forget_position=round_.create_slot)
            if tables:
                target.execute("TRUNCATE " + ", ".join(t.sql_name for t in tables))
        row = control.execute("SELECT pg_catalog.current_setting('block_size')").fetchone()
        block_size = int(row[0]) if row else 8192
        two_phase = bool(settings.two_phase) and round_.create_slot
        try:  # sync's preflight checked it already; a worker copying a table creates no slot
            failover = round_.create_slot and failover_slot(
                settings.failover_slot, control.info.server_version, two_phase)
        except UnsupportedOption as exc:
            raise ConfigError(str(exc)) from None
        snapshot = ExportedSnapshot.create(
            source_dsn, round_.slot if round_.create_slot else temporary_slot_name(round_.slot),
            temporary=not round_.create_slot, two_phase=two_phase, failover=failover)
        try:
            if round_.create_slot:  # the slot's progress comes from this server from now on
                with target.transaction():
                    SqlBookkeeping(target).record_source_identity(round_.slot, snapshot.source)
        except BaseException:
            snapshot.close()
            raise
        return OpenRound(settings, round_, plans, snapshot, block_size, encoding,
                         accelerated(control))
    finally:
        control.close()
        target.close()


def complete_constraints(settings: Settings, tables: list[PublishedTable]) -> None:
    """With ``--create-tables``, the CHECK and foreign key constraints of tables copied before
    (by a round that ended before it added them): what is missing is added."""
    target = target_session(settings.required("target"), "applier copy")
    control = source_session(settings.required("source"), "UTF8", "applier copy control")
    try:
        add_constraints(target, definitions(control, tables))
    finally:
        control.close()
        target.close()


def _check_empty(settings: Settings, target: psycopg.Connection, tables: list[PublishedTable],
                 ours: frozenset[TableName]) -> None:
    """Refuse non-empty target tables unless --truncate-target; a table holding this slot's own
    rows is emptied without asking."""
    if settings.truncate_target:
        return
    full = [t.sql_name for t in tables if t.key not in ours and not is_empty(target, t)]
    if full:
        raise TargetCheckError(f"target table(s) {', '.join(full)} are not empty; the copy "
                               "would mix with their rows. Empty them, or pass "
                               "--truncate-target to have the copy truncate them")
