"""The change feed in the apply stage without a server: which statements record each change, with
which meta, on the careful and the fast path; stamps, pending rows, moved keys, partitions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pgoutput_builder as pg
import pytest
from fake_target import Rig, mapping, relation, rig, table

from applier.apply.fast.lane import core
from applier.apply.feed.meta import Stamp
from applier.apply.feed.writer import moved_key
from applier.assembler import Assembler, TransactionEnd, TransactionStart
from applier.ingest.gate import IngestGate
from applier.progress import feed as layout
from applier.progress.feed import PENDING, ChangeTable, Partition
from applier.protocol.lsn import LSN
from applier.protocol.messages import UNCHANGED_TOAST, Delete, Insert, Truncate, TupleData, Update

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CT = '"applier_changes"."public.t"'


def _row(*values: bytes | None) -> TupleData:
    return TupleData(bytes(ord("n") if v is None else ord("t") for v in values), values)


def _change_table(upper: int = 1 << 40) -> ChangeTable:
    return ChangeTable(1, "s", "public", "t", "public.t", {"id": "integer", "v": "text"}, LSN(0),
                       Partition("1.1:public.t", LSN(0), LSN(upper), LSN(0), T0), 1)


def _rig(fast: bool = False, upper: int = 1 << 40) -> tuple[Rig, ChangeTable]:
    change_table = _change_table(upper)
    r = rig(fast=fast, feeds={("public", "t"): change_table})
    r.applier.relation(relation())
    return r, change_table


def _transaction(r: Rig, xid: int, lsn: int, *changes: object, commit_lsn: int | None = None) -> None:
    applier = r.applier
    applier.begin(TransactionStart(xid, LSN(lsn), T0, streamed=False, gid=None, end_lsn=None))
    for change in changes:
        applier.change(change)
    final = LSN(commit_lsn if commit_lsn is not None else lsn)
    applier.commit(TransactionEnd(xid, final, LSN(final + 8), T0, streamed=False, gid=None))


def test_the_careful_path_records_each_change_in_its_statement() -> None:
    r, _ = _rig()
    _transaction(r, 700, 0x1000, Insert(None, 1, _row(b"1", b"a")),
                 Update(None, 1, None, None, _row(b"1", b"b")), Delete(None, 1, "K", _row(b"1", None)))
    recorded = [(text, values) for text, values in r.target.calls if text.startswith("WITH")]
    assert len(recorded) == 3
    for (text, values), op, seq in zip(recorded, "IUD", (1, 2, 3)):
        assert f"INSERT INTO {CT}" in text and f"'{op}'" in text and "RETURNING" in text
        # The meta come last: commit LSN, commit time, xid, the change's order.
        assert values[-4:] == [b"0/1000", T0.isoformat().encode(), b"700", str(seq).encode()]
    (transaction,) = r.target.transactions
    assert [s.split(None, 1)[0] for s in transaction] == ["WITH", "WITH", "WITH", "INSERT"]
    # The source transaction's row of applier.change_commits: its commit and end LSN.
    assert transaction[-1] == (
        "INSERT INTO applier.change_commits (\"slot_name\", \"first_lsn\", \"last_lsn\", "
        "\"commit_lsns\", \"end_lsns\") VALUES ('s', '0/1000'::pg_catalog.pg_lsn, "
        "'0/1000'::pg_catalog.pg_lsn, ARRAY['0/1000'::pg_catalog.pg_lsn], "
        "ARRAY['0/1008'::pg_catalog.pg_lsn])")


def test_a_transaction_without_change_rows_leaves_no_commit_row() -> None:
    """A transaction of a table the feed does not record, after one of a recorded table."""
    r = rig(feeds={("public", "t"): _change_table()}, tables={"t": table("t"), "u": table("u")})
    r.applier.relation(relation())
    r.applier.relation(relation(2, "u"))
    _transaction(r, 700, 0x1000, Insert(None, 1, _row(b"1", b"a")))
    _transaction(r, 701, 0x2000, Insert(None, 2, _row(b"1", b"a")))
    first, second = r.target.transactions
    assert sum("applier.change_commits" in s for s in first) == 1
    assert not any("applier.change_commits" in s for s in second)


def test_a_truncate_leaves_a_marker_and_a_moved_key_a_delete_row() -> None:
    r, _ = _rig()
    old_key = TupleData(bytes([ord("t"), ord("n")]), (b"1", None))
    _transaction(r, 700, 0x1000, Update(None, 1, "K", old_key, _row(b"2", b"x")),
                 Truncate(None, 0, (1,)))
    texts = [text for text in r.target.transactions[0]]
    assert texts[0].startswith("WITH") and "'U'" in texts[0]
    assert texts[1].startswith(f"INSERT INTO {CT}") and "'D'" in texts[1]
    assert texts[2].startswith('TRUNCATE "public"."t"')
    assert texts[3].startswith(f"INSERT INTO {CT}") and "'T'" in texts[3]
    moved_values = [v for t, v in r.target.calls if t == texts[1]][0]
    assert moved_values[:4] == [b"0/1000", T0.isoformat().encode(), b"700", b"1"]  # before the update
    assert moved_values[4:] == [b"1"]  # the old key


def _recorded(r: Rig, text_starts: str) -> list[list[bytes | None]]:
    """The values of the statements starting with ``text_starts`` that the target received."""
    return [values for text, values in r.target.calls if text.startswith(text_starts)]


def test_the_fast_path_records_each_change_and_still_folds_the_data() -> None:
    """Inserts and updates of every column: change rows from the values sent (one multi-row
    INSERT per part here, a COPY when long), the data folded as without the feed. A delete
    records the whole old row the target returns."""
    r, _ = _rig(fast=True)
    # One row per VALUES row (a delete also lists its keys before its VALUES rows).
    r.target.rows = lambda text, values: max(1, text.rsplit("VALUES", 1)[-1].count("($"))
    keys = [str(n).encode() for n in range(1, 11)]
    _transaction(r, 700, 0x1000, *(Insert(None, 1, _row(k, b"a")) for k in keys))
    _transaction(r, 701, 0x2000, *(Update(None, 1, None, None, _row(k, b"b")) for k in keys),
                 Update(None, 1, None, None, _row(b"1", b"c")))  # key 1 again
    _transaction(r, 702, 0x3000, Delete(None, 1, "K", _row(b"2", None)))
    r.applier.flush()
    (batch,) = r.target.transactions
    # The data: inserts of the final rows (each insert then update folded into one), no UPDATE.
    assert not any(text.startswith('UPDATE "public"."t"') for text in batch)
    deletes = [text for text in batch if text.startswith("WITH") and "DELETE" in text]
    assert len(deletes) == 1 and "RETURNING" in deletes[0]
    recorded = [values for values in _recorded(r, f"INSERT INTO {CT}")]
    rows = [chunk[i:i + 7] for chunk in recorded for i in range(0, len(chunk), 7)]
    assert [(row[2], row[3], row[4], row[5], row[6]) for row in rows] == (
        [(b"700", str(n).encode(), b"I", k, b"a") for n, k in enumerate(keys, 1)]
        + [(b"701", str(n).encode(), b"U", k, b"b") for n, k in enumerate(keys, 1)]
        + [(b"701", b"11", b"U", b"1", b"c")])
    assert _recorded(r, "WITH")[-1][-4:] == [b"0/3000", T0.isoformat().encode(), b"702", b"1"]


def test_an_update_that_left_a_toast_value_unchanged_is_recorded_from_the_target_row() -> None:
    r, _ = _rig(fast=True)
    unchanged = TupleData(bytes([ord("t"), ord("u")]), (b"1", None))
    _transaction(r, 700, 0x1000, Update(None, 1, None, None, _row(b"1", b"a")),
                 Update(None, 1, None, None, unchanged), Update(None, 1, None, None, _row(b"1", b"c")))
    r.applier.flush()
    (batch,) = r.target.transactions
    kinds = [(text.split(None, 1)[0], "RETURNING" in text) for text in batch]
    # In order, none folded across the one the target records: data, recorded, data, then the
    # change rows of the other two (one statement each: two rows take the ladder's 1 + 1), and
    # last the transaction's row of applier.change_commits.
    assert kinds == [("UPDATE", False), ("WITH", True), ("UPDATE", False), ("INSERT", False),
                     ("INSERT", False), ("COPY", False)]
    returned = _recorded(r, "WITH")[0]
    assert returned[-1] == b"2"  # its order in the transaction
    assert _recorded(r, "COPY applier.change_commits") == [[b"s\t0/1000\t0/1000\t{0/1000}\t{0/1008}\n"]]


def test_a_transaction_applied_as_it_streams_is_pending_until_its_commit() -> None:
    r, change_table = _rig(fast=True)
    applier = r.applier
    applier.begin(TransactionStart(900, PENDING, T0, streamed=True, gid=None, end_lsn=None))
    applier.change(Insert(None, 1, _row(b"1", b"a")))
    applier.commit(TransactionEnd(900, LSN(0x5000), LSN(0x5008), T0, streamed=True, gid=None))
    applier.flush()
    (batch,) = r.target.transactions
    calls = {text: values for text, values in r.target.calls}
    assert calls[batch[1]][:3] == [b"FFFFFFFF/FFFFFFFF", None, b"900"]
    fix = batch[2]
    assert fix.startswith(f"UPDATE {CT} SET") and "'0/5000'" in fix and "900" in fix
    assert change_table.newest.to_lsn > 0x5000  # the partition of its commit LSN exists


@pytest.mark.accelerated
def test_the_lanes_pending_change_rows_are_fixed_at_the_commit() -> None:
    if core() is None:
        pytest.fail("the lane's C core is not built (./dev test builds it)")
    r, change_table = _rig(fast=True)
    applier = r.applier
    applier.begin(TransactionStart(900, PENDING, T0, streamed=True, gid=None, end_lsn=None))
    assert applier.take_changes([pg.insert(1, [b"1", b"a"], xid=900)], 0) == 1  # the lane took it
    applier.commit(TransactionEnd(900, LSN(0x5000), LSN(0x5008), T0, streamed=True, gid=None))
    applier.flush()
    (batch,) = r.target.transactions
    calls = {text: values for text, values in r.target.calls}
    recorded = [text for text in batch if text.startswith(f"INSERT INTO {CT}")]
    assert calls[recorded[0]][:5] == [b"FFFFFFFF/FFFFFFFF", None, b"900", b"1", b"I"]
    fix = [text for text in batch if text.startswith(f"UPDATE {CT} SET")]
    assert len(fix) == 1 and "'0/5000'" in fix[0] and "900" in fix[0]
    assert batch.index(fix[0]) > batch.index(recorded[0])
    assert _recorded(r, "COPY applier.change_commits") == [[b"s\t0/5000\t0/5000\t{0/5000}\t{0/5008}\n"]]


@pytest.mark.accelerated
def test_the_lane_keeps_the_commit_row_of_each_whole_transaction_with_change_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole transactions the C lane takes: the commit and end LSN of each that wrote change rows
    (as PostgreSQL prints them), none of one that wrote none, after the ordinary path's; all in
    one row of applier.change_commits, first and last commit LSN beside the arrays."""
    if core() is None:
        pytest.fail("the lane's C core is not built (./dev test builds it)")
    r, _ = _rig(fast=True)
    assert r.applier.tx.feed is not None
    gate = IngestGate(Assembler(r.applier, memory_budget=1 << 20, spill_dir=tmp_path), r.applier.lane)
    # The table's first change opens its run: the ordinary path takes that transaction on.
    gate.feed([pg.begin(0x1000, 0, 700), pg.insert(1, [b"1", b"a"]), pg.commit(0, 0x1000, 0x1038, 0)])

    def ordinary_path(*args: object) -> None:
        raise AssertionError("the ordinary path took a transaction the lane should")

    monkeypatch.setattr(r.applier.tx.feed, "wrote_rows", ordinary_path)
    high = 0x1_0000_2000
    gate.feed([pg.begin(0x1100, 0, 701), pg.insert(1, [b"2", b"b"]), pg.commit(0, 0x1100, 0x1108, 0),
               pg.begin(0x1200, 0, 702), pg.commit(0, 0x1200, 0x1208, 0),
               pg.begin(high, 0, 703), pg.insert(1, [b"3", b"c"]), pg.insert(1, [b"4", b"d"]),
               pg.commit(0, high, high + 0xA8, 0)])
    r.applier.flush()
    assert _recorded(r, "COPY applier.change_commits") == [
        [b"s\t0/1000\t1/2000\t{0/1000,0/1100,1/2000}\t{0/1038,0/1108,1/20A8}\n"]]


