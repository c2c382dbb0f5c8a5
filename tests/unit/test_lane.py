"""The lane's C core (``_lane.Lane``): what it takes from received payloads, the COPY
text or binary data it writes, and where (and why) it stops, leaving the rest to the ordinary
path."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime

import pgoutput_builder as pg
import pytest

from applier.apply.copy import copy_binary, copy_binary_rows, copy_text_pure
from applier.apply.fast.batch import Batch, fold_key_run
from applier.apply.fast.lane import core
from applier.apply.fast.path import LaneRoom
from applier.apply.feed.meta import Stamp, meta_prefix
from applier.apply.mapping import RelationMapping, TargetColumn, TargetTable, map_relation
from applier.protocol.decoder import decode_pure
from applier.protocol.lsn import LSN
from applier.protocol.messages import UNCHANGED_TOAST, Relation, RelationColumn, TupleData

#: Without its C core (no compiler at install, or APPLIER_PURE_PYTHON=1) there is no lane to test:
#: the ordinary path does all the work, and the integration tests run it with and without the
#: lane. ./dev test builds the core and fails on any skip.
_lane = core()
pytestmark = [pytest.mark.accelerated,
              pytest.mark.skipif(_lane is None, reason="the lane's C core is not built (or APPLIER_PURE_PYTHON=1)")]

END, FOREIGN, NO_RUN, PART, LIMIT = 0, 1, 2, 3, 4
BIG = 1 << 40


def _make_lane(runs: dict, *, whole: bool = True, after: int = 0, part: int = BIG, insert_part: int = BIG,
               rows: int = BIG, size: int = BIG, streamed: bool = False):
    lane = _lane.Lane(runs)
    lane.whole, lane.after, lane.streamed = whole, after, streamed
    lane.part_room, lane.insert_part_room, lane.rows_room, lane.bytes_room = part, insert_part, rows, size
    return lane


def _run(columns: int, binary: bool = False):
    return _lane.Run(columns, binary)


def _txn(final: int, xid: int, *inserts: bytes) -> list[bytes]:
    return [pg.begin(final, 1000, xid), *inserts, pg.commit(0, final, final + 8, 1000)]


def test_whole_transactions_become_copy_lines_of_their_tables() -> None:
    runs = {7: _run(2), 8: _run(1)}
    payloads = (_txn(0x100, 500, pg.insert(7, [b"1", b"a\tb\\c\nd\re"]), pg.insert(8, [None]))
                + _txn(0x200, 501, pg.insert(7, [b"2", None])))
    lane = _make_lane(runs)
    assert lane.take(payloads, 0) == len(payloads)
    assert lane.reason == END and lane.begin is None
    assert bytes(runs[7].data) == b"1\ta\\tb\\\\c\\nd\\re\n2\t\\N\n" and runs[7].rows == 2
    assert bytes(runs[8].data) == b"\\N\n" and runs[8].rows == 1
    assert (lane.inserts, lane.updates, lane.transactions, lane.xid) == (3, 0, 2, 501)
    assert lane.bytes == len(b"1") + len(b"a\tb\\c\nd\re") + len(b"2")
    assert lane.commit == payloads[-1]


def test_copy_text_agrees_with_the_reference_on_random_values() -> None:
    rng = random.Random(6)
    alphabet = b"ab\\\t\n\r x\x00\xff"
    rows = [[None if rng.random() < 0.2 else bytes(rng.choice(alphabet) for _ in range(rng.randrange(6)))
             for _ in range(3)] for _ in range(200)]
    runs = {3: _run(3)}
    payloads = _txn(0x300, 9, *(pg.insert(3, row) for row in rows))
    assert _make_lane(runs).take(payloads, 0) == len(payloads)
    assert bytes(runs[3].data) == copy_text_pure([decode_pure(p).new_tuple.values for p in payloads[1:-1]])


def test_binary_values_become_copy_binary_tuples_of_a_binary_run() -> None:
    """Binary values are the type's send format already: each goes behind its length word,
    NULL as -1, exactly as the reference encoder writes them."""
    rng = random.Random(7)
    rows = [[None if rng.random() < 0.2 else rng.randbytes(rng.randrange(9)) for _ in range(3)]
            for _ in range(100)]
    runs = {3: _run(3, binary=True)}
    payloads = _txn(0x300, 9, *(pg.insert(3, [None if v is None else pg.Binary(v) for v in row])
                                for row in rows))
    lane = _make_lane(runs)
    assert lane.take(payloads, 0) == len(payloads) and lane.reason == END
    assert bytes(runs[3].data) == copy_binary([tuple(row) for row in rows]) and runs[3].rows == 100
    assert lane.bytes == sum(len(v) for row in rows for v in row if v is not None)


def test_a_run_takes_only_rows_in_its_own_format_and_a_missing_run_says_which() -> None:
    text_row, binary_row = pg.insert(7, [b"1", None]), pg.insert(7, [None, pg.Binary(b"\x01")])
    for run_is_binary, refused in ((True, text_row), (False, binary_row)):
        runs = {7: _run(2, binary=run_is_binary)}
        taken = binary_row if run_is_binary else text_row
        lane = _make_lane(runs)
        assert lane.take(_txn(0x100, 500, taken, refused), 0) == 2 and lane.reason == FOREIGN
        assert runs[7].rows == 1
    for row, binary in ((text_row, False), (binary_row, True), (pg.insert(7, [None, None]), False)):
        lane = _make_lane({})
        assert lane.take(_txn(0x100, 500, row), 0) == 1
        assert (lane.reason, lane.binary) == (NO_RUN, binary)


def test_a_transaction_that_goes_on_with_another_change_is_handed_back_where_it_stopped() -> None:
    runs = {7: _run(1)}
    payloads = _txn(0x100, 500, pg.insert(7, [b"1"]), pg.truncate([7], 0), pg.insert(7, [b"2"]))
    lane = _make_lane(runs)
    assert lane.take(payloads, 0) == 2 and lane.reason == FOREIGN
    assert lane.begin == payloads[0] and lane.transactions == 0 and runs[7].rows == 1


def test_a_transaction_not_starting_with_a_row_change_is_left_whole() -> None:
    payloads = _txn(0x100, 500, pg.truncate([7], 0))
    lane = _make_lane({7: _run(1)})
    assert lane.take(payloads, 0) == 0 and lane.reason == FOREIGN and lane.begin is None


def test_a_relation_without_a_run_stops_the_lane_and_names_it() -> None:
    payloads = _txn(0x100, 500, pg.insert(7, [b"1"]), pg.insert(9, [b"x"]))
    lane = _make_lane({7: _run(1)})
    assert lane.take(payloads, 0) == 2
    assert (lane.reason, lane.relation, lane.begin) == (NO_RUN, 9, payloads[0])


@pytest.mark.parametrize("payload", [
    pg.insert(7, [pg.Binary(b"\x00\x01")]),        # binary value: COPY text cannot carry it
    pg.insert(7, [b"1", b"2"]),                    # another width than the run's
    pg.insert(7, [b"123"])[:-1],                   # truncated
    pg.insert(7, [b"1"]) + b"x",                   # trailing bytes
])
def test_anything_but_a_well_formed_text_insert_of_the_run_is_left_untouched(payload: bytes) -> None:
    runs = {7: _run(1)}
    payloads = _txn(0x100, 500, pg.insert(7, [b"0"]), payload)
    lane = _make_lane(runs)
    assert lane.take(payloads, 0) == 2 and lane.reason == FOREIGN
    assert bytes(runs[7].data) == b"0\n" and runs[7].rows == 1  # nothing of the refused row


def test_a_due_part_stops_right_after_the_insert() -> None:
    payloads = _txn(0x100, 500, *(pg.insert(7, [b"%d" % i]) for i in range(5)))
    lane = _make_lane({7: _run(1)}, insert_part=2)
    assert lane.take(payloads, 0) == 3 and (lane.reason, lane.inserts, lane.begin) == (PART, 2, payloads[0])
    lane = _make_lane({7: _run(1)}, part=2)  # the room for updated and deleted rows: not inserts
    assert lane.take(payloads, 0) == len(payloads) and (lane.reason, lane.inserts) == (END, 5)


def test_a_full_batch_stops_right_after_the_commit() -> None:
    payloads = _txn(0x100, 500, pg.insert(7, [b"1"]), pg.insert(7, [b"2"])) + _txn(0x200, 501, pg.insert(7, [b"3"]))
    lane = _make_lane({7: _run(1)}, rows=2)
    assert lane.take(payloads, 0) == 4 and (lane.reason, lane.transactions, lane.begin) == (LIMIT, 1, None)
    lane = _make_lane({7: _run(1)}, size=1)  # bytes held make a part due, as rows do
    assert lane.take(payloads, 0) == 2 and lane.reason == PART


def test_a_transaction_at_or_below_the_applied_position_is_left_to_the_ordinary_path() -> None:
    payloads = _txn(0x100, 500, pg.insert(7, [b"1"]))
    lane = _make_lane({7: _run(1)}, after=0x100)
    assert lane.take(payloads, 0) == 0 and lane.reason == FOREIGN


def test_a_commit_that_does_not_match_its_begin_is_left_for_the_ordinary_path_to_report() -> None:
    payloads = [pg.begin(0x100, 1000, 500), pg.insert(7, [b"1"]), pg.commit(0, 0x180, 0x188, 1000)]
    lane = _make_lane({7: _run(1)})
    assert lane.take(payloads, 0) == 2 and lane.reason == FOREIGN and lane.begin == payloads[0]


def test_inside_a_transaction_only_its_changes_are_taken() -> None:
    payloads = [pg.insert(7, [b"1"], xid=44), pg.insert(7, [b"2"], xid=44), pg.truncate([7], 0, xid=44)]
    runs = {7: _run(1)}
    lane = _make_lane(runs, whole=False, streamed=True)
    assert lane.take(payloads, 0) == 2 and lane.reason == FOREIGN and lane.begin is None
    assert bytes(runs[7].data) == b"1\n2\n"
    assert _make_lane(runs, whole=False).take([pg.begin(0x100, 1000, 5)], 0) == 0  # no Begin inside


def _key_run(columns: int, keys: tuple[int, ...], whole_rows: bool = True, binary: bool = False,
             feed: bool = False):
    return _lane.KeyRun(columns, keys, whole_rows, binary, feed)


def test_updates_of_every_column_go_into_their_tables_key_run_and_the_batch_folds_them() -> None:
    runs = {7: _key_run(3, (0,))}
    payloads = (_txn(0x100, 500, pg.update(7, [b"1", b"a", None]), pg.update(7, [b"2", b"b", b"x"]))
                + _txn(0x200, 501, pg.update(7, [b"1", b"c", b"y"])))
    lane = _make_lane(runs)
    assert lane.take(payloads, 0) == len(payloads) and lane.reason == END
    assert (lane.updates, lane.inserts, lane.transactions) == (3, 0, 2)
    run = runs[7]
    assert run.rows == [(b"1", b"a", None), (b"2", b"b", b"x"), (b"1", b"c", b"y")]  # every one
    fold_key_run(run)
    assert len(run) == 2  # the second update of key 1 replaced the first, where the first was
    assert run.params(0, 2) == [b"1", b"c", b"y", b"1", b"2", b"b", b"x", b"2"]  # columns, then key
    assert run.params(1, 2) == [b"2", b"b", b"x", b"2"]


def test_updated_and_deleted_rows_make_a_part_due_by_their_own_room() -> None:
    payloads = _txn(0x100, 500, *(pg.update(7, [b"%d" % i, b"v", None]) for i in range(5)))
    lane = _make_lane({7: _key_run(3, (0,))}, part=2)
    assert lane.take(payloads, 0) == 3 and (lane.reason, lane.updates) == (PART, 2)
    lane = _make_lane({7: _key_run(3, (0,))}, insert_part=2)  # the room for inserted rows only
    assert lane.take(payloads, 0) == len(payloads) and (lane.reason, lane.updates) == (END, 5)


@pytest.mark.parametrize("payload", [
    pg.update(7, [b"1", b"a"], old=[b"9", None]),           # the key changed: old key sent
    pg.update(7, [b"1", UNCHANGED_TOAST]),                  # a value not sent (TOAST)
    pg.update(7, [b"1", pg.Binary(b"\x01")]),               # binary
])
def test_updates_of_part_of_a_row_or_of_its_key_are_left_to_the_ordinary_path(payload: bytes) -> None:
    runs = {7: _key_run(2, (0,))}
    lane = _make_lane(runs)
    assert lane.take(_txn(0x100, 500, pg.update(7, [b"5", b"e"]), payload), 0) == 2
    assert lane.reason == FOREIGN and len(runs[7]) == 1


def test_binary_updates_fold_into_a_binary_key_run_sent_as_binary_parameters() -> None:
    mapping = _mapping(7, "acc", ("bal", "integer"))
    one, two = b"\x00\x00\x00\x01", b"\x00\x00\x00\x02"
    runs = {7: _key_run(2, (0,), binary=True)}
    payloads = _txn(0x100, 500, pg.update(7, [pg.Binary(one), pg.Binary(b"a")]),
                    pg.update(7, [pg.Binary(one), None]), pg.update(7, [b"1", b"t"]))
    lane = _make_lane(runs)
    assert lane.take(payloads, 0) == 3 and lane.reason == FOREIGN  # the text update is refused
    assert len(runs[7]) == 2
    batch = Batch()
    batch.open_run(mapping, runs[7], kind="U")
    batch.update(mapping, TupleData(b"bb", (two, b"b")), None)  # the ordinary path joins it
    batch.update(mapping, TupleData(b"tt", (b"3", b"c")), None)  # text: not in a binary run
    *by_key, single = batch.statements()  # two rows: two single-row statements (the ladder)
    assert [s.values for s in by_key] == [[one, None, one], [two, b"b", two]]
    assert [s.formats for s in by_key] == [[1] * 3] * 2 and single.formats == [0, 0, 0]


def test_a_change_without_a_run_of_its_kind_names_relation_and_kind() -> None:
    lane = _make_lane({7: _run(2)})
    assert lane.take(_txn(0x100, 500, pg.update(7, [b"1", b"a"])), 0) == 1
    assert (lane.reason, lane.relation, chr(lane.kind)) == (NO_RUN, 7, "U")


def _mapping(relation_id: int, name: str, second: tuple[str, str]) -> RelationMapping:
    """An independent table (id integer PRIMARY KEY, <second>)."""
    (column, sql_type), oid = second, {"integer": 23, "text": 25}[second[1]]
    relation = Relation(None, relation_id, "public", name, "d", (RelationColumn(1, "id", 23, -1),
                                                                 RelationColumn(0, column, oid, -1)))
    table = TargetTable("public", name, {"id": TargetColumn("id", "integer", False, True),
                                         column: TargetColumn(column, sql_type, False, True)},
                        ("id",), False, True)
    return map_relation(relation, table)


def test_an_update_run_in_the_batch_becomes_multi_row_updates_by_key() -> None:
    mapping = _mapping(7, "acc", ("bal", "integer"))
    batch = Batch()
    run = _key_run(2, (0,))
    batch.open_run(mapping, run, kind="U")
    for key in range(1, 10):
        run.add((b"%d" % key, b"10"))                        # as the lane records them
    batch.update(mapping, TupleData(b"tt", (b"1", b"11")), None)  # the ordinary path joins the run
    batch.update(mapping, TupleData(b"tt", (b"10", b"20")), None)
    batch.insert(mapping, TupleData(b"tt", (b"30", b"30")))  # an insert ends the run
    batch.update(mapping, TupleData(b"tt", (b"30", b"31")), None)
    update, insert = batch.statements()  # ten rows: one statement; the insert takes its update
    assert update.sql.startswith('UPDATE "public"."acc" AS t SET "id" = v.v0, "bal" = v.v1 FROM (VALUES')
    assert update.expected_rows == 10 and update.formats == [0] * 30
    assert update.values[:6] == [b"1", b"11", b"1", b"2", b"10", b"2"]
    assert update.values[-3:] == [b"10", b"20", b"10"]
    assert insert.sql.startswith('INSERT INTO "public"."acc"') and insert.values == [b"30", b"31"]


def test_deletes_by_key_keep_only_the_key_and_the_batch_folds_them() -> None:
    runs = {7: _key_run(3, (0, 2), whole_rows=False)}
    payloads = _txn(0x100, 500, pg.delete(7, [b"1", None, b"a"]), pg.delete(7, [b"2", None, b"b"]),
                    pg.delete(7, [b"1", None, b"a"]))
    lane = _make_lane(runs)
    assert lane.take(payloads, 0) == len(payloads) and (lane.deletes, lane.transactions) == (3, 1)
    assert runs[7].rows == [(b"1", b"a"), (b"2", b"b"), (b"1", b"a")]
    fold_key_run(runs[7])
    assert len(runs[7]) == 2 and runs[7].params(0, 2) == [b"1", b"a", b"2", b"b"]
    full = _txn(0x200, 501, pg.delete(7, [b"3", b"x", b"c"], old_kind="O"))  # REPLICA IDENTITY FULL
    assert _make_lane(runs).take(full, 0) == 1


def test_a_table_whose_run_is_of_another_kind_gets_a_new_run() -> None:
    """An update where the table's open run takes deletes (or the other way round) asks for a
    run of its own kind: the changes must stay in order."""
    lane = _make_lane({7: _key_run(2, (0,), whole_rows=False)})
    assert lane.take(_txn(0x100, 500, pg.update(7, [b"1", b"a"])), 0) == 1
    assert (lane.reason, chr(lane.kind)) == (NO_RUN, "U")
    lane = _make_lane({7: _key_run(2, (0,))})
    assert lane.take(_txn(0x100, 500, pg.delete(7, [b"1", None])), 0) == 1
    assert (lane.reason, chr(lane.kind)) == (NO_RUN, "D")


def test_a_delete_run_in_the_batch_becomes_multi_row_deletes_by_key() -> None:
    mapping = _mapping(8, "gone", ("v", "text"))
    batch = Batch()
    run = _key_run(2, (0,), whole_rows=False)
    batch.open_run(mapping, run, kind="D")
    for key in range(1, 10):
        run.add((b"%d" % key, None))
    batch.delete(mapping, TupleData(b"tn", (b"10", None)))  # the ordinary path joins the run
    (statement,) = batch.statements()
    assert statement.sql.startswith('DELETE FROM "public"."gone" WHERE ("id") IN (')
    assert statement.values == [b"%d" % key for key in range(1, 11)] and statement.expected_rows == 10


class _PartSink:
    """The sink side of ``Lane.take`` (applier.apply.fast.lane): rooms as ``Applier.lane_room``
    computes them (a part of ``part`` rows between whole transactions, of ``part * 5`` inside
    one), and the parts sent."""

    def __init__(self, inserts: int, part: int) -> None:
        self.batch_runs = {7: _run(1)}
        self.inserts, self.part = inserts, part
        self.parts: list[int] = []

    def lane_room(self, whole: bool) -> LaneRoom:
        insert_part = self.part if whole else self.part * 5
        return LaneRoom(LSN(0), self.part, insert_part - self.inserts, BIG, BIG)

    def lane_took(self, inserts: int, updates: int, deletes: int, value_bytes: int,
                  transactions: int, last: object) -> None:
        self.inserts += inserts

    def lane_due(self) -> None:
        pass

    def lane_stamp(self) -> tuple[int, None]:
        return 0, None  # no change feed

    records_commits = False

    def lane_commits(self, commit_lsns: bytes, end_lsns: bytes) -> None:
        raise AssertionError("no change feed, no commits")

    def lane_seq(self, seq: int) -> None:
        pass

    def send_part(self) -> None:
        if self.inserts:
            self.parts.append(self.inserts)
            self.inserts = 0


def test_a_part_already_due_is_sent_before_the_lane_takes_a_whole_transaction() -> None:
    """A small transaction whose changes the lane took from inside (its Begin came at the end of
    a read, so it was handed back) has the larger room of one open transaction, and may fill the
    part between whole transactions without making it due: the next whole transaction must not
    add to that part."""
    from applier.apply.fast.lane import Lane
    sink = _PartSink(inserts=3, part=4)
    lane = Lane(_lane, sink)  # type: ignore[arg-type]
    handed_back: list[bytes] = []
    first = _txn(0x100, 500, pg.insert(7, [b"1"]))
    assert lane.take(first[:1], 0, hand_back=handed_back.append) == 1 and handed_back == first[:1]
    assert lane.take(first[1:], 0) == 1  # its insert, from inside; its commit is the ordinary path's
    assert sink.inserts == 4 and sink.parts == []
    second = _txn(0x200, 501, pg.insert(7, [b"2"]))
    assert lane.take(second, 0, hand_back=handed_back.append) == len(second)
    assert sink.parts == [4] and sink.inserts == 1


# -- the change feed: change rows kept in a recorded table's runs ------------------------------------

#: 2026-11-25 12:00:00.5 UTC, in microseconds since 2000-01-01.
NOON = (9825 * 86400 + 12 * 3600) * 1_000_000 + 500_000


def test_a_recorded_tables_inserts_and_updates_keep_a_change_row_each_after_their_meta() -> None:
    runs = {7: _lane.Run(2, False, True), 8: _key_run(2, (0,), feed=True)}
    payloads = (_txn(0x1_00000100, 500, pg.insert(7, [b"1", b"a\tb"]), pg.update(8, [b"1", None]),
                     pg.update(8, [b"1", b"x"]), pg.insert(7, [b"2", None]))[:-1]
                + [pg.commit(0, 0x1_00000100, 0x1_00000108, NOON)])
    payloads[0] = pg.begin(0x1_00000100, NOON, 500)
    lane = _make_lane(runs)
    lane.feed_until = BIG
    assert lane.take(payloads, 0) == len(payloads) and lane.reason == END
    meta = b"1/100\t2026-11-25 12:00:00.500000+00\t500\t"
    # The same values as the Python routes' stamp of that transaction (feed.meta).
    stamp = Stamp(LSN(0x1_00000100), datetime(2026, 11, 25, 12, 0, 0, 500000, UTC), 500, False)
    lane_lsn, lane_time, lane_xid = meta.split(b"\t")[:3]
    lsn, time, xid = meta_prefix(stamp, False).split(b"\t")[:3]
    assert (lane_lsn, lane_xid) == (lsn, xid)
    assert datetime.fromisoformat(lane_time.decode()) == datetime.fromisoformat(time.decode())
    assert bytes(runs[7].data) == b"1\ta\\tb\n2\t\\N\n"  # the data, as without the feed
    assert bytes(runs[7].feed) == meta + b"1\tI\t1\ta\\tb\n" + meta + b"4\tI\t2\t\\N\n"
    assert runs[7].feed_rows == 2
    assert len(runs[8]) == 2
    fold_key_run(runs[8])
    assert len(runs[8]) == 1 and runs[8].params(0, 1) == [b"1", b"x", b"1"]  # folded
    assert bytes(runs[8].feed) == meta + b"2\tU\t1\t\\N\n" + meta + b"3\tU\t1\tx\n"  # not folded
    assert runs[8].feed_rows == 2 and lane.seq == 4


def test_binary_change_rows_carry_their_meta_in_send_format() -> None:
    runs = {7: _lane.Run(1, True, True)}
    payloads = [pg.begin(0x200, NOON, 77), pg.insert(7, [pg.Binary(b"\x00\x01")]),
                pg.commit(0, 0x200, 0x208, NOON)]
    lane = _make_lane(runs)
    lane.feed_until = BIG
    assert lane.take(payloads, 0) == len(payloads)
    fields = copy_binary_rows(runs[7].feed)
    assert fields == [((0x200).to_bytes(8, "big"), NOON.to_bytes(8, "big"), (77).to_bytes(8, "big"),
                       (1).to_bytes(8, "big"), b"I", b"\x00\x01")]


def test_change_rows_wait_for_their_partition_and_for_a_known_stamp() -> None:
    """At or above ``feed_until`` a change table may lack the partition for the commit LSN: the
    lane stops there and the ordinary path (which creates it) takes the change. Inside a
    transaction the stamp comes from ``set_stamp``; None (a commit not known yet) leaves every
    recorded change to the ordinary path, and an unrecorded table's changes still go."""
    runs = {7: _lane.Run(1, False, True), 8: _run(1)}
    payloads = _txn(0x300, 9, pg.insert(8, [b"u"]), pg.insert(7, [b"r"]))
    lane = _make_lane(runs)
    lane.feed_until = 0x300
    assert lane.take(payloads, 0) == 2 and lane.reason == FOREIGN and lane.begin == payloads[0]
    assert runs[7].rows == runs[7].feed_rows == 0 and runs[8].rows == 1
    inside = [pg.insert(8, [b"v"]), pg.insert(7, [b"s"])]
    lane = _make_lane(runs, whole=False)
    lane.feed_until = BIG
    lane.set_stamp(None)
    assert lane.take(inside, 0) == 1 and lane.reason == FOREIGN
    lane.set_stamp(0x300, NOON, 9, 5)
    assert lane.take(inside, 1) == 2 and runs[7].feed_rows == 1 and lane.seq == 6
    assert bytes(runs[7].feed).startswith(b"0/300\t2026-11-25 12:00:00.500000+00\t9\t6\tI\t")


