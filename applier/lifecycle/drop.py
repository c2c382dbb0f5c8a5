"""``applier drop``: retire a replica, removing everything it left behind.

Owns finding and removing what one slot's replica made: the logical slot on the source, the
replication origin that tagged its writes on the target (``apply.origins`` names it), the
transactions its worker prepared on the target and left pending (rolled back), its change feed
(the change tables in ``applier_changes`` with their rows in the bookkeeping tables, and that
schema once no other slot has one there; unless ``--keep-change-feed``), the slot's rows in every
other bookkeeping table (unless ``--keep-bookkeeping``), and its spill files on this machine
(with the per-slot directory, unless ``--spill-dir`` names the operator's own). What it keeps
when asked, and the bookkeeping schema itself, it says it keeps. It holds the
slot's worker lock on the target throughout, so no worker starts meanwhile; it shows what it
will remove and asks on a terminal unless ``--yes``; it prints what it removed; run again, it
finds nothing and says so.

Must never remove anything while a worker holds the slot (on the source) or its lock (on the
target): it refuses, naming the process. Must never touch a slot of another database, another
slot's rows, origins or prepared transactions, nor any file but the slot's spill files, and never
drop the bookkeeping schema itself (other slots may use it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ..apply.origins import default_origin_name, legacy_origin_name
from ..assembler.buffer import SPILL_GLOB, default_spill_dir
from ..config import Settings
from ..exit_codes import ExitCode
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.feed import SCHEMA as FEED_SCHEMA
from ..progress.feed_registry import REGISTRY_TABLES, FeedRegistry, FeedStatus
from ..progress.lock import AlreadyRunning, WorkerLock
from ..source.slots import slot_info
from ..units import readable_size
from .servers import LifecycleError, PreparedTransaction, connect, target_prepared

__all__ = ["DropPlan", "plan_drop", "run_drop"]


@dataclass
class DropPlan:
    """What is left of one slot's replica, found before anything is removed."""

    slot: str
    slot_on_source: bool
    origins: list[str]
    prepared: list[PreparedTransaction]
    bookkeeping: dict[str, int]  # table -> the slot's rows (empty with --keep-bookkeeping)
    feed: list[FeedStatus]  # the slot's change tables (empty with --keep-change-feed)
    spill_dir: Path
    spill_files: list[Path]
    remove_spill_dir: bool  # the per-slot default directory (not an operator's --spill-dir)
    removed: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.slot_on_source or self.origins or self.prepared or self.bookkeeping
                    or self.feed or self.spill_files
                    or (self.remove_spill_dir and self.spill_dir.is_dir()))

    def describe(self) -> list[str]:
        lines = []
        if self.slot_on_source:
            lines.append(f"source: replication slot {self.slot!r}")
        lines += [f"target: replication origin {name!r}" for name in self.origins]
        lines += [f"target: prepared transaction {p.gid!r} (prepared {p.prepared.isoformat()} by "
                  f"{p.owner}), to be rolled back" for p in self.prepared]
        lines += [f"target: change table {table.change_table} of {table.table} (change feed: "
                  f"{table.partitions} partition(s), ~{table.estimated_rows} rows, "
                  f"{readable_size(table.bytes)}) and its rows in applier.{', applier.'.join(REGISTRY_TABLES)}"
                  for table in self.feed]
        if self.feed:
            lines.append(f"target: schema {FEED_SCHEMA}, if no other slot has a change table there")
        lines += [f"target: {count} row(s) of slot {self.slot!r} in applier.{table}"
                  for table, count in self.bookkeeping.items()]
        if self.spill_files:
            lines.append(f"this machine: {len(self.spill_files)} spill file(s) in {self.spill_dir}")
        if self.remove_spill_dir and self.spill_dir.is_dir():
            lines.append(f"this machine: spill directory {self.spill_dir}")
        return lines


def _refuse_active_slot(source: psycopg.Connection[Any], slot: str) -> bool:
    """Whether the slot exists in the source database; raises when a worker holds it or it
    belongs to another database."""
    info = slot_info(source, slot)
    if info is None:
        return False
    if info.database != source.info.dbname:
        raise LifecycleError(f"slot {slot!r} belongs to database {info.database!r}, not "
                             f"{source.info.dbname!r}: point --source at that database")
    if info.active:
        client = source.execute(
            "SELECT application_name, client_addr::text FROM pg_catalog.pg_stat_replication "
            "WHERE pid = %s", (info.active_pid,)).fetchone()
        who = f" for {client[0]!r} from {client[1] or 'a local socket'}" if client else ""
        raise LifecycleError(f"slot {slot!r} is in use: WAL sender PID {info.active_pid} on the "
                             f"source streams it{who}. Stop the worker (SIGTERM) first, then run "
                             "applier drop again")
    return True


def plan_drop(source: psycopg.Connection[Any], target: psycopg.Connection[Any], slot: str, *,
              keep_bookkeeping: bool, keep_change_feed: bool, spill_dir: Path | None,
              target_dsn: str) -> DropPlan:
    """What is left of ``slot``'s replica; raises ``LifecycleError`` when a worker holds it."""
    on_source = _refuse_active_slot(source, slot)
    database = target.info.dbname
    names = list(dict.fromkeys((default_origin_name(slot, database),
                                legacy_origin_name(slot, database))))
    origins = [row[0] for row in target.execute(
        "SELECT roname::text FROM pg_catalog.pg_replication_origin WHERE roname = ANY(%s) "
        "ORDER BY roname", (names,))]
    directory = spill_dir or default_spill_dir(slot, target_dsn)
    bookkeeping = ({} if keep_bookkeeping else
                   SqlBookkeeping(target).slot_row_counts(slot, besides=REGISTRY_TABLES))
    feed = [] if keep_change_feed else FeedRegistry(target).status(slot)
    return DropPlan(slot, on_source, origins, target_prepared(target, slot), bookkeeping, feed,
                    directory, sorted(directory.glob(SPILL_GLOB)), spill_dir is None)


