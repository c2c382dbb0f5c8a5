"""Unit tests for applier.assembler: pure, no server."""

from __future__ import annotations

from pathlib import Path

import pytest
from assembler_helpers import (
    T0,
    RecordingSink,
    begin,
    begin_prepare,
    commit,
    commit_prepared,
    delete,
    feed,
    insert,
    message,
    origin,
    prepare,
    relation,
    rollback_prepared,
    stream_abort,
    stream_commit,
    stream_prepare,
    stream_start,
    stream_stop,
    truncate,
    type_,
    update,
)

from applier.assembler import Assembler, ProtocolSequenceError, TransactionEnd, TransactionStart
from applier.assembler.replay import HEARTBEAT_EVERY, REPLAY_CHUNK
from applier.protocol import (
    LSN,
    Delete,
    Insert,
    Message,
    Origin,
    Relation,
    Truncate,
    Type,
    Update,
    decode,
)

BUDGET = 1 << 20


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def spill_dir(tmp_path: Path) -> Path:
    return tmp_path / "spill"


def make(sink: RecordingSink, spill_dir: Path, budget: int = BUDGET) -> Assembler:
    return Assembler(sink, memory_budget=budget, spill_dir=spill_dir)


def spill_files(spill_dir: Path) -> list[Path]:
    return sorted(spill_dir.iterdir())


# -- plain transactions --------------------------------------------------------------------

