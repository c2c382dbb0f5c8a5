"""Repairing a running replica: ``applier resync`` (``resync``: tables copied again by the worker)
and ``applier verify --repair`` (``rows``: differing keys written as the source had them at one
position the worker holds at; ``repair_differences`` decides which way each differing table is
repaired). ``applier verify`` itself (``applier.verify``) never writes.
"""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..connections import connect
from ..sync.catalog import published_tables as copied_tables
from ..verify.publications import published_tables
from ..verify.report import REPAIR_KEYS, VerifyReport
from .resync import request_resync, resync_problems
from .rows import KeyedRepair, repair_rows

__all__ = ["refused", "repair_differences"]


def repair_differences(settings: Settings, slot: str, report: VerifyReport) -> list[dict[str, Any]]:
    """Repair every table ``report`` found different: by key when it has a key and at most
    ``REPAIR_KEYS`` keys differ, else by asking the worker to copy it again. What was done, per
    table (``action``: repair, resync or refused)."""
    source_dsn, target_dsn = settings.required("source"), settings.required("target")
    differing = [t for t in report.tables if not t.equal and t.error is None]
    with connect(source_dsn, autocommit=True) as source:
        specs = {s.display: s for s in published_tables(source, settings.publication,
                                                        [t.table for t in differing])}
        copies = copied_tables(source, settings.publication)
    keyed: list[KeyedRepair] = []
    outcomes: list[dict[str, Any]] = []
    for result in differing:
        count = result.missing_count + result.extra_count + result.changed_count
        if result.keyed and count <= REPAIR_KEYS:
            keyed.append(KeyedRepair(specs[result.table], result.differing_keys))
            continue
        spec = specs[result.table]
        with connect(target_dsn, autocommit=True) as target:
            problems = resync_problems(copies, target, slot, [(spec.schema, spec.name)],
                                       keep_target_columns=False)
        if problems:
            outcomes.append({"table": result.table, "action": "refused",
                             "outcome": f"NOT repaired: {'; '.join(problems)}"})
            continue
        request_resync(target_dsn, slot, [(spec.schema, spec.name)])
        why = "it has no key" if not result.keyed else f"{count} keys differ"
        outcomes.append({"table": result.table, "action": "resync",
                         "outcome": f"{why}: marked to be copied again whole by the worker, beside "
                                    "its stream (applier status shows the copy)"})
    if keyed:
        done = repair_rows(source_dsn, target_dsn, slot, keyed, timeout=settings.timeout)
        for repair in keyed:
            counts = done.counts[repair.spec.display]
            outcomes.append({"table": repair.spec.display, "action": "repair",
                             "position": str(done.position), "inserted": counts.inserted,
                             "updated": counts.updated, "deleted": counts.deleted,
                             "outcome": f"repaired as the source had it at {done.position}: "
                                        f"{counts.inserted} row(s) inserted, {counts.updated} "
                                        f"updated, {counts.deleted} deleted"})
    return outcomes


def refused(outcomes: list[dict[str, Any]]) -> bool:
    """Some difference was left as it was."""
    return any(o["action"] == "refused" for o in outcomes)
