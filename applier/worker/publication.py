"""The slot's publications followed while the worker runs: tables added are copied, tables
removed are no longer applied, tables ``applier resync`` marked are copied again.

Owns which tables the worker follows (``applier.publication_tables``: published, copying,
removed, resync), noticing a change (a Relation message naming a table the session does not
follow, or the periodic look at the publications) and copying the tables added. A table is
copied at the start of a session, before the stream starts: one added while the worker was
stopped, or whose copy was interrupted, or marked for resync while no worker ran, or one noticed
while streaming (the session then ends at once to start again, so that no target transaction of
this worker is open while the copy's snapshot is taken, which waits for every transaction
running on the source's server to end). A table marked for resync while the worker streams is
copied beside the stream (``resync.RunningCopy``), unless the change feed records it or a
streamed transaction is open in the early session: then the session starts again too. The copy is ``applier
sync``'s (``sync.tables.copy_round``) from a temporary slot's snapshot whose consistent point is
the table's sync LSN: the apply stage skips that table's changes of transactions committed
before it (they are in the copy) and applies the later ones, so there is no gap and no overlap.
The pause is bounded by that copy, and logged.

A table is the source relation, not its name: ``ALTER TABLE ... RENAME`` and ``SET SCHEMA`` keep
its OID, which Relation messages carry and the bookkeeping records, so a table renamed on the
source is followed under its new name, never copied again as one added. The rename is taken
when the stream reaches it (a Relation message under the new name that the source's catalog
also shows now; earlier messages carry the old name), and the session starts again so that
everything keyed by the name (the change feed, the copy's filter) takes the new one. Must never
apply a row change itself.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg

from ..config import Settings
from ..connections import connect
from ..errors import ApplierError, Cause
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.records import TableName
from ..progress.repairs import Repairs
from ..progress.schema import make_engine
from ..protocol.lsn import LSN
from ..sync.catalog import PublishedTable, published_tables
from .loop import StopRequested
from .resync import RunningCopy

__all__ = ["CHECK_SECONDS", "PublicationChanged", "PublicationFollower"]

log = logging.getLogger(__name__)

#: Seconds between looks at the publications' table lists while streaming.
CHECK_SECONDS = 30.0


class PublicationChanged(ApplierError):
    """A table was added to a publication while streaming: start again, to copy it first."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.PUBLICATION_CHANGED)