def test_plain_transaction_passes_through_as_it_arrives(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    feed(asm, relation(16384, "t"), type_(90000, "mood"))
    assert sink.names() == ["relation", "type"]  # outside a transaction: at once

    feed(asm, begin(700, 0x1000))
    assert sink.calls[-1] == ("begin", TransactionStart(700, LSN(0x1000), T0, streamed=False,
                                                         gid=None, end_lsn=None))
    steps = [
        (origin("node_a", 0x99), "origin", Origin),
        (relation(16384, "t"), "relation", Relation),
        (type_(90000, "mood"), "type", Type),
        (insert(16384, b"1"), "change", Insert),
        (update(16384, b"2"), "change", Update),
        (delete(16384, b"3"), "change", Delete),
        (truncate(16384), "change", Truncate),
        (message(b"tx", transactional=True), "change", Message),
        (message(b"now", transactional=False), "message", Message),
    ]
    for raw, name, kind in steps:
        feed(asm, raw)  # delivered immediately, not buffered
        assert sink.calls[-1][0] == name and type(sink.calls[-1][1]) is kind
    feed(asm, commit(0x1000, 0x1010))
    assert sink.calls[-1] == ("commit", TransactionEnd(700, LSN(0x1000), LSN(0x1010), T0,
                                                       streamed=False, gid=None))
    assert len(sink.calls) == 2 + 1 + len(steps) + 1
    assert asm.memory_bytes == 0 and asm.open_streamed_xids == ()


def test_two_phase_plain(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    feed(asm, begin_prepare(701, 0x2000, 0x2010, "gid1"), insert(1, b"a"),
         prepare(701, 0x2000, 0x2010, "gid1"))
    assert sink.calls[0] == ("begin", TransactionStart(701, LSN(0x2000), T0, streamed=False,
                                                       gid="gid1", end_lsn=LSN(0x2010)))
    assert sink.calls[-1] == ("prepare", TransactionEnd(701, LSN(0x2000), LSN(0x2010), T0,
                                                        streamed=False, gid="gid1"))
    feed(asm, commit_prepared(701, 0x3000, 0x3010, "gid1"),
         rollback_prepared(702, 0x4000, 0x4010, "gid2"))
    assert sink.names()[-2:] == ["commit_prepared", "rollback_prepared"]
    assert sink.calls[-2][1].gid == "gid1" and sink.calls[-1][1].xid == 702


# -- streamed transactions -----------------------------------------------------------------

def test_interleaved_streams_one_committed_one_aborted(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    feed(asm, stream_start(10, first=True))
    assert asm.in_stream
    feed(asm, insert(1, b"10-a", xid=10), stream_stop())
    assert not asm.in_stream
    feed(asm, stream_start(20, first=True), insert(1, b"20-a", xid=20), stream_stop())
    # A small plain transaction between chunks is delivered at once.
    feed(asm, begin(30, 0x500), insert(1, b"30-a"), commit(0x500, 0x510))
    assert sink.names() == ["begin", "change", "commit"]
    assert sink.values() == [b"30-a"]
    feed(asm, stream_start(10, first=False), insert(1, b"10-b", xid=10), stream_stop(),
         stream_start(20, first=False), insert(1, b"20-b", xid=20), stream_stop())
    assert len(sink.calls) == 3  # nothing of the streamed ones yet
    assert asm.open_streamed_xids == (10, 20)

    feed(asm, stream_abort(20, 20))
    assert asm.open_streamed_xids == (10,)
    sink.calls.clear()
    feed(asm, stream_commit(10, 0x900, 0x910))
    assert sink.names() == ["begin", "change", "change", "commit"]
    assert sink.values() == [b"10-a", b"10-b"]
    assert sink.calls[0][1] == TransactionStart(10, LSN(0x900), T0, streamed=True, gid=None,
                                                end_lsn=LSN(0x910))
    assert sink.calls[-1][1] == TransactionEnd(10, LSN(0x900), LSN(0x910), T0, streamed=True,
                                               gid=None)
    assert all(msg.xid == 10 for name, msg in sink.calls if name == "change")
    assert asm.open_streamed_xids == () and asm.memory_bytes == 0


def _stream_subxacts(asm: Assembler, top: int, plan: list[tuple[int, bytes]]) -> None:
    feed(asm, stream_start(top, first=True))
    feed(asm, *(insert(1, value, xid=xid) for xid, value in plan))
    feed(asm, stream_stop())


SUBXACT_PLAN = [(100, b"top-1"), (101, b"A-1"), (101, b"A-2"), (102, b"B-1"), (103, b"C-1"),
                (102, b"B-2"), (100, b"top-2")]


@pytest.mark.parametrize(("aborted", "kept"), [
    (102, [b"top-1", b"A-1", b"A-2"]),  # B: B and C (first seen after B) go, A stays
    (101, [b"top-1"]),  # A: everything from A's first change on
    (103, [b"top-1", b"A-1", b"A-2", b"B-1"]),  # C: the last subxact
    (999, [v for _, v in SUBXACT_PLAN]),  # unknown subxid: no-op
])
def test_subxact_abort(sink: RecordingSink, spill_dir: Path, aborted: int, kept: list[bytes]) -> None:
    asm = make(sink, spill_dir)
    _stream_subxacts(asm, 100, SUBXACT_PLAN)
    before = asm.memory_bytes
    feed(asm, stream_abort(100, aborted))
    assert (asm.memory_bytes < before) == (aborted != 999)
    feed(asm, stream_commit(100, 0x100, 0x110))
    assert sink.values() == kept
    assert asm.memory_bytes == 0


def test_subxact_aborts_out_of_order_then_more_changes(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    _stream_subxacts(asm, 100, [(101, b"A"), (102, b"B"), (103, b"C")])
    feed(asm, stream_abort(100, 103), stream_abort(100, 101))  # C, then A (takes B along)
    feed(asm, stream_start(100, first=False), insert(1, b"top", xid=100),
         insert(1, b"B-again", xid=102), insert(1, b"D", xid=104), stream_stop())
    feed(asm, stream_abort(100, 102))  # B is recorded afresh at its new first change
    feed(asm, stream_commit(100, 0x100, 0x110))
    assert sink.values() == [b"top"]


def test_full_abort_discards_everything(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir, budget=512)
    _stream_subxacts(asm, 100, [(100 + i % 3, b"x" * 50) for i in range(30)])
    assert asm.spilled_bytes > 0 and spill_files(spill_dir)
    feed(asm, stream_abort(100, 100))
    assert sink.calls == [] and asm.open_streamed_xids == ()
    assert asm.memory_bytes == 0 and asm.spilled_bytes == 0 and spill_files(spill_dir) == []


def test_abort_of_unknown_xid_is_a_no_op(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    feed(asm, stream_abort(555, 555), stream_abort(555, 556))
    assert sink.calls == [] and asm.open_streamed_xids == ()


def test_schema_origin_and_messages_in_stream(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    feed(asm, stream_start(50, first=True), origin("node_a", 0),
         relation(16384, "t", xid=50), insert(16384, b"1", xid=50),
         type_(90000, "mood", xid=51), relation(16384, "t2", xid=51),
         message(b"tx", transactional=True, xid=51))
    assert sink.calls == []
    feed(asm, message(b"now", transactional=False, xid=51))
    assert sink.names() == ["message"]  # delivered immediately, even inside a stream block
    assert sink.calls[0][1].content == b"now"
    feed(asm, update(16384, b"2", xid=50), stream_stop(), stream_commit(50, 0x700, 0x710))
    assert sink.names() == ["message", "begin", "origin", "relation", "change", "type",
                            "relation", "change", "change", "commit"]
    assert sink.calls[3][1].name == "t" and sink.calls[6][1].name == "t2"
    assert sink.calls[5][1].xid == 51 and sink.calls[7][1].content == b"tx"


def test_stream_prepare(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    feed(asm, stream_start(60, first=True), insert(1, b"p", xid=60), stream_stop(),
         stream_prepare(60, 0x800, 0x810, "g60"))
    assert sink.calls[0] == ("begin", TransactionStart(60, LSN(0x800), T0, streamed=True,
                                                       gid="g60", end_lsn=LSN(0x810)))
    assert sink.calls[-1] == ("prepare", TransactionEnd(60, LSN(0x800), LSN(0x810), T0,
                                                        streamed=True, gid="g60"))
    assert sink.values() == [b"p"] and asm.open_streamed_xids == ()


@pytest.mark.parametrize("finish", ["commit", "rollback"])
def test_restreamed_changes_of_an_already_confirmed_prepare_are_dropped(
        sink: RecordingSink, spill_dir: Path, finish: str) -> None:
    """After a restart past its prepare, the server may stream a prepared transaction's changes
    again and then send only Commit/Rollback Prepared: the buffer goes, and with it the spill."""
    asm = make(sink, spill_dir, budget=64 * 1024)
    feed(asm, stream_start(62, first=True), *(insert(1, b"x" * 1000, xid=62) for _ in range(100)),
         stream_stop())
    assert spill_files(spill_dir) and not asm.idle
    end = (commit_prepared(62, 0x900, 0x910, "g62") if finish == "commit"
           else rollback_prepared(62, 0x800, 0x910, "g62"))
    feed(asm, end)
    assert sink.names() == [f"{finish}_prepared"]
    assert asm.idle and asm.memory_bytes == 0 and spill_files(spill_dir) == []


def test_empty_stream_commit_after_start(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    feed(asm, stream_start(61, first=True), stream_stop(), stream_commit(61, 0x10, 0x20))
    assert sink.names() == ["begin", "commit"]


# -- memory budget and spill files -----------------------------------------------------------

def test_spill_keeps_memory_within_budget(sink: RecordingSink, spill_dir: Path) -> None:
    budget = 4096
    asm = make(sink, spill_dir, budget=budget)
    values = [f"row-{i:05d}".encode() for i in range(10_000)]
    feed(asm, stream_start(70, first=True))
    for i, value in enumerate(values):
        feed(asm, insert(1, value, xid=70 if i % 7 else 71 + i % 5))
        assert asm.memory_bytes <= budget
        if i % 500 == 0:  # chunk boundaries, as the server sends them
            feed(asm, stream_stop(), stream_start(70, first=False))
    feed(asm, stream_stop())
    assert asm.spilled_bytes > 0
    assert spill_files(spill_dir) == [spill_dir / "applier-stream-70.changes"]
    feed(asm, stream_commit(70, 0xA00, 0xA10))
    assert sink.values() == values
    assert sink.names() == ["begin"] + ["change"] * len(values) + ["commit"]
    assert spill_files(spill_dir) == []
    assert asm.memory_bytes == 0 and asm.spilled_bytes == 0


def test_long_replay_calls_the_heartbeat(sink: RecordingSink, spill_dir: Path) -> None:
    """Replaying a large streamed transaction keeps telling the source the worker is alive."""
    beats: list[int] = []
    asm = Assembler(sink, memory_budget=4096, spill_dir=spill_dir,
                    heartbeat=lambda: beats.append(len(sink.names())))
    feed(asm, stream_start(80, first=True))
    for i in range(3 * HEARTBEAT_EVERY + 5):
        feed(asm, insert(1, f"row-{i}".encode(), xid=80))
    feed(asm, stream_stop())
    assert beats == []  # buffering reads the stream anyway
    feed(asm, stream_commit(80, 0xB00, 0xB10))
    # sink: begin, then changes; beat n comes right after the (n * HEARTBEAT_EVERY)-th change
    assert beats == [1 + n * HEARTBEAT_EVERY for n in (1, 2, 3)]


class _TakingSink(RecordingSink):
    """Takes, still encoded, every replayed change whose payload contains b"take"."""

    def take_changes(self, payloads: list[bytes], start: int) -> int:
        while start < len(payloads) and b"take" in payloads[start]:
            self.calls.append(("taken", payloads[start]))
            start += 1
        return start


def test_replay_offers_changes_undecoded_and_keeps_their_order(spill_dir: Path) -> None:
    """What the sink takes itself and what it is given decoded interleave in the stream's order,
    across chunk boundaries."""
    sink = _TakingSink()
    asm = Assembler(sink, memory_budget=1 << 20, spill_dir=spill_dir)
    feed(asm, stream_start(81, first=True))
    values = [(b"take-%d" if i % 7 < 4 else b"keep-%d") % i for i in range(3 * REPLAY_CHUNK + 3)]
    for value in values:
        feed(asm, insert(1, value, xid=81))
    feed(asm, stream_stop())
    feed(asm, stream_commit(81, 0xC00, 0xC10))
    assert sink.names()[0] == "begin" and sink.names()[-1] == "commit"
    # Each change, taken (its payload) or given decoded (its message), in the stream's order.
    delivered = [call if name == "taken" else call.new_tuple.values[0] for name, call in sink.calls[1:-1]]
    assert len(delivered) == len(values)
    for value, got in zip(values, delivered):
        assert (got.endswith(value) if value.startswith(b"take") else got == value), (value, got)
    kept = [msg.new_tuple.values[0] for name, msg in sink.calls if name == "change"]
    assert kept == [value for value in values if value.startswith(b"keep")]


def test_spill_picks_largest_buffer(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir, budget=2048)
    feed(asm, stream_start(80, first=True), *(insert(1, b"big" * 10, xid=80) for _ in range(15)),
         stream_stop(), stream_start(81, first=True), insert(1, b"small", xid=81))
    assert not (spill_dir / "applier-stream-81.changes").exists()
    feed(asm, *(insert(1, b"s", xid=81) for _ in range(8)))
    assert (spill_dir / "applier-stream-80.changes").exists()
    assert not (spill_dir / "applier-stream-81.changes").exists()
    assert asm.memory_bytes <= 2048


def test_change_larger_than_budget_goes_to_disk(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir, budget=256)
    huge = b"h" * 1000
    feed(asm, stream_start(90, first=True), insert(1, b"first", xid=90), insert(1, huge, xid=90))
    assert asm.memory_bytes == 0 and asm.spilled_bytes > 1000
    feed(asm, insert(1, b"last", xid=90), stream_stop(), stream_commit(90, 1, 2))
    assert sink.values() == [b"first", huge, b"last"]


def test_subxact_abort_truncates_spill_file(sink: RecordingSink, spill_dir: Path) -> None:
    asm = make(sink, spill_dir, budget=1024)
    path = spill_dir / "applier-stream-100.changes"
    top = [f"top-{i}".encode() for i in range(20)]
    sub = [f"sub-{i}".encode() for i in range(40)]
    _stream_subxacts(asm, 100, [(100, v) for v in top] + [(101, v) for v in sub])
    size_with_sub = path.stat().st_size
    feed(asm, stream_abort(100, 101))
    assert path.stat().st_size < size_with_sub
    assert asm.memory_bytes == 0  # the cut fell inside the file: the memory tail went too
    after = [f"after-{i}".encode() for i in range(40)]
    feed(asm, stream_start(100, first=False), *(insert(1, v, xid=102) for v in after),
         stream_stop())
    assert asm.spilled_bytes == path.stat().st_size
    feed(asm, stream_commit(100, 0x100, 0x110))
    assert sink.values() == top + after
    assert not path.exists()


def test_subxact_abort_within_memory_tail_of_spilled_transaction(sink: RecordingSink,
                                                                spill_dir: Path) -> None:
    asm = make(sink, spill_dir, budget=1024)
    top = [f"top-{i}".encode() for i in range(30)]
    _stream_subxacts(asm, 100, [(100, v) for v in top] + [(101, b"A"), (102, b"B")])
    spilled = asm.spilled_bytes
    assert spilled > 0 and asm.memory_bytes > 0
    feed(asm, stream_abort(100, 102))
    assert asm.spilled_bytes == spilled
    feed(asm, stream_commit(100, 0x100, 0x110))
    assert sink.values() == top + [b"A"]


def test_stale_spill_files_removed_at_start_and_close(sink: RecordingSink, spill_dir: Path) -> None:
    spill_dir.mkdir()
    (spill_dir / "applier-stream-42.changes").write_bytes(b"old")
    (spill_dir / "unrelated.txt").write_bytes(b"keep")
    asm = make(sink, spill_dir, budget=256)
    assert spill_files(spill_dir) == [spill_dir / "unrelated.txt"]
    feed(asm, stream_start(43, first=True), *(insert(1, b"x" * 40, xid=43) for _ in range(10)))
    assert (spill_dir / "applier-stream-43.changes").exists()
    asm.close()
    assert spill_files(spill_dir) == [spill_dir / "unrelated.txt"]
    assert asm.open_streamed_xids == () and asm.memory_bytes == 0 and not asm.in_stream


def test_spill_dir_is_created(sink: RecordingSink, tmp_path: Path) -> None:
    make(sink, tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()


# -- sequence errors --------------------------------------------------------------------------

SEQUENCE_ERRORS = {
    "commit without begin": ([commit(0x10, 0x20)], "commit"),
    "commit LSN mismatch": ([begin(1, 0x10), commit(0x11, 0x20)], "does not match"),
    "commit after begin_prepare": ([begin_prepare(1, 0x10, 0x20, "g"), commit(0x10, 0x20)],
                                   "begin_prepare"),
    "prepare without begin_prepare": ([begin(1, 0x10), prepare(1, 0x10, 0x20, "g")],
                                      "without begin_prepare"),
    "prepare xid mismatch": ([begin_prepare(1, 0x10, 0x20, "g"), prepare(2, 0x10, 0x20, "g")],
                             "does not match"),
    "begin inside transaction": ([begin(1, 0x10), begin(2, 0x20)], "inside transaction xid 1"),
    "begin inside stream block": ([stream_start(5, True), begin(2, 0x20)], "stream block of xid 5"),
    "insert outside transaction": ([insert(1, b"x")], "insert outside"),
    "update outside transaction": ([update(1, b"x")], "update outside"),
    "delete outside transaction": ([delete(1, b"x")], "delete outside"),
    "truncate outside transaction": ([truncate(1)], "truncate outside"),
    "transactional message outside": ([message(b"m", True)], "message outside"),
    "origin outside transaction": ([origin("n")], "origin 'n'"),
    "stream stop without start": ([stream_stop()], "stream_stop without stream_start"),
    "stream start inside transaction": ([begin(1, 0x10), stream_start(5, True)],
                                        "inside transaction"),
    "stream start inside stream block": ([stream_start(5, True), stream_start(6, True)],
                                         "stream block of xid 5"),
    "first segment for open xid": ([stream_start(5, True), stream_stop(), stream_start(5, True)],
                                   "already open"),
    "later segment for unknown xid": ([stream_start(5, False)], "first segment never came"),
    "stream commit inside block": ([stream_start(5, True), stream_commit(5, 1, 2)],
                                   "stream block of xid 5"),
    "stream abort inside block": ([stream_start(5, True), stream_abort(5, 5)],
                                  "stream block of xid 5"),
    "stream prepare inside block": ([stream_start(5, True), stream_prepare(5, 1, 2, "g")],
                                    "stream block of xid 5"),
    "stream commit unknown xid": ([stream_commit(5, 1, 2)], "no stream_start"),
    "stream prepare unknown xid": ([stream_prepare(5, 1, 2, "g")], "no stream_start"),
    "stream commit inside transaction": ([begin(1, 0x10), stream_commit(5, 1, 2)],
                                         "inside transaction"),
    "commit prepared inside transaction": ([begin(1, 0x10), commit_prepared(1, 1, 2, "g")],
                                           "inside transaction"),
    "rollback prepared inside block": ([stream_start(5, True), rollback_prepared(1, 1, 2, "g")],
                                       "stream block"),
}


@pytest.mark.parametrize("case", sorted(SEQUENCE_ERRORS))
def test_sequence_errors(sink: RecordingSink, spill_dir: Path, case: str) -> None:
    raws, expected = SEQUENCE_ERRORS[case]
    asm = make(sink, spill_dir)
    feed(asm, *raws[:-1])
    with pytest.raises(ProtocolSequenceError, match=expected):
        feed(asm, raws[-1])


def test_stream_change_decoded_without_in_stream_is_rejected(sink: RecordingSink,
                                                             spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    feed(asm, stream_start(5, True))
    raw = insert(1, b"x")  # no xid: the caller lost track of in_stream
    with pytest.raises(ProtocolSequenceError, match="in_stream=True"):
        asm.feed(decode(raw, in_stream=False), raw)


def test_sink_failure_during_replay_still_removes_the_spill_file(spill_dir: Path) -> None:
    class FailingSink(RecordingSink):
        def change(self, msg: object) -> None:
            raise RuntimeError("apply failed")

    asm = Assembler(FailingSink(), memory_budget=256, spill_dir=spill_dir)
    feed(asm, stream_start(5, True), *(insert(1, b"x" * 40, xid=5) for _ in range(10)),
         stream_stop())
    assert spill_files(spill_dir)
    with pytest.raises(RuntimeError, match="apply failed"):
        feed(asm, stream_commit(5, 1, 2))
    assert spill_files(spill_dir) == [] and asm.open_streamed_xids == () and asm.memory_bytes == 0


def test_row_changes_buffered_undecoded_replay_as_if_fed(sink: RecordingSink, spill_dir: Path) -> None:
    """``buffer_changes`` takes a stream block's inserts, updates and deletes as they came (only
    their xid read), stops at anything else, and the transaction replays exactly as if each had
    gone through ``feed``: across a spill and a subtransaction abort too."""
    fed, direct = RecordingSink(), make(sink, spill_dir, budget=600)
    reference = make(fed, spill_dir / "reference", budget=600)
    changes = [insert(1, b"a", xid=90), update(1, b"b", xid=91), insert(1, b"d" * 200, xid=90),
               delete(1, b"c", xid=92)]
    block = [relation(1, "t", xid=90), *changes, stream_stop()]
    for asm in (direct, reference):
        feed(asm, stream_start(90, first=True))
    assert direct.buffer_changes(block, 0) == 0          # a Relation is not a row change
    feed(direct, block[0])
    assert direct.buffer_changes(block, 1) == len(block) - 1  # stops at Stream Stop
    feed(direct, block[-1])
    feed(reference, *block)
    assert direct.buffer_changes([insert(1, b"x", xid=90)], 0) == 0  # outside any block
    for asm in (direct, reference):
        feed(asm, stream_abort(90, 92), stream_commit(90, 0xD00, 0xD10))
    assert sink.calls == fed.calls and sink.values() == [b"a", b"b", b"d" * 200]


def test_a_buffered_row_change_without_a_transaction_id_is_refused(sink: RecordingSink,
                                                                   spill_dir: Path) -> None:
    asm = make(sink, spill_dir)
    feed(asm, stream_start(93, first=True))
    with pytest.raises(ProtocolSequenceError, match="no valid transaction id"):
        asm.buffer_changes([insert(1, b"a", xid=0)], 0)


# -- a streamed transaction applied as it streams (EarlyApply) ------------------------------------

class RecordingEarly:
    """An EarlyApply that records what it is given. It declines changes once ``take`` is False;
    ``finish`` answers ``commits``."""

    def __init__(self, accept: bool = True, take: bool = True, commits: bool = True) -> None:
        self.accept, self.take, self.commits = accept, take, commits
        self.calls: list[tuple] = []

    def open(self, xid: int) -> bool:
        self.calls.append(("open", xid))
        return self.accept

    def changes(self, payloads: list[bytes], start: int, stop: int) -> bool:
        values = []
        for raw in payloads[start:stop]:
            msg = decode(raw, in_stream=True)
            values.append((msg.old_tuple if isinstance(msg, Delete) else msg.new_tuple).values[0])
        self.calls.append(("changes", tuple(values)) if self.take else ("declined", tuple(values)))
        return self.take

    def change(self, msg) -> bool:
        self.calls.append(("change" if self.take else "declined", type(msg).__name__))
        return self.take

    def schema(self, msg) -> None:
        self.calls.append(("schema", type(msg).__name__))

    def subtransaction(self, subxid: int) -> None:
        self.calls.append(("subtransaction", subxid))

    def pause(self) -> None:
        self.calls.append(("pause",))

    def abort(self, subxid: int) -> None:
        self.calls.append(("abort", subxid))

    def finish(self, start: TransactionStart, end: TransactionEnd) -> bool:
        self.calls.append(("finish", start.xid, end.commit_lsn))
        return self.commits

    def cancel(self) -> None:
        self.calls.append(("cancel",))


def _early_stream(asm: Assembler) -> None:
    """xid 70: a Relation, changes of the top level and of subxacts 71 and 72 (72 aborted), in
    two segments, row changes buffered undecoded as the worker does, or fed decoded."""
    feed(asm, stream_start(70, first=True), relation(1, "t", xid=70))
    block = [insert(1, b"a", xid=70), insert(1, b"b", xid=70), insert(1, b"c", xid=71),
             update(1, b"d", xid=70), stream_stop()]
    assert asm.buffer_changes(block, 0) == 4
    feed(asm, block[-1])
    feed(asm, stream_start(70, first=False), insert(1, b"e", xid=72), delete(1, b"f", xid=70),
         stream_stop(), stream_abort(70, 72), stream_abort(70, 73))


def test_an_early_transaction_gets_its_records_as_they_stream_cut_at_subtransactions(
        sink: RecordingSink, spill_dir: Path) -> None:
    early = RecordingEarly()
    asm = Assembler(sink, memory_budget=BUDGET, spill_dir=spill_dir, early=early)
    _early_stream(asm)
    assert asm.memory_bytes < 200 and asm.spilled_bytes == 0  # the changes are not buffered
    feed(asm, stream_commit(70, 0xE00, 0xE10))
    assert early.calls == [
        ("open", 70), ("schema", "Relation"), ("changes", (b"a", b"b")), ("subtransaction", 71),
        ("changes", (b"c", b"d")), ("pause",), ("subtransaction", 72), ("change", "Insert"),
        ("change", "Delete"), ("pause",), ("abort", 72), ("abort", 73),
        ("finish", 70, LSN(0xE00))]
    # Done early: nothing is delivered again, and nothing is left.
    assert sink.calls == [] and asm.idle and spill_files(spill_dir) == []


def test_an_early_transaction_is_cut_only_where_a_subtransaction_first_appears(
        sink: RecordingSink, spill_dir: Path) -> None:
    early = RecordingEarly()
    asm = Assembler(sink, memory_budget=BUDGET, spill_dir=spill_dir, early=early)
    feed(asm, stream_start(70, first=True), relation(1, "t", xid=70))
    # Back and forth between the top level and subtransactions already seen: one run.
    block = [insert(1, b"a", xid=70), insert(1, b"b", xid=71), insert(1, b"c", xid=72),
             update(1, b"d", xid=71), delete(1, b"e", xid=70), insert(1, b"f", xid=72),
             insert(1, b"g", xid=73), stream_stop()]
    assert asm.buffer_changes(block, 0) == 7
    assert asm.buffer_changes(block, 7) == 7  # a Stream Stop is no row change
    assert early.calls == [
        ("open", 70), ("schema", "Relation"), ("changes", (b"a",)), ("subtransaction", 71),
        ("changes", (b"b",)), ("subtransaction", 72), ("changes", (b"c", b"d", b"e", b"f")),
        ("subtransaction", 73), ("changes", (b"g",))]


def test_a_declined_early_transaction_is_buffered_from_there_and_delivered_at_its_commit(
        sink: RecordingSink, spill_dir: Path) -> None:
    early, fed = RecordingEarly(take=False), RecordingSink()
    asm = Assembler(sink, memory_budget=BUDGET, spill_dir=spill_dir, early=early)
    reference = make(fed, spill_dir / "reference")
    _early_stream(asm)
    _early_stream(reference)
    for each in (asm, reference):
        feed(each, stream_commit(70, 0xE00, 0xE10))
    # Declined at its first changes: passed nothing more, buffered and replayed as usual.
    assert early.calls == [("open", 70), ("schema", "Relation"), ("declined", (b"a", b"b"))]
    # The abort of 72 cuts everything from its first change on (the delete of f too).
    assert sink.calls == fed.calls and sink.values() == [b"a", b"b", b"c", b"d"]


def test_only_one_transaction_at_a_time_is_applied_early(sink: RecordingSink, spill_dir: Path) -> None:
    early = RecordingEarly()
    asm = Assembler(sink, memory_budget=BUDGET, spill_dir=spill_dir, early=early)
    feed(asm, stream_start(80, first=True), relation(1, "t", xid=80), stream_stop(),
         stream_start(81, first=True), insert(1, b"x", xid=81), stream_stop(),
         stream_commit(81, 0xF00, 0xF10))
    assert ("open", 81) not in early.calls and sink.values() == [b"x"]
    feed(asm, stream_abort(80, 80))
    assert early.calls == [("open", 80), ("schema", "Relation"), ("pause",), ("abort", 80)]
    # Refused: buffered only, and delivered at its commit.
    refusing = RecordingEarly(accept=False)
    other = Assembler(RecordingSink(), memory_budget=BUDGET, spill_dir=spill_dir / "o", early=refusing)
    feed(other, stream_start(82, first=True), insert(1, b"y", xid=82), stream_stop())
    assert refusing.calls == [("open", 82)] and other.memory_bytes > 0


@pytest.mark.parametrize("end", ["prepare", "close", "restreamed"])
def test_an_early_transaction_ends_early_when_it_does_not_simply_commit(
        sink: RecordingSink, spill_dir: Path, end: str) -> None:
    early = RecordingEarly()
    asm = Assembler(sink, memory_budget=BUDGET, spill_dir=spill_dir, early=early)
    feed(asm, stream_start(90, first=True), relation(1, "t", xid=90), stream_stop())
    if end == "prepare":
        feed(asm, stream_prepare(90, 0x100, 0x110, "g"))
        assert early.calls[-1] == ("cancel",)  # delivered from the buffer (the Relation)
        assert [name for name, _ in sink.calls] == ["begin", "relation", "prepare"]
    elif end == "close":
        asm.close()
        assert early.calls[-1] == ("abort", 90)
    else:
        feed(asm, commit_prepared(90, 0x200, 0x210, "g"))
        assert early.calls[-1] == ("abort", 90)
    assert not any(call[0] == "finish" for call in early.calls) and asm.idle


def test_an_early_transaction_without_a_valid_subxid_is_refused(sink: RecordingSink,
                                                                spill_dir: Path) -> None:
    asm = Assembler(sink, memory_budget=BUDGET, spill_dir=spill_dir, early=RecordingEarly())
    feed(asm, stream_start(93, first=True))
    with pytest.raises(ProtocolSequenceError, match="no valid transaction id"):
        asm.buffer_changes([insert(1, b"a", xid=93), insert(1, b"b", xid=0)], 0)


def test_a_full_spill_disk_is_the_operators_to_fix(tmp_path: Path, monkeypatch) -> None:
    """ENOSPC while spilling: a SpillFailed naming the directory and the bytes to write, which
    the error policy reads as needing the operator (not a bug with a traceback)."""
    import builtins
    import errno

    from applier.assembler.buffer import StreamBuffer
    from applier.assembler.errors import SpillFailed
    from applier.errors import Cause, Directive, cause_of, decide

    buffer = StreamBuffer(7, tmp_path / "xid-7.spill")
    buffer.append(7, b"x" * 100)
    real_open = builtins.open

    def full(path, mode="r", *args, **kwargs):
        if "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(SpillFailed) as failed:
        buffer.spill()
    text = str(failed.value)
    assert (f"cannot write the spill file of streamed transaction 7 in {tmp_path}: "
            "No space left on device (104 bytes to write") in text
    assert cause_of(failed.value) is Cause.NEEDS_OPERATOR and decide(failed.value) is Directive.STOP
    assert buffer.memory_bytes > 0  # nothing forgotten: the records stay in memory
