"""Decoder unit tests: every pgoutput message type field by field, and malformed input.

The DML tests run against both the C accelerator and the pure-Python reference and demand the
same objects and the same errors from each. No server needed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

import pgoutput_builder as pg
import pytest

from applier.protocol import (
    LSN,
    UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    DecodeError,
    Delete,
    Insert,
    Message,
    Origin,
    Prepare,
    Relation,
    RelationColumn,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
    decode,
    pg_timestamp,
    to_pg_timestamp,
)
from applier.protocol.decoder import ACCELERATED, decode_pure

Decode = Callable[..., object]

IMPLS = [
    pytest.param(decode, id="c", marks=[pytest.mark.accelerated, pytest.mark.skipif(
        not ACCELERATED, reason="C accelerator not built (or APPLIER_PURE_PYTHON=1)")]),
    pytest.param(decode_pure, id="pure"),
]

T0 = 767_356_496_123_456  # 2024-04-25 10:34:56.123456 UTC, in wire microseconds
T0_DT = datetime(2024, 4, 25, 10, 34, 56, 123456, tzinfo=UTC)
LSN1, LSN2 = 0x16B374D848, 0x16B374D9A0


def errors_of(fn: Decode, data: bytes, in_stream: bool = False) -> tuple[str, int, str]:
    with pytest.raises(DecodeError) as info:
        fn(data, in_stream)
    return info.value.message_type, info.value.offset, info.value.reason


# ---------------------------------------------------------------------------------------------
# Scalars

def test_lsn_prints_and_parses() -> None:
    lsn = LSN(0x16B374D848)
    assert str(lsn) == "16/B374D848"
    assert str(LSN(0x100000001)) == "1/1"  # as PostgreSQL prints it
    assert str(LSN(0)) == "0/0"
    assert LSN.parse("16/B374D848") == lsn
    assert LSN.parse(str(LSN(0x100000001))) == 0x100000001
    assert LSN.parse("0/1") == 1
    assert repr(lsn) == "LSN('16/B374D848')"
    for bad in ("16B374D848", "/1", "1/", "x/1", "100000000/0"):
        with pytest.raises(ValueError):
            LSN.parse(bad)


def test_timestamps_count_from_2000_utc() -> None:
    assert pg_timestamp(0) == datetime(2000, 1, 1, tzinfo=UTC)
    assert pg_timestamp(T0) == T0_DT
    assert pg_timestamp(-1) == datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    assert to_pg_timestamp(T0_DT) == T0
    assert to_pg_timestamp(T0_DT.astimezone(timezone(timedelta(hours=3)))) == T0


# ---------------------------------------------------------------------------------------------
# Transaction framing and the rarer messages

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("micros,moment", [
    (T0, T0_DT), (0, datetime(2000, 1, 1, tzinfo=UTC)),
    (-1, datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC))])
def test_begin(impl: Decode, micros: int, moment: datetime) -> None:
    msg = impl(pg.begin(LSN1, micros, 4_000_000_000), False)
    assert msg == Begin(LSN(LSN1), moment, 4_000_000_000)
    assert type(msg.final_lsn) is LSN and str(msg.final_lsn) == "16/B374D848"


@pytest.mark.parametrize("impl", IMPLS)
def test_commit(impl: Decode) -> None:
    msg = impl(pg.commit(0, LSN1, LSN2, T0), False)
    assert msg == Commit(0, LSN(LSN1), LSN(LSN2), T0_DT)
    assert type(msg.commit_lsn) is LSN and type(msg.end_lsn) is LSN


@pytest.mark.parametrize("impl", IMPLS)
def test_begin_and_commit_timestamps_out_of_range_are_decode_errors(impl: Decode) -> None:
    for data in (pg.begin(LSN1, 2**63 - 1, 1), pg.commit(0, LSN1, LSN2, -(2**63))):
        assert "out of range" in errors_of(impl, data)[2]
    assert "trailing" in errors_of(impl, pg.begin(LSN1, T0, 1) + b"x")[2]
    assert "needs 8 bytes" in errors_of(impl, pg.commit(0, LSN1, LSN2, T0)[:20])[2]


def test_origin() -> None:
    assert decode(pg.origin(LSN1, "node_a")) == Origin(LSN(LSN1), "node_a")


@pytest.mark.parametrize("xid", [None, 777])
def test_relation(xid: int | None) -> None:
    columns = [(1, "id", 23, -1), (0, "name", 1043, 68), (0, "amount", 1700, 655366),
               (1, "ts", 1184, -1)]
    data = pg.relation(16384, "public", "accounts", "d", columns, xid=xid)
    msg = decode(data, in_stream=xid is not None)
    assert msg == Relation(xid, 16384, "public", "accounts", "d", tuple(
        RelationColumn(*c) for c in columns))
    assert [c.is_key for c in msg.columns] == [True, False, False, True]
    assert msg.columns[1].type_modifier == 68 and msg.columns[0].type_modifier == -1


def test_relation_pg_catalog_namespace_and_identities() -> None:
    for identity in "dnfi":
        msg = decode(pg.relation(1, "", "t", identity, []))
        assert msg.namespace == "" and msg.replica_identity == identity and msg.columns == ()
    assert errors_of(decode, pg.relation(1, "", "t", "x", [])) == (
        "relation", 8, "unknown replica identity 'x'")


@pytest.mark.parametrize("xid", [None, 55])
def test_type(xid: int | None) -> None:
    msg = decode(pg.type_(16400, "public", "mood", xid=xid), in_stream=xid is not None)
    assert msg == Type(xid, 16400, "public", "mood")


@pytest.mark.parametrize("xid", [None, 9])
@pytest.mark.parametrize("options,cascade,restart", [(0, False, False), (1, True, False),
                                                     (2, False, True), (3, True, True)])
def test_truncate(xid: int | None, options: int, cascade: bool, restart: bool) -> None:
    msg = decode(pg.truncate([16384, 16390], options, xid=xid), in_stream=xid is not None)
    assert msg == Truncate(xid, options, (16384, 16390))
    assert (msg.cascade, msg.restart_identity) == (cascade, restart)


@pytest.mark.parametrize("flags,transactional", [(0, False), (1, True)])
def test_message(flags: int, transactional: bool) -> None:
    msg = decode(pg.message(flags, LSN1, "audit", b"\x00payload\xff"))
    assert msg == Message(None, flags, LSN(LSN1), "audit", b"\x00payload\xff")
    assert msg.transactional is transactional


def test_message_in_stream_carries_xid() -> None:
    msg = decode(pg.message(1, LSN1, "p", b"", xid=4242), in_stream=True)
    assert msg == Message(4242, 1, LSN(LSN1), "p", b"")


@pytest.mark.parametrize("first", [True, False])
def test_stream_start(first: bool) -> None:
    assert decode(pg.stream_start(800, first)) == StreamStart(800, first)


def test_stream_stop_commit() -> None:
    assert decode(pg.stream_stop()) == StreamStop()
    assert decode(pg.stream_commit(800, 0, LSN1, LSN2, T0)) == StreamCommit(
        800, 0, LSN(LSN1), LSN(LSN2), T0_DT)


def test_stream_abort_both_forms() -> None:
    short = pg.stream_abort(800, 801)
    assert len(short) == 9
    assert decode(short) == StreamAbort(800, 801, None, None)
    long = pg.stream_abort(800, 801, LSN1, T0)
    assert len(long) == 25
    assert decode(long) == StreamAbort(800, 801, LSN(LSN1), T0_DT)


def test_two_phase_messages() -> None:
    assert decode(pg.begin_prepare(LSN1, LSN2, T0, 900, "gid-1")) == BeginPrepare(
        LSN(LSN1), LSN(LSN2), T0_DT, 900, "gid-1")
    assert decode(pg.prepare(0, LSN1, LSN2, T0, 900, "gid-1")) == Prepare(
        0, LSN(LSN1), LSN(LSN2), T0_DT, 900, "gid-1")
    assert decode(pg.commit_prepared(0, LSN1, LSN2, T0, 900, "gid-1")) == CommitPrepared(
        0, LSN(LSN1), LSN(LSN2), T0_DT, 900, "gid-1")
    assert decode(pg.rollback_prepared(0, LSN1, LSN2, T0, T0 + 1, 900, "gid-1")) == \
        RollbackPrepared(0, LSN(LSN1), LSN(LSN2), T0_DT, T0_DT + timedelta(microseconds=1), 900,
                         "gid-1")
    assert decode(pg.stream_prepare(0, LSN1, LSN2, T0, 900, "gid-1")) == StreamPrepare(
        0, LSN(LSN1), LSN(LSN2), T0_DT, 900, "gid-1")


NO_XID_MESSAGES = [
    pg.begin(LSN1, T0, 1), pg.commit(0, LSN1, LSN2, T0), pg.origin(LSN1, "o"),
    pg.stream_start(1, True), pg.stream_stop(), pg.stream_commit(1, 0, LSN1, LSN2, T0),
    pg.stream_abort(1, 2), pg.stream_abort(1, 2, LSN1, T0), pg.begin_prepare(LSN1, LSN2, T0, 1, "g"),
    pg.prepare(0, LSN1, LSN2, T0, 1, "g"), pg.commit_prepared(0, LSN1, LSN2, T0, 1, "g"),
    pg.rollback_prepared(0, LSN1, LSN2, T0, T0, 1, "g"), pg.stream_prepare(0, LSN1, LSN2, T0, 1, "g"),
]


@pytest.mark.parametrize("data", NO_XID_MESSAGES, ids=lambda d: chr(d[0]))
def test_in_stream_adds_no_xid_to_other_messages(data: bytes) -> None:
    assert decode(data, in_stream=True) == decode(data, in_stream=False)


# ---------------------------------------------------------------------------------------------
# DML: both implementations

ROW: list[pg.Column] = [b"42", pg.Binary(b"\x00\x01"), None, UNCHANGED_TOAST, b""]
ROW_TUPLE = TupleData(b"tbnut", (b"42", b"\x00\x01", None, UNCHANGED_TOAST, b""))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("xid", [None, 4000000000])
def test_insert(impl: Decode, xid: int | None) -> None:
    msg = impl(pg.insert(16384, ROW, xid=xid), xid is not None)
    assert msg == Insert(xid, 16384, ROW_TUPLE)
    assert type(msg) is Insert and type(msg.new_tuple) is TupleData
    assert msg.new_tuple.is_binary(1) and not msg.new_tuple.is_binary(0)
    assert msg.new_tuple.values[3] is UNCHANGED_TOAST
    assert msg.new_tuple.size == ROW_TUPLE.size == sum(len(v) for v in ROW_TUPLE.values if type(v) is bytes)
    assert hash(msg) == hash(Insert(xid, 16384, ROW_TUPLE))
    with pytest.raises(AttributeError):
        msg.relation_id = 1  # type: ignore[misc]


@pytest.mark.parametrize("impl", IMPLS)
def test_insert_zero_columns_and_large_values(impl: Decode) -> None:
    assert impl(pg.insert(1, []), False) == Insert(None, 1, TupleData(b"", ()))
    big = bytes(range(256)) * 300
    assert impl(pg.insert(0xFFFFFFFF, [big]), False) == Insert(None, 0xFFFFFFFF,
                                                               TupleData(b"t", (big,)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("xid", [None, 31])
def test_update_without_old(impl: Decode, xid: int | None) -> None:
    msg = impl(pg.update(16384, ROW, xid=xid), xid is not None)
    assert msg == Update(xid, 16384, None, None, ROW_TUPLE)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("old_kind", ["K", "O"])
@pytest.mark.parametrize("xid", [None, 31])
def test_update_with_old(impl: Decode, old_kind: str, xid: int | None) -> None:
    old = [b"41", None, None, None, None] if old_kind == "K" else [b"41", b"x", None, b"y", b""]
    msg = impl(pg.update(7, ROW, old=old, old_kind=old_kind, xid=xid), xid is not None)
    assert msg == Update(xid, 7, old_kind, decode_pure(pg.insert(7, old)).new_tuple, ROW_TUPLE)
    assert msg.old_tuple.kinds == (b"tnnnn" if old_kind == "K" else b"ttntt")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("old_kind", ["K", "O"])
@pytest.mark.parametrize("xid", [None, 31])
def test_delete(impl: Decode, old_kind: str, xid: int | None) -> None:
    msg = impl(pg.delete(7, ROW, old_kind=old_kind, xid=xid), xid is not None)
    assert msg == Delete(xid, 7, old_kind, ROW_TUPLE)


# ---------------------------------------------------------------------------------------------
# Malformed input

def test_empty_and_unknown_type() -> None:
    assert errors_of(decode, b"") == ("unknown", 0, "empty message")
    assert errors_of(decode, b"Z123") == ("'Z'", 0, "unknown message type byte 0x5a")
    assert errors_of(decode, b"\xff") == ("'ÿ'", 0, "unknown message type byte 0xff")


VALID = {
    "begin": pg.begin(LSN1, T0, 1), "commit": pg.commit(0, LSN1, LSN2, T0),
    "origin": pg.origin(LSN1, "o"), "relation": pg.relation(1, "s", "t", "d", [(1, "id", 23, -1)]),
    "type": pg.type_(1, "s", "t"), "truncate": pg.truncate([1, 2], 1),
    "message": pg.message(1, LSN1, "p", b"abc"), "stream_start": pg.stream_start(1, True),
    "stream_commit": pg.stream_commit(1, 0, LSN1, LSN2, T0),
    "stream_abort": pg.stream_abort(1, 2, LSN1, T0),
    "begin_prepare": pg.begin_prepare(LSN1, LSN2, T0, 1, "g"),
    "prepare": pg.prepare(0, LSN1, LSN2, T0, 1, "g"),
    "commit_prepared": pg.commit_prepared(0, LSN1, LSN2, T0, 1, "g"),
    "rollback_prepared": pg.rollback_prepared(0, LSN1, LSN2, T0, T0, 1, "g"),
    "stream_prepare": pg.stream_prepare(0, LSN1, LSN2, T0, 1, "g"),
}
VALID_DML = {
    "insert": pg.insert(1, ROW), "update": pg.update(1, ROW, old=[b"1", None]),
    "delete": pg.delete(1, [b"1", None], old_kind="O"),
}


@pytest.mark.parametrize("name", list(VALID))
def test_truncated_at_every_length(name: str) -> None:
    data = VALID[name]
    for cut in range(1, len(data)):
        if name == "stream_abort" and cut == 9:
            continue  # the 9-byte form is itself valid
        message_type, offset, _ = errors_of(decode, data[:cut])
        assert message_type == name and 1 <= offset <= cut


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("in_stream", [False, True])
@pytest.mark.parametrize("name", list(VALID_DML))
def test_dml_truncated_at_every_length(impl: Decode, name: str, in_stream: bool) -> None:
    data = VALID_DML[name]
    if in_stream:
        data = data[:1] + b"\x00\x00\x00\x07" + data[1:]
    for cut in range(1, len(data)):
        error = errors_of(impl, data[:cut], in_stream)
        assert error == errors_of(decode_pure, data[:cut], in_stream)
        assert error[0] == name and 1 <= error[1] <= cut


@pytest.mark.parametrize("impl", IMPLS)
def test_dml_faults_name_the_offset(impl: Decode) -> None:
    good = pg.insert(1, [b"ab"])  # I rel(4) N ncols(2) t len(4) "ab"
    assert errors_of(impl, good[:8] + b"x" + good[9:]) == (
        "insert", 8, "bad tuple column kind 'x' for column 1 (expected n, u, t or b)")
    assert errors_of(impl, good[:9] + b"\x00\x00\x00\x03ab") == (
        "insert", 9, "column 1 length 3 runs past the end of the 15-byte message")
    assert errors_of(impl, good[:9] + b"\xff\xff\xff\xfeab")[:2] == ("insert", 9)
    assert errors_of(impl, good + b"\x00\x00") == ("insert", 15, "2 unexpected trailing bytes")
    assert errors_of(impl, b"I\x00\x00\x00\x01X\x00\x00") == (
        "insert", 5, "expected new tuple tag 'N', got 'X'")
    assert errors_of(impl, pg.delete(1, [None])[:5] + b"N\x00\x00")[:2] == ("delete", 5)
    update = pg.update(1, [None])
    assert errors_of(impl, update[:5] + b"Q" + update[6:])[:2] == ("update", 5)
    assert errors_of(impl, pg.update(1, [None], old=[None])[:9] + b"K\x00\x00")[:2] == (
        "update", 9)
    with pytest.raises(DecodeError):
        impl(pg.insert(1, [b"a"]), True)  # an xid the message does not have


def test_dml_accepts_bytearray_and_memoryview() -> None:
    data = pg.update(1, ROW, old=[b"1"])
    assert decode(bytearray(data)) == decode(memoryview(data)) == decode_pure(data)


def test_string_faults() -> None:
    assert errors_of(decode, b"O" + bytes(8) + b"abc") == (
        "origin", 9, "origin name is not NUL-terminated")
    assert errors_of(decode, b"O" + bytes(8) + b"ab\xff\x00") == (
        "origin", 11, "origin name is not valid UTF-8")
    assert errors_of(decode, pg.origin(1, "o") + b"!") == ("origin", 11, "1 unexpected trailing bytes")


def test_message_negative_content_length() -> None:
    data = pg.message(0, 1, "p", b"")[:-4] + b"\xff\xff\xff\xff"
    assert errors_of(decode, data) == ("message", 12, "content has negative length -1")


def test_truncate_count_past_end() -> None:
    assert errors_of(decode, b"T\x7f\xff\xff\xff\x00")[:2] == ("truncate", 6)


def test_timestamp_out_of_range() -> None:
    data = b"B" + bytes(8) + b"\x7f" + bytes(7) + bytes(4)
    assert errors_of(decode, data)[:2] == ("begin", 9)