def test_a_recorded_tables_run_sends_its_change_rows_after_its_data() -> None:
    from applier.apply.fast.ops import COPY, Op
    from applier.apply.fast.sql import Emitter
    from applier.progress.feed import ChangeTable, Partition

    mapping = _mapping(7, "items", ("name", "text"))
    change_table = ChangeTable(1, "slot", "public", "items", "public.items", {}, LSN(0),
                               Partition("1.1:public.items", LSN(0), LSN(BIG), LSN(0), None))  # type: ignore[arg-type]
    mapping = dataclasses.replace(mapping, feed=change_table)
    run = _lane.Run(2, False, True)
    payloads = [pg.begin(0x300, NOON, 9), *(pg.insert(7, [b"%d" % i, b"n"]) for i in range(10)),
                pg.commit(0, 0x300, 0x308, NOON)]
    lane = _make_lane({7: run})
    lane.feed_until = BIG
    assert lane.take(payloads, 0) == len(payloads)
    statements = list(Emitter().statements([Op(COPY, mapping, None, None, (COPY, 7, False), run=run)]))
    assert [s.expected_rows for s in statements] == [10, 10]
    data, changes = statements
    assert data.sql.startswith('INSERT INTO "public"."items"')
    assert changes.sql.startswith('INSERT INTO "applier_changes"."public.items"')
    assert changes.values[:6] == [b"0/300", b"2026-11-25 12:00:00.500000+00", b"9", b"1", b"I", b"0"]


