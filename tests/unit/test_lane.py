"""The insert lane's C core (``_speedups.Lane``): what it takes from received payloads, the COPY
text it writes, and where (and why) it stops, leaving the rest to the ordinary path."""

from __future__ import annotations

import random

import pytest

from applier.apply.copy import copy_text_pure
from applier.protocol.decoder import ACCELERATED, decode_pure

import pgoutput_builder as pg

pytestmark = pytest.mark.skipif(not ACCELERATED, reason="C accelerator not built (or APPLIER_PURE_PYTHON=1)")

END, FOREIGN, NO_RUN, PART, LIMIT = 0, 1, 2, 3, 4
BIG = 1 << 40


def _lane(runs: dict, *, whole: bool = True, after: int = 0, part: int = BIG, rows: int = BIG,
          size: int = BIG, streamed: bool = False):
    from applier.protocol import _speedups  # type: ignore[attr-defined]
    lane = _speedups.Lane(runs)
    lane.whole, lane.after, lane.streamed = whole, after, streamed
    lane.part_room, lane.rows_room, lane.bytes_room = part, rows, size
    return lane


def _run(columns: int):
    from applier.protocol import _speedups  # type: ignore[attr-defined]
    return _speedups.Run(columns)


def _txn(final: int, xid: int, *inserts: bytes) -> list[bytes]:
    return [pg.begin(final, 1000, xid), *inserts, pg.commit(0, final, final + 8, 1000)]


def test_whole_transactions_become_copy_lines_of_their_tables() -> None:
    runs = {7: _run(2), 8: _run(1)}
    payloads = (_txn(0x100, 500, pg.insert(7, [b"1", b"a\tb\\c\nd\re"]), pg.insert(8, [None]))
                + _txn(0x200, 501, pg.insert(7, [b"2", None])))
    lane = _lane(runs)
    assert lane.take(payloads, 0) == len(payloads)
    assert lane.reason == END and lane.begin is None
    assert bytes(runs[7].data) == b"1\ta\\tb\\\\c\\nd\\re\n2\t\\N\n" and runs[7].rows == 2
    assert bytes(runs[8].data) == b"\\N\n" and runs[8].rows == 1
    assert (lane.rows, lane.transactions, lane.xid) == (3, 2, 501)
    assert lane.bytes == len(b"1") + len(b"a\tb\\c\nd\re") + len(b"2")
    assert lane.commit == payloads[-1]


def test_copy_text_agrees_with_the_reference_on_random_values() -> None:
    rng = random.Random(6)
    alphabet = b"ab\\\t\n\r x\x00\xff"
    rows = [[None if rng.random() < 0.2 else bytes(rng.choice(alphabet) for _ in range(rng.randrange(6)))
             for _ in range(3)] for _ in range(200)]
    runs = {3: _run(3)}
    payloads = _txn(0x300, 9, *(pg.insert(3, row) for row in rows))
    assert _lane(runs).take(payloads, 0) == len(payloads)
    assert bytes(runs[3].data) == copy_text_pure([decode_pure(p).new_tuple.values for p in payloads[1:-1]])


def test_a_transaction_that_goes_on_with_another_change_is_handed_back_where_it_stopped() -> None:
    runs = {7: _run(1)}
    payloads = _txn(0x100, 500, pg.insert(7, [b"1"]), pg.update(7, [b"1"]), pg.insert(7, [b"2"]))
    lane = _lane(runs)
    assert lane.take(payloads, 0) == 2 and lane.reason == FOREIGN
    assert lane.begin == payloads[0] and lane.transactions == 0 and runs[7].rows == 1


def test_a_transaction_not_starting_with_inserts_is_left_whole() -> None:
    payloads = _txn(0x100, 500, pg.update(7, [b"1"]))
    lane = _lane({7: _run(1)})
    assert lane.take(payloads, 0) == 0 and lane.reason == FOREIGN and lane.begin is None


def test_a_relation_without_a_run_stops_the_lane_and_names_it() -> None:
    payloads = _txn(0x100, 500, pg.insert(7, [b"1"]), pg.insert(9, [b"x"]))
    lane = _lane({7: _run(1)})
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
    lane = _lane(runs)
    assert lane.take(payloads, 0) == 2 and lane.reason == FOREIGN
    assert bytes(runs[7].data) == b"0\n" and runs[7].rows == 1  # nothing of the refused row


def test_a_due_part_stops_right_after_the_insert() -> None:
    payloads = _txn(0x100, 500, *(pg.insert(7, [b"%d" % i]) for i in range(5)))
    lane = _lane({7: _run(1)}, part=2)
    assert lane.take(payloads, 0) == 3 and (lane.reason, lane.rows, lane.begin) == (PART, 2, payloads[0])


def test_a_full_batch_stops_right_after_the_commit() -> None:
    payloads = _txn(0x100, 500, pg.insert(7, [b"1"]), pg.insert(7, [b"2"])) + _txn(0x200, 501, pg.insert(7, [b"3"]))
    lane = _lane({7: _run(1)}, rows=2)
    assert lane.take(payloads, 0) == 4 and (lane.reason, lane.transactions, lane.begin) == (LIMIT, 1, None)
    lane = _lane({7: _run(1)}, size=1)  # bytes held make a part due, as rows do
    assert lane.take(payloads, 0) == 2 and lane.reason == PART


def test_a_transaction_at_or_below_the_applied_position_is_left_to_the_ordinary_path() -> None:
    payloads = _txn(0x100, 500, pg.insert(7, [b"1"]))
    lane = _lane({7: _run(1)}, after=0x100)
    assert lane.take(payloads, 0) == 0 and lane.reason == FOREIGN


def test_a_commit_that_does_not_match_its_begin_is_left_for_the_ordinary_path_to_report() -> None:
    payloads = [pg.begin(0x100, 1000, 500), pg.insert(7, [b"1"]), pg.commit(0, 0x180, 0x188, 1000)]
    lane = _lane({7: _run(1)})
    assert lane.take(payloads, 0) == 2 and lane.reason == FOREIGN and lane.begin == payloads[0]


def test_inside_a_transaction_only_inserts_are_taken() -> None:
    payloads = [pg.insert(7, [b"1"], xid=44), pg.insert(7, [b"2"], xid=44), pg.delete(7, [b"1"], xid=44)]
    runs = {7: _run(1)}
    lane = _lane(runs, whole=False, streamed=True)
    assert lane.take(payloads, 0) == 2 and lane.reason == FOREIGN and lane.begin is None
    assert bytes(runs[7].data) == b"1\n2\n"
    assert _lane(runs, whole=False).take([pg.begin(0x100, 1000, 5)], 0) == 0  # no Begin inside
