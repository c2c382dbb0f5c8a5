"""``applier skip``: skip exactly one source transaction, named by its finish LSN.

Writes the request to ``applier.skip_requests`` on the target; the worker honours it when it
reaches that transaction (see ``applier.apply.skipping`` for the crash-safe mechanism). The LSN
is the one a failing worker prints: the commit LSN, or the prepare LSN of a prepared transaction
(or the commit LSN of a deferred one's COMMIT PREPARED). Exit status 0 when the request is stored,
1 when it cannot apply (that transaction is already behind the recorded position), 2 for bad
arguments.
"""

from __future__ import annotations

import logging

from .apply.skipping import describe_request
from .config import Settings
from .progress.bookkeeping import SqlBookkeeping
from .progress.lock import AlreadyRunning, WorkerLock
from .progress.schema import SchemaError, make_engine, upgrade_schema

__all__ = ["run_skip"]

log = logging.getLogger(__name__)


def run_skip(settings: Settings) -> int:
    settings.require("target", "slot", "lsn")
    engine = make_engine(settings.target)
    try:
        upgrade_schema(engine)
        with engine.begin() as conn:
            previous = SqlBookkeeping(conn).request_skip(settings.slot, settings.lsn)
    except SchemaError as exc:
        log.error("%s", exc)
        return 1
    except ValueError as exc:
        log.error("nothing to skip: %s", exc)
        return 1
    finally:
        engine.dispose()
    print(describe_request(settings.slot, settings.lsn, previous))
    lock = WorkerLock(settings.target, settings.slot)
    try:
        lock.acquire()
    except AlreadyRunning:
        print("A worker is running for this slot: it reads skip requests when it (re)connects; "
              "restart it (SIGTERM, then applier run) if it is not stopped on that transaction.")
    else:
        print("Start the worker (applier run) to skip it.")
    finally:
        lock.release()
    return 0
