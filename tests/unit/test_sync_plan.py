"""Initial sync without servers: block ranges, COPY statements, and the apply-side LSN filter."""

from __future__ import annotations

from applier.apply.sync_filter import SyncFilter
from applier.protocol import LSN
from applier.sync.catalog import PublishedTable
from applier.sync.copy import CopyTask, plan_tasks, source_copy_sql
from applier.sync.target import TargetPlan

BLOCK = 8192


def table(name: str, size: int, relkind: str = "r", row_filter: str | None = None) -> PublishedTable:
    return PublishedTable("s", name, 1, relkind, ("id", "Odd \"col\""), row_filter, size, None)


def test_ranges_cover_every_block_once_and_the_last_is_open() -> None:
    big = TargetPlan(table("big", 10 * BLOCK + 1), True, None)
    small = TargetPlan(table("small", BLOCK), True, None)
    tasks = plan_tasks([small, big], range_size=4 * BLOCK, block_size=BLOCK)
    assert [(t.plan.table.name, t.first_block, t.end_block) for t in tasks] == [
        ("big", None, 4), ("big", 4, 8), ("big", 8, None), ("small", None, None)]


def test_partitioned_roots_are_never_cut() -> None:
    root = TargetPlan(table("root", 100 * BLOCK, relkind="p"), False, None)
    assert [(t.first_block, t.end_block) for t in plan_tasks([root], BLOCK, BLOCK)] == [(None, None)]


def test_copy_statements_quote_filter_and_range() -> None:
    plain = CopyTask(TargetPlan(table("t", 0), True, None), None, None)
    assert source_copy_sql(plain) == 'COPY "s"."t" ("id", "Odd ""col""") TO STDOUT (FORMAT binary)'
    ranged = CopyTask(TargetPlan(table("t", 0, row_filter="(id > 5)"), False, None), 4, 8)
    assert source_copy_sql(ranged) == (
        'COPY (SELECT "id", "Odd ""col""" FROM ONLY "s"."t" WHERE ((id > 5)) AND '
        "ctid >= '(4,0)'::pg_catalog.tid AND ctid < '(8,0)'::pg_catalog.tid) TO STDOUT")
    root = CopyTask(TargetPlan(table("r", 0, relkind="p"), False, None), None, None)
    assert source_copy_sql(root) == 'COPY (SELECT "id", "Odd ""col""" FROM "s"."r") TO STDOUT'


def test_filter_skips_only_transactions_committed_before_a_tables_sync_lsn() -> None:
    sync_filter = SyncFilter({("s", "a"): LSN(100), ("s", "b"): LSN(200)})
    sync_filter.begin(LSN(99))
    assert sync_filter.skips("s", "a") and sync_filter.skips("s", "b")
    sync_filter.begin(LSN(100))  # commits at the consistent point are not in the copy
    assert not sync_filter.skips("s", "a") and sync_filter.skips("s", "b")
    assert not sync_filter.skips("s", "other")
    sync_filter.begin(LSN(200))
    assert not sync_filter.skipped
    sync_filter.begin(LSN(150))  # cannot happen in a stream; the filter is off for good
    assert not sync_filter.skipped