def _execute(plan: DropPlan, source: psycopg.Connection[Any], target: psycopg.Connection[Any]
             ) -> None:
    """Remove what ``plan`` lists, noting each removal in ``plan.removed``."""
    for prepared in plan.prepared:
        target.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(prepared.gid)))
        plan.removed.append(f"rolled back prepared transaction {prepared.gid!r} on the target")
    if plan.slot_on_source:
        try:
            source.execute("SELECT pg_catalog.pg_drop_replication_slot(%s)", (plan.slot,))
        except psycopg.errors.ObjectInUse as exc:  # a worker started since the plan was made
            raise LifecycleError(f"{' '.join(str(exc).split())}: stop the worker (SIGTERM) "
                                 "first, then run applier drop again") from None
        plan.removed.append(f"dropped replication slot {plan.slot!r} on the source")
    for name in plan.origins:
        target.execute("SELECT pg_catalog.pg_replication_origin_drop(%s)", (name,))
        plan.removed.append(f"dropped replication origin {name!r} on the target")
    if plan.feed:
        with target.transaction():
            plan.removed += [f"{line} on the target" for line in FeedRegistry(target).remove(plan.slot)]
    if plan.bookkeeping:
        with target.transaction():
            deleted = SqlBookkeeping(target).forget_slot(plan.slot, besides=REGISTRY_TABLES)
        plan.removed += [f"deleted {count} row(s) of applier.{table} on the target"
                         for table, count in deleted.items()]
    for path in plan.spill_files:
        path.unlink(missing_ok=True)
    if plan.spill_files:
        plan.removed.append(f"removed {len(plan.spill_files)} spill file(s) in {plan.spill_dir}")
    if plan.remove_spill_dir and plan.spill_dir.is_dir():
        try:
            plan.spill_dir.rmdir()
            plan.removed.append(f"removed spill directory {plan.spill_dir}")
        except OSError as exc:  # files that are not ours: leave them, and say so
            plan.removed.append(f"kept spill directory {plan.spill_dir}: {exc.strerror}")


def _confirm(plan: DropPlan, ask: Callable[[str], str]) -> bool:
    answer = ask(f"Remove all of this for slot {plan.slot!r}? Type yes to go on: ")
    return answer.strip().lower() in ("y", "yes")


def drop(settings: Settings, ask: Callable[[str], str] | None) -> int:
    """Remove what is left of the slot's replica; ``ask`` None: do not ask first."""
    slot = settings.required("slot")
    with ExitStack() as stack:
        source = stack.enter_context(connect(settings.required("source"), "source", "drop"))
        target = stack.enter_context(connect(settings.required("target"), "target", "drop"))
        # The slot first (a running worker holds it: its WAL sender is named), then the worker
        # lock (a worker between two sessions holds only that), kept to the end.
        plan = plan_drop(source, target, slot, keep_bookkeeping=settings.keep_bookkeeping,
                         keep_change_feed=settings.keep_change_feed, spill_dir=settings.spill_dir,
                         target_dsn=settings.required("target"))
        lock = WorkerLock(settings.required("target"), slot)
        try:
            lock.acquire()
        except AlreadyRunning as exc:
            raise LifecycleError(str(exc)) from None
        stack.callback(lock.release)
        if plan.empty:
            print(f"nothing left to remove for slot {slot!r}: it is dropped already")
            print("\n".join(_kept(target, slot, settings)))
            return ExitCode.OK
        print(f"applier drop will remove, for slot {slot!r}:")
        print("\n".join(f"  {line}" for line in plan.describe()))
        if ask is not None and not _confirm(plan, ask):
            print("nothing removed")
            return ExitCode.FAILED
        _execute(plan, source, target)
        kept = _kept(target, slot, settings)
    print("removed:")
    print("\n".join(f"  {line}" for line in plan.removed))
    print("\n".join(kept))
    return ExitCode.OK


def _kept(target: psycopg.Connection[Any], slot: str, settings: Settings) -> list[str]:
    """What drop leaves of the replica, and why: what it was asked to keep, and the bookkeeping
    schema (other slots may use it)."""
    kept = []
    if settings.keep_change_feed:
        tables = FeedRegistry(target).status(slot)
        if tables:
            kept.append(f"kept the change feed of slot {slot!r} (--keep-change-feed): "
                        + ", ".join(t.change_table for t in tables)
                        + f", and their rows in applier.{', applier.'.join(REGISTRY_TABLES)}")
    if settings.keep_bookkeeping:
        kept.append(f"kept the rows of slot {slot!r} in the applier tables (--keep-bookkeeping)")
    store = SqlBookkeeping(target)
    if store.tables():
        others = store.slots()
        kept.append("kept the bookkeeping schema applier: " + (
            f"slot(s) {', '.join(map(repr, others))} still have rows in it" if others else
            "no slot has rows in it any more; DROP SCHEMA applier CASCADE removes it, once no "
            "replica is to use this target"))
    return kept


def run_drop(settings: Settings) -> int:
    """``applier drop``: OK when nothing of the replica is left (also when nothing was), FAILED
    when refused (a worker holds the slot), not confirmed, or a server could not be reached."""
    settings.require("source", "target", "slot")
    ask = input if sys.stdin.isatty() and not settings.yes else None
    try:
        return drop(settings, ask)
    except (LifecycleError, psycopg.Error) as exc:
        print(f"applier drop: {' '.join(str(exc).split())}", file=sys.stderr)
        return ExitCode.FAILED
