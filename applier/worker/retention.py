"""The change feed's retention: old partitions dropped in the background while the worker runs.

Owns a thread with a connection of its own to the target that, every little while, drops the
partitions of the slot's change tables whose changes are all older than
``--change-feed-retention`` (``progress.feed_registry.FeedRegistry.prune``), with a short
``lock_timeout``: dropping a partition takes an ACCESS EXCLUSIVE lock on its change table, which
the apply session's open transaction may hold up for a moment and for which it then queues, so
a wait is cut short and tried again later. A round is skipped while a reader holds the feed's
shared lock (a Spark snapshot that may read the history). Failures are logged and retried; they
never stop the worker. Must never apply anything or touch the apply session.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime
from typing import Any

import psycopg

from ..connections import connect
from ..progress.feed_registry import FeedRegistry

__all__ = ["LOCK_TIMEOUT", "FeedRetention"]

log = logging.getLogger(__name__)

#: How long a round waits for a change table's lock before trying again later.
LOCK_TIMEOUT = "1s"


class FeedRetention:
    def __init__(self, dsn: str, slot: str, retention: float) -> None:
        self.dsn = dsn
        self.slot = slot
        self.retention = retention
        #: Seconds between rounds: several per partition's life, at most a minute.
        self.every = min(60.0, max(0.5, retention / 20))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self.dropped = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="applier-feed-retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._conn is not None:
            self._conn.close()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.prune()
            except psycopg.errors.LockNotAvailable:
                log.debug("change feed retention: a change table is busy; trying again later")
            except Exception as exc:  # noqa: BLE001 - retention must never stop the worker
                log.warning("change feed retention: %s; trying again later", str(exc).strip())
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None

    def prune(self) -> list[str] | None:
        """One round: the partitions dropped (None: a reader held the feed's lock)."""
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.dsn, application_name=f"applier {self.slot} (feed retention)")
        conn = self._conn
        try:
            conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            registry = FeedRegistry(conn)
            dropped = registry.prune(self.slot, self.retention, datetime.now(UTC)) \
                if registry.exists() else []
            conn.commit()
        except BaseException:
            if not conn.closed:
                try:
                    conn.rollback()
                except psycopg.Error:
                    conn.close()
            raise
        if dropped is None:
            log.debug("change feed retention: a reader holds a snapshot of the history; later")
        else:
            self.dropped += len(dropped)
        return dropped