def test_a_recorded_tables_deletes_keep_their_keys_as_change_rows() -> None:
    runs = {7: _key_run(2, (0,), whole_rows=False, feed=True)}
    payloads = [pg.begin(0x400, NOON, 3), pg.delete(7, [b"1", None]), pg.delete(7, [b"2", None]),
                pg.commit(0, 0x400, 0x408, NOON)]
    lane = _make_lane(runs)
    lane.feed_until = BIG
    assert lane.take(payloads, 0) == len(payloads) and lane.deletes == 2
    meta = b"0/400\t2026-11-25 12:00:00.500000+00\t3\t"
    assert bytes(runs[7].feed) == meta + b"1\tD\t1\t\\N\n" + meta + b"2\tD\t2\t\\N\n"
    assert runs[7].feed_rows == 2 and len(runs[7]) == 2


def test_a_transaction_whose_commit_is_not_known_writes_pending_change_rows() -> None:
    """Applied as it streams: the pending commit LSN (its partition always exists, so no bound
    applies) and no commit time, in text and in binary."""
    pending = 2**64 - 1
    runs = {7: _lane.Run(1, False, True), 8: _lane.Run(1, True, True)}
    lane = _make_lane(runs, whole=False, streamed=True)
    lane.feed_until = 0
    lane.set_stamp(pending, None, 9, 0)
    changes = [pg.insert(7, [b"t"], xid=9), pg.insert(8, [pg.Binary(b"b")], xid=9)]
    assert lane.take(changes, 0) == 2 and lane.seq == 2
    assert bytes(runs[7].feed) == b"FFFFFFFF/FFFFFFFF\t\\N\t9\t1\tI\tt\n"
    assert copy_binary_rows(runs[8].feed) == [(pending.to_bytes(8, "big"), None, (9).to_bytes(8, "big"),
                                               (2).to_bytes(8, "big"), b"I", b"b")]
