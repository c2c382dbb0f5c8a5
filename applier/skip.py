"""``applier skip``: skip exactly one source transaction, named by its finish LSN.

Writes the request to ``applier.skip_requests`` on the target; the worker honours it when it
reaches that transaction (see ``applier.apply.skipping`` for the crash-safe mechanism). The LSN
is the one a failing worker prints: the commit LSN, or the prepare LSN of a prepared transaction
(or the commit LSN of a deferred one's COMMIT PREPARED). A slot nothing knows (the target has
recorded nothing for it and, with ``--source``, the source has no such slot) is refused before
anything is written: a request for it could never be met. Exit status 0 when the request is
stored, 1 when it cannot apply (an unknown slot, or that transaction is already behind the
recorded position), 2 for bad arguments.
"""

from __future__ import annotations

import logging

import psycopg

from .apply.skipping import describe_request
from .config import Settings
from .exit_codes import ExitCode
from .preflight import PreflightFailed, connect, slot_recorded
from .progress.bookkeeping import SqlBookkeeping
from .progress.lock import AlreadyRunning, WorkerLock
from .progress.schema import SchemaError, make_engine, upgrade_schema
from .source.slots import slot_info

__all__ = ["run_skip"]

log = logging.getLogger(__name__)


def run_skip(settings: Settings) -> int:
    settings.require("target", "slot", "lsn")
    slot, lsn = settings.required("slot"), settings.lsn
    assert lsn is not None  # required just above
    try:
        problems = _slot_problems(settings)
    except PreflightFailed as exc:
        problems = exc.problems
    except psycopg.Error as exc:
        problems = [" ".join(str(exc).split())]
    if problems:
        log.error("nothing stored: %s", "; ".join(problems))
        return ExitCode.FAILED
    engine = make_engine(settings.required("target"))
    try:
        upgrade_schema(engine)
        with engine.begin() as conn:
            previous = SqlBookkeeping(conn).request_skip(slot, lsn)
    except SchemaError as exc:
        log.error("%s", exc)
        return ExitCode.FAILED
    except ValueError as exc:
        log.error("nothing to skip: %s", exc)
        return ExitCode.FAILED
    finally:
        engine.dispose()
    print(describe_request(slot, lsn, previous))
    lock = WorkerLock(settings.required("target"), slot)
    try:
        lock.acquire()
    except AlreadyRunning:
        print("A worker is running for this slot: it reads skip requests when it (re)connects; "
              "restart it (SIGTERM, then applier run) if it is not stopped on that transaction.")
    else:
        print("Start the worker (applier run) to skip it.")
    finally:
        lock.release()
    return ExitCode.OK


def _slot_problems(settings: Settings) -> list[str]:
    """Why a request for this slot could never be met, read before the bookkeeping schema is
    created: neither the target (its progress and sync state) nor, with --source, the source
    knows the slot."""
    slot = settings.required("slot")
    with connect(settings.required("target"), "target") as target:
        if slot_recorded(target, slot):
            return []
    source = settings.source
    if not source:
        return [f"slot {slot!r} is unknown to the target: no row of the applier schema names it "
                "(progress, table sync, published tables, conflicts), so no worker has run for "
                "it. Check --slot; to "
                "store a skip before the slot's first run, pass --source so that applier skip "
                "can check that the slot exists there"]
    with connect(source, "source") as conn:
        if slot_info(conn, slot) is not None:
            return []
        database = conn.info.dbname
    return [f"slot {slot!r} is unknown: the target has recorded nothing for it and the source "
            "has no replication slot "
            f"of that name in database {database!r}. Check --slot and --source"]