def test_a_partition_is_created_in_the_transaction_and_forgotten_when_it_rolls_back() -> None:
    r, change_table = _rig(upper=0x1000)
    _transaction(r, 700, 0x2000, Insert(None, 1, _row(b"1", b"a")))
    created = [s for s in r.target.transactions[0] if "ATTACH PARTITION" in s]
    assert created and change_table.newest.from_lsn == 0x1000 and change_table.newest.to_lsn > 0x2000
    newest = change_table.newest
    r.applier.begin(TransactionStart(701, LSN(newest.to_lsn + 10), T0, streamed=False, gid=None,
                                     end_lsn=None))
    r.applier.change(Insert(None, 1, _row(b"2", b"a")))
    assert change_table.newest is not newest
    r.applier.abort_open_transaction()
    assert change_table.newest is newest and change_table.partitions == 2


@pytest.mark.accelerated
def test_the_lane_records_a_tables_changes_and_hands_their_order_on(tmp_path: Path) -> None:
    """Through the ingest gate: the lane takes a recorded table's inserts, updates and deletes
    with their change rows (a run of each kind; a delete's row is the target's old row, recorded
    by the statement that deletes it); an update that left a TOAST value unchanged is the
    ordinary path's and takes the next order in the transaction; the lane then takes the rest of
    that open transaction, going on from there."""
    if core() is None:
        pytest.fail("the lane's C core is not built (./dev test builds it)")
    r, _ = _rig(fast=True)
    # One row per VALUES row (a delete also lists its keys before its VALUES rows).
    r.target.rows = lambda text, values: max(1, text.rsplit("VALUES", 1)[-1].count("($"))
    gate = IngestGate(Assembler(r.applier, memory_budget=1 << 20, spill_dir=tmp_path), r.applier.lane)
    commit_time = int((T0 - datetime(2000, 1, 1, tzinfo=UTC)).total_seconds()) * 1_000_000
    gate.feed([pg.begin(0x1000, commit_time, 700), pg.insert(1, [b"1", b"a"]), pg.update(1, [b"1", b"b"]),
               pg.update(1, [b"1", UNCHANGED_TOAST]), pg.delete(1, [b"1", None]), pg.insert(1, [b"2", b"c"]),
               pg.commit(0, 0x1000, 0x1008, commit_time)])
    r.applier.flush()
    rows = [row for values in _recorded(r, f"INSERT INTO {CT}") for row in
            (values[i:i + 7] for i in range(0, len(values), 7))]
    meta = [b"0/1000", b"2026-01-01 00:00:00.000000+00", b"700"]  # as the lane writes them
    assert sorted(rows, key=lambda row: int(row[3])) == [  # type: ignore[arg-type]
        [*meta, b"1", b"I", b"1", b"a"], [*meta, b"2", b"U", b"1", b"b"], [*meta, b"5", b"I", b"2", b"c"]]
    toast, delete = _recorded(r, "WITH")
    assert toast[-4:] == [b"0/1000", T0.isoformat().encode(), b"700", b"3"]  # the ordinary path's
    assert "DELETE" in [t for t, v in r.target.calls if v == delete][0] and delete == [b"1", *meta, b"4"]
    assert r.applier.fast is not None and not r.applier.fast.batch.runs


