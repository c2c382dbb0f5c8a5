"""Tables copied again beside the stream: what a running worker does for ``applier resync``.

Owns one such copy, in a thread of its own: opened while the worker waits between source
transactions, with nothing of it open on the target (the tables marked copying and emptied, the
snapshot of a temporary slot taken: its consistent point is their new sync LSN, and the apply
stage from then on skips their changes committed before it and holds back later ones until the
copy commits, ``apply.sync_filter``), then run while the worker streams the other tables; the
record of the resync (``applier.repairs``) and the tables' state in ``applier.publication_tables``
move with it. The copy is ``applier sync``'s (``sync.tables``). A copy that fails or is cut short
leaves its tables 'copying': the next session copies them again before streaming
(``publication``). Must never apply a row change itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..config import Settings
from ..connections import connect
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.records import TableName
from ..progress.repairs import Repairs
from ..progress.schema import make_engine
from ..protocol.lsn import LSN
from ..sync.catalog import PublishedTable

if TYPE_CHECKING:
    from ..sync.tables import OpenRound

__all__ = ["RunningCopy"]

log = logging.getLogger(__name__)


class RunningCopy:
    def __init__(self, settings: Settings, slot: str, tables: list[PublishedTable]) -> None:
        self.settings = settings
        self.slot = slot
        self.tables = tables
        self.keys: list[TableName] = [t.key for t in tables]
        self.names = ", ".join(t.sql_name for t in tables)
        #: Set once the tables are emptied and the snapshot taken (``opened``), once the copy
        #: committed (``copied``), once it ended either way (``done``).
        self.opened = threading.Event()
        self.copied = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._opened: OpenRound | None = None
        self._started = 0.0

    @property
    def sync_lsn(self) -> LSN | None:
        """The snapshot's consistent point, once the tables are emptied and it is taken."""
        return self._opened.sync_lsn if self._opened is not None else None

    def start(self) -> None:
        """Open the round and copy, in a thread of its own: ``opened`` once the tables are
        emptied and the snapshot taken, ``done`` at the end."""
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="applier-resync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Loaded only when a table is copied again (as ``publication`` does for a first copy).
        from ..sync.tables import CopyRound, open_round
        target = self.settings.required("target")
        try:
            log.info("copying %s again (applier resync) beside the stream", self.names)
            with connect(target) as conn:
                SqlBookkeeping(conn).set_publication_tables(self.slot, self.keys, "copying")
                Repairs(conn).resync_started(self.slot, self.keys)
            opened = self._opened = open_round(
                self.settings, make_engine(target),
                CopyRound(self.slot, self.tables, False, frozenset(self.keys)))
            self.opened.set()
            try:
                opened.copy(self._stop, live_display=False)  # the worker logs meanwhile
            finally:
                opened.close()
            with connect(target) as conn:
                Repairs(conn).copies_done(self.slot, self.keys, opened.sync_lsn)
            log.info("copied %s again in %.1f s (sync LSN %s): its changes from then on are applied",
                     self.names, time.monotonic() - self._started, opened.sync_lsn)
            self.copied.set()
        except BaseException as exc:  # noqa: BLE001 - the worker's thread raises it (``check``)
            self.error = exc
        finally:
            self.done.set()

    def check(self) -> None:
        """Raise what made the copy fail (the session ends; the next one copies again)."""
        if self.error is not None:
            from ..sync.copy import CopyStopped  # loaded already: the copy raised it
            if not isinstance(self.error, CopyStopped):
                raise self.error

    def close(self) -> None:
        """The session ends: stop the copy if it still runs (its tables stay 'copying')."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
