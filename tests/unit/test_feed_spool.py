"""The change feed's spool without a server: a streamed transaction's COPYs of change rows held
back, dropped back to a savepoint, and given the commit's stamp at its commit."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from applier.apply.copy import copy_binary, copy_binary_data, copy_text
from applier.apply.fast.lane import core
from applier.apply.feed.meta import Stamp, binary_meta, meta_prefix, text_meta
from applier.apply.feed.spool import MERGE_BYTES, FeedSpool
from applier.errors import ApplyError
from applier.progress.feed import PENDING, ChangeTable, Partition
from applier.protocol.lsn import LSN

T0 = datetime(2026, 11, 27, 12, 30, 1, 250_000, tzinfo=UTC)
XID = 4711
LANE = core()
pytestmark = [pytest.mark.accelerated,
              pytest.mark.skipif(LANE is None, reason="the spool restamps with the lane's C core, "
                                 "which this build lacks (APPLIER_PURE_PYTHON=1 or no compiler)")]


def _change_table(name: str = "t") -> ChangeTable:
    return ChangeTable(1, "s", "public", name, f"public.{name}", {"id": "integer", "v": "text"}, LSN(0),
                       Partition(f"1.1:public.{name}", LSN(0), LSN(1 << 40), LSN(0), T0), 1)


def _rows(stamp: Stamp, first: int, count: int, op: bytes = b"I") -> list[tuple[Stamp, int, bytes, bytes]]:
    return [(stamp, seq, op, b"value %d" % seq) for seq in range(first, first + count)]


def _text(rows: list[tuple[Stamp, int, bytes, bytes]]) -> bytes:
    return copy_text([(*text_meta((stamp, seq)), op, str(seq).encode(), value)
                      for stamp, seq, op, value in rows])


def _binary(rows: list[tuple[Stamp, int, bytes, bytes]]) -> bytes:
    return copy_binary_data(copy_binary([(*binary_meta((stamp, seq)), op, seq.to_bytes(4, "big"), value)
                                         for stamp, seq, op, value in rows]))


def _spool(tmp_path: Path) -> FeedSpool:
    assert LANE is not None
    return FeedSpool(LANE.restamp, tmp_path / "spill")


PENDING_STAMP = Stamp(PENDING, None, XID, True)
COMMIT_STAMP = Stamp(LSN(0x1_0000_2000), T0, XID, False)


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_held_rows_come_back_once_with_the_commit_stamp_and_merged(tmp_path: Path, binary: bool) -> None:
    encode = _binary if binary else _text
    spool, table = _spool(tmp_path), _change_table()
    first, second = _rows(PENDING_STAMP, 1, 300), _rows(PENDING_STAMP, 301, 250, b"U")
    spool.add(table, "COPY one", encode(first), 300, binary)
    spool.add(table, "COPY one", encode(second), 250, binary)
    assert spool
    sent = list(spool.restamped(PENDING_STAMP, COMMIT_STAMP))
    # One COPY of both, exactly the rows a transaction whose commit was known would have sent.
    assert [(s.copy_sql, s.rows, s.change_table) for s in sent] == [("COPY one", 550, table)]
    committed = [(COMMIT_STAMP, seq, op, value) for _, seq, op, value in first + second]
    assert sent[0].data == encode(committed)
    assert not spool and list(spool.restamped(PENDING_STAMP, COMMIT_STAMP)) == []


def test_a_rollback_to_a_savepoint_drops_what_was_held_after_it(tmp_path: Path) -> None:
    spool, table, other = _spool(tmp_path), _change_table(), _change_table("u")
    spool.mark('"s0"')
    spool.add(table, "COPY t", _text(_rows(PENDING_STAMP, 1, 3)), 3, False)
    spool.mark('"s1"')
    spool.add(other, "COPY u", _text(_rows(PENDING_STAMP, 4, 2)), 2, False)
    spool.mark('"s2"')
    spool.add(table, "COPY t", _text(_rows(PENDING_STAMP, 6, 4)), 4, False)
    spool.rollback_to('"s1"')
    spool.add(table, "COPY t", _text(_rows(PENDING_STAMP, 10, 5)), 5, False)
    spool.rollback_to('"s2"')  # made after s1, so gone with its rows: nothing more is dropped
    sent = list(spool.restamped(PENDING_STAMP, COMMIT_STAMP))
    assert [(s.copy_sql, s.rows) for s in sent] == [("COPY t", 8)]
    assert sent[0].data == _text([(COMMIT_STAMP, seq, b"I", b"value %d" % seq)
                                  for seq in (1, 2, 3, 10, 11, 12, 13, 14)])
    spool.add(table, "COPY t", _text(_rows(PENDING_STAMP, 1, 1)), 1, False)
    spool.rollback_to('"s0"')  # every mark went with the commit's restamp
    assert spool


def test_statements_differ_or_grow_past_the_merge_size_in_separate_copies(tmp_path: Path) -> None:
    spool, table = _spool(tmp_path), _change_table()
    big = [(PENDING_STAMP, 1, b"I", b"x" * (MERGE_BYTES // 2))]
    spool.add(table, "COPY a", _text(big), 1, False)
    spool.add(table, "COPY a", _text(big), 1, False)  # the two together pass the merge size
    spool.add(table, "COPY b", _binary(_rows(PENDING_STAMP, 2, 2)), 2, True)
    sent = list(spool.restamped(PENDING_STAMP, COMMIT_STAMP))
    assert [(s.copy_sql, s.rows) for s in sent] == [("COPY a", 1), ("COPY a", 1), ("COPY b", 2)]
    assert sent[2].data == _binary(_rows(COMMIT_STAMP, 2, 2))


def test_rows_held_while_the_held_ones_are_sent_are_sent_too(tmp_path: Path) -> None:
    """Sending a held COPY first sends what the batch still has: its change rows join the spool
    while it is being read, and must not be lost."""
    spool, table = _spool(tmp_path), _change_table()
    spool.add(table, "COPY t", _text(_rows(PENDING_STAMP, 1, 2)), 2, False)
    sent = []
    for copy in spool.restamped(PENDING_STAMP, COMMIT_STAMP):
        sent.append(copy)
        if len(sent) == 1:
            spool.add(table, "COPY t", _text(_rows(PENDING_STAMP, 3, 4)), 4, False)
    assert [(s.copy_sql, s.rows) for s in sent] == [("COPY t", 2), ("COPY t", 4)]
    assert b"".join(s.data for s in sent) == _text(_rows(COMMIT_STAMP, 1, 6))
    assert not spool


def test_a_held_row_without_the_pending_stamp_stops_the_commit(tmp_path: Path) -> None:
    spool, table = _spool(tmp_path), _change_table()
    other_transaction = Stamp(PENDING, None, XID + 1, True)
    spool.add(table, "COPY t", _binary(_rows(PENDING_STAMP, 1, 2) + _rows(other_transaction, 3, 1)), 3, True)
    with pytest.raises(ApplyError, match=r"1 of 3 change rows held back for xid 4711"):
        list(spool.restamped(PENDING_STAMP, COMMIT_STAMP))


def test_meta_prefix_is_how_each_row_begins() -> None:
    assert meta_prefix(PENDING_STAMP, False) == b"FFFFFFFF/FFFFFFFF\t\\N\t4711\t"
    assert _text(_rows(COMMIT_STAMP, 7, 1)).startswith(meta_prefix(COMMIT_STAMP, False))
    tuples = _binary(_rows(PENDING_STAMP, 7, 1))
    assert tuples[19 + 2:].startswith(meta_prefix(PENDING_STAMP, True))  # header, field count