def test_stamps_encode_once_and_pending_has_no_time() -> None:
    stamp = Stamp(LSN(0x16_B374D848), T0, 42, False)
    assert stamp.text == (b"16/B374D848", T0.isoformat().encode(), b"42")
    assert int.from_bytes(stamp.binary[0], "big") == 0x16_B374D848
    pending = Stamp(LSN(5), T0, 42, True)
    assert pending.commit_lsn == PENDING and pending.text[1] is None and pending.binary[1] is None


def test_moved_key_is_the_old_key_only_when_it_changed() -> None:
    m = mapping()
    same = TupleData(bytes([ord("t"), ord("n")]), (b"1", None))
    assert moved_key(m, _row(b"1", b"x"), None) is None
    assert moved_key(m, _row(b"1", b"x"), same) is None
    assert moved_key(m, _row(b"2", b"x"), same) == (0,)


def test_partitions_are_sized_from_the_wal_rate_and_named_within_63_bytes() -> None:
    change_table = _change_table()
    change_table.newest = Partition("1.2:public.t", LSN(0), LSN(1000), LSN(0), T0)
    first = layout.next_partition(change_table, LSN(5000), T0 + timedelta(seconds=10), 86400)
    assert first.from_lsn == 1000 and first.to_lsn - 5000 == layout.first_span(86400)
    change_table.newest = Partition("1.3:public.t", LSN(1000), LSN(2000), LSN(1000), T0)
    sized = layout.next_partition(change_table, LSN(1000 + 10 * 1024**2), T0 + timedelta(seconds=10), 100)
    assert sized.to_lsn - sized.opened_lsn == 100 * 1024**2  # 1MB/s for 100 s
    long = layout.change_table_name("s" * 40, "t" * 40, "slot", set())
    assert len(long.encode()) <= 63 and long != layout.change_table_name("s" * 40, "t" * 41, "slot", set())
    assert layout.change_table_name("public", "t", "slot", {"public.t"}) != "public.t"
    assert len(layout.partition_name(change_table, 12345).encode()) <= 63


