"""Issue 40 without a server: the apply stage holding at a verify's position, a table copied again
beside the stream (its changes skipped before the copy's position, held back after it until the
copy commits), and what verify --repair would do and records."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

from fake_target import relation, rig
from test_apply_dispatch import insert, transaction

from applier.apply.dispatch import NO_HOLD
from applier.apply.fast.seat import LaneSeat
from applier.apply.sync_filter import SyncFilter
from applier.assembler import TransactionStart
from applier.protocol.lsn import LSN
from applier.repair.rows import KeyedRepair, recorded_keys
from applier.verify.report import REPAIR_KEYS, TableResult, TableSpec, repair_plan

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_hold_commits_what_came_before_and_waits_before_the_transaction_at_its_position() -> None:
    r = rig(fast=True)
    r.applier.relation(relation())
    held: list[tuple[LSN, list[LSN]]] = []

    def on_hold(lsn: LSN) -> None:
        held.append((lsn, list(r.commits)))
        r.applier.hold_before = NO_HOLD  # released

    r.applier.on_hold = on_hold
    r.applier.hold_before = LSN(0x300)
    for n, lsn in enumerate((0x100, 0x200, 0x2F0)):
        transaction(r, 700 + n, lsn, insert(n))
    assert held == [] and r.commits == []  # still in the batch
    transaction(r, 703, 0x300, insert(3))
    assert held == [(LSN(0x300), [LSN(0x2F8)])]  # everything before it was committed first
    r.applier.flush()
    assert r.commits == [LSN(0x2F8), LSN(0x308)]


def test_no_hold_is_past_every_lsn() -> None:
    r = rig(fast=True)
    r.applier.on_hold = lambda lsn: (_ for _ in ()).throw(AssertionError(f"held at {lsn}"))
    r.applier.begin(TransactionStart(700, LSN(2**64 - 1), T0, streamed=True, gid=None, end_lsn=None))
    assert not r.applier.hold_pending


def test_a_pending_hold_keeps_the_lane_out() -> None:
    r = rig(fast=True)
    r.applier.relation(relation())
    assert r.applier.fast is not None
    seat = LaneSeat(r.applier, r.applier.fast)
    r.applier.begin(TransactionStart(700, LSN(0x100), T0, streamed=False, gid=None, end_lsn=None))
    assert seat.lane_room(False) is not None
    r.applier.hold_before = LSN(0x500)
    assert seat.lane_room(False) is None


def test_a_table_copied_beside_the_stream_skips_then_waits_then_applies() -> None:
    sync_filter = SyncFilter({})
    copied = threading.Event()
    sync_filter.copying([("public", "t")], LSN(0x200), copied)
    sync_filter.begin(LSN(0x1FF))
    assert sync_filter.skips("public", "t") and not sync_filter.waiting and sync_filter.active
    sync_filter.begin(LSN(0x200))  # at the copy's position: not in it, and it is not committed
    assert sync_filter.waiting == {("public", "t")} and sync_filter.filtering
    copied.set()
    sync_filter.refresh()  # copied, and the stream is past its position: nothing left to filter
    assert not sync_filter.waiting and not sync_filter.skipped and not sync_filter.active


def test_the_apply_stage_waits_for_the_copy_of_a_changed_table() -> None:
    r = rig()
    r.applier.relation(relation())
    copied = threading.Event()
    r.applier.sync_filter = SyncFilter({})
    r.applier.sync_filter.copying([("public", "t")], LSN(0x200), copied)
    waits: list[int] = []
    r.applier.on_copy_wait = lambda: (waits.append(len(r.target.statements)), copied.set())
    transaction(r, 700, 0x100, insert(1))  # in the copy: skipped
    assert waits == [] and r.commits == [LSN(0x108)]
    skipped = len(r.target.statements)
    transaction(r, 701, 0x200, insert(2))  # after the copy's position: waits, then applied
    assert waits == [skipped] and any("INSERT" in s for s in r.target.statements[skipped:])


def _result(keyed: bool, missing: int, extra: int = 0, changed: int = 0) -> TableResult:
    return TableResult("public.t", missing_count=missing, extra_count=extra, changed_count=changed,
                       keyed=keyed)


def test_repair_plan_by_key_or_whole() -> None:
    assert repair_plan(_result(True, 2, 1, 3)) == (
        "write 2 missing and 3 changed row(s) and delete 1 extra one(s), by key, as the source "
        "has them")
    assert repair_plan(_result(False, 2)).endswith("(no key)")
    assert repair_plan(_result(True, REPAIR_KEYS + 1)).endswith(f"({REPAIR_KEYS + 1} keys differ)")


def test_repaired_integer_keys_are_recorded_as_ranges() -> None:
    spec = TableSpec("public", "t", ("id", "v"), ("id",), True, None)
    keys = [["7"], ["3"], ["4"], ["5"], ["10"]]
    assert recorded_keys(KeyedRepair(spec, keys)) == [[3, 5], [7, 7], [10, 10]]
    pairs = TableSpec("public", "p", ("a", "b"), ("a", "b"), False, None)
    assert recorded_keys(KeyedRepair(pairs, [["k", "1"]])) == [["k", "1"]]


def test_a_transaction_applied_as_it_streams_commits_only_once_the_hold_lets_go() -> None:
    from test_apply_streaming import _early, _finish, _streamed_insert

    r = rig(fast=True)
    r.applier.relation(relation())
    early, seconds, _ = _early(r)
    assert early.open(900)
    early.schema(relation())
    assert early.change(_streamed_insert(900, 1))
    transaction(r, 700, 0x100, insert(50))  # before the position: in the main session's batch
    held: list[tuple[LSN, list[LSN], int]] = []

    def on_hold(lsn: LSN) -> None:
        held.append((lsn, list(r.commits), len(seconds[0].transactions)))
        r.applier.hold_before = NO_HOLD

    r.applier.on_hold = on_hold
    r.applier.hold_before = LSN(0x200)
    assert _finish(early, 900, 0x200)
    # Held with the batch before it committed and the streamed transaction not yet.
    assert held == [(LSN(0x200), [LSN(0x108)], 0)]
    assert r.commits == [LSN(0x108), LSN(0x208)]