class PublicationFollower:
    def __init__(self, settings: Settings, slot: str, control: psycopg.Connection,
                 stop: threading.Event) -> None:
        self.settings = settings
        self.slot = slot
        #: The bookkeeping is read and written over psycopg connections of its own (each ``with``
        #: block one transaction); SQLAlchemy is loaded only for a copy (``sync.tables``).
        self.target = settings.required("target")
        self.control = control
        self.stop = stop
        #: The tables this session follows.
        self.published: set[TableName] = set()
        self._known: dict[TableName, str] = {}
        #: Source OID -> the name this worker follows that table under.
        self._followed: dict[int, TableName] = {}
        self._checked = time.monotonic()

    def start(self) -> dict[TableName, LSN]:
        """At session start: on the first run, follow what is published now (or what sync
        copied) without copying it; copy what was added since (or whose copy was interrupted);
        note what was removed. Returns the sync LSNs of the tables copied."""
        tables = self._published()
        if tables is None:  # the catalog is busy: follow what was known, look again later
            with connect(self.target) as conn:
                store = SqlBookkeeping(conn)
                known, relids = store.publication_tables(self.slot), store.publication_relids(self.slot)
            self._learn(known, relids)
            self.published = {k for k, state in known.items() if state != "removed"}
            return {}
        with connect(self.target) as conn:
            store = SqlBookkeeping(conn)
            known = store.publication_tables(self.slot)
            if not known:
                first = {t.key for t in tables} | set(store.table_states(self.slot))
                store.set_publication_tables(self.slot, sorted(first), "published")
                known = dict.fromkeys(first, "published")
            relids = store.publication_relids(self.slot)
            # Tables followed before their OIDs were recorded (schema 0008) take them by name.
            named = {t.key: t.oid for t in tables if t.key in known and t.key not in relids
                     and t.oid not in relids.values()}
            if named:
                store.set_publication_relids(self.slot, named)
                relids.update(named)
        self._learn(known, relids)
        copied = self._follow(tables)
        self._checked = time.monotonic()
        return copied

    def _learn(self, known: dict[TableName, str], relids: dict[TableName, int]) -> None:
        self._known = known
        self._followed = {relid: name for name, relid in relids.items()
                          if known.get(name) not in (None, "removed")}

    def check(self) -> None:
        """Every CHECK_SECONDS: raise ``PublicationChanged`` when a table was added (it is copied
        at the next session's start); note the tables removed."""
        if time.monotonic() - self._checked < CHECK_SECONDS:
            return
        self._checked = time.monotonic()
        tables = self._published()
        if tables is not None:
            self._notice(tables)

    def relation(self, schema: str, name: str, relid: int) -> None:
        """A Relation message names ``schema.name`` (source OID ``relid``): ``PublicationChanged``
        when the session does not follow it and a publication publishes it now, or when it is
        a followed table the source renamed."""
        followed = self._followed.get(relid)
        if followed == (schema, name) or (followed is None and (schema, name) in self.published):
            return
        tables = self._published()
        if tables is None:
            return
        if followed is not None:
            # A followed table under another name: renamed, if the source calls it so now (an
            # older message of a transaction before the rename still carries the old name).
            if {t.oid: t.key for t in tables}.get(relid) == (schema, name):
                self._rename(followed, (schema, name), relid)
            return
        # A partition published through its root is not listed itself: nothing to do for it.
        if (schema, name) in {t.key for t in tables}:
            self._notice(tables)

    def _rename(self, old: TableName, new: TableName, relid: int) -> None:
        with connect(self.target) as conn:
            SqlBookkeeping(conn).rename_table(self.slot, old, new)
        self._known[new] = self._known.pop(old)
        self._followed[relid] = new
        self.published = (self.published - {old}) | {new}
        raise PublicationChanged(
            f"{old[0]}.{old[1]} was renamed {new[0]}.{new[1]} on the source: followed under its new "
            "name (nothing is copied); the session starts again to take it")

    def _published(self) -> list[PublishedTable] | None:
        """The publications' tables now; None when a lock keeps the catalog from saying at once
        (reading it opens each table, and a transaction prepared on the source that altered one
        holds it until COMMIT PREPARED, which the stream only sends later)."""
        try:
            self.control.execute("SET lock_timeout = '2s'")
            return published_tables(self.control, self.settings.publication)
        except psycopg.errors.LockNotAvailable:
            log.info("the publications' tables cannot be read now (a table is locked, as by a "
                     "transaction prepared on the source); looking again later")
            return None
        finally:
            self.control.execute("SET lock_timeout TO DEFAULT")

    def _names(self, tables: list[PublishedTable]) -> dict[TableName, PublishedTable]:
        """The published tables by the name this worker follows each under: a followed table
        the source renamed keeps its old name until the stream reaches the rename."""
        return {self._followed.get(t.oid, t.key): t for t in tables}

    def _notice(self, tables: list[PublishedTable]) -> None:
        now = set(self._names(tables))
        self._remove(now)
        added = sorted(now - self.published)
        if added:
            raise PublicationChanged(
                f"{', '.join(f'{s}.{t}' for s, t in added)} added to the publication: the session "
                "starts again to copy it first")
        self.published = now

    def _remove(self, now: set[TableName]) -> None:
        removed = sorted(k for k, state in self._known.items() if state != "removed" and k not in now)
        if removed:
            log.info("no longer published, so no longer applied (target rows kept): %s",
                     ", ".join(f"{s}.{t}" for s, t in removed))
            self._set(removed, "removed")
            self._followed = {relid: name for relid, name in self._followed.items()
                              if name not in removed}

    def _follow(self, tables: list[PublishedTable]) -> dict[TableName, LSN]:
        names = self._names(tables)
        self._remove(set(names))
        todo = [t for key, t in names.items()
                if self._known.get(key) in (None, "removed", "copying", "resync")]
        copied: dict[TableName, LSN] = {}
        if todo:
            copied = self._copy(todo)
        self.published = set(names)
        return copied

    def _copy(self, tables: list[PublishedTable]) -> dict[TableName, LSN]:
        names = ", ".join(t.sql_name for t in tables)
        ours = frozenset(t.key for t in tables
                         if self._known.get(t.key) in ("removed", "copying", "resync"))
        keys = [t.key for t in tables]
        log.info("copying %s (added to the publication, or marked by applier resync) before "
                 "streaming", names)
        # The copy's modules load only when a table is copied: most workers never do, and
        # loading them would cost each start 10 ms.
        from ..sync.copy import CopyStopped
        from ..sync.tables import CopyRound, copy_round
        started = time.monotonic()
        self._set(keys, "copying")
        with connect(self.target) as conn:
            SqlBookkeeping(conn).set_publication_relids(self.slot, {t.key: t.oid for t in tables})
            Repairs(conn).resync_started(self.slot, keys)
        self._followed.update({t.oid: t.key for t in tables})
        try:
            lsn = copy_round(self.settings, make_engine(self.target),
                             CopyRound(self.slot, tables, False, ours), self.stop)
        except CopyStopped:
            raise StopRequested() from None  # SIGTERM: the next start copies them again
        with connect(self.target) as conn:
            Repairs(conn).copies_done(self.slot, keys, lsn)  # published again
        self._known.update(dict.fromkeys(keys, "published"))
        log.info("copied %s in %.1f s (sync LSN %s): its changes from then on are applied", names,
                 time.monotonic() - started, lsn)
        return {t.key: lsn for t in tables}

    def resync(self, tables: list[TableName], beside_stream: bool) -> RunningCopy | None:
        """Tables marked by applier resync while streaming: their copy beside the stream (to be
        opened and started), or ``PublicationChanged`` when it must be made before streaming
        (``beside_stream`` False); None when none of them can be copied now."""
        published = self._published()
        if published is None:
            return None  # the catalog is busy: the tables stay marked, the next look takes them
        by_key = self._names(published)
        gone = [key for key in tables if key not in by_key]
        if gone:
            log.warning("not copied again: %s no longer published", ", ".join(f"{s}.{t}" for s, t in gone))
            self._set(gone, "removed")
        todo = [by_key[key] for key in tables if key in by_key]
        if not todo:
            return None
        if not beside_stream:
            raise PublicationChanged(f"{', '.join(t.sql_name for t in todo)} to be copied again "
                                     "(applier resync): the session starts again to copy it first")
        self._known.update(dict.fromkeys((t.key for t in todo), "copying"))
        return RunningCopy(self.settings, self.slot, todo)

    def copied(self, tables: list[TableName]) -> None:
        """A copy beside the stream committed (it recorded the tables as published itself)."""
        self._known.update(dict.fromkeys(tables, "published"))

    def _set(self, tables: list[TableName], state: str) -> None:
        with connect(self.target) as conn:
            SqlBookkeeping(conn).set_publication_tables(self.slot, tables, state)
        self._known.update(dict.fromkeys(tables, state))