def test_commit_rows_hold_at_most_commits_per_row_transactions_each() -> None:
    """applier.change_commits: the transactions split into rows of COMMITS_PER_ROW in commit
    order, each row's first and last commit LSN beside its arrays, every end LSN beside its
    commit LSN."""
    count = 2 * layout.COMMITS_PER_ROW + 8
    lsns = [LSN(0xFFFF_F000 + 0x30 * i) for i in range(count)]  # across the 4GB line
    data, rows = layout.commits_rows("s", b"".join(map(layout.lsn_element, lsns)),
                                     b"".join(layout.lsn_element(LSN(lsn + 8)) for lsn in lsns))
    lines = [line.split("\t") for line in data.decode().splitlines()]
    assert rows == len(lines) == 3
    commits = [c.strip("{}").split(",") for _, _, _, c, _ in lines]
    ends = [e.strip("{}").split(",") for _, _, _, _, e in lines]
    assert [len(c) for c in commits] == [layout.COMMITS_PER_ROW, layout.COMMITS_PER_ROW, 8]
    assert [(first, last) for _, first, last, _, _ in lines] == [(c[0], c[-1]) for c in commits]
    assert [LSN.parse(c) for row in commits for c in row] == lsns
    assert [LSN.parse(e) for row in ends for e in row] == [LSN(lsn + 8) for lsn in lsns]
    assert {slot for slot, *_ in lines} == {"s"}
