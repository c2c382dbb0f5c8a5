"""The apply stage's dispatch (``apply.dispatch.Applier``) without a server: a fake target session
and the in-memory bookkeeping store show what it runs, in which target transaction, and what it
records and reports."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from fake_target import FakeTarget, Rig, relation, rig, table

from applier.assembler import TransactionEnd, TransactionStart
from applier.errors import ApplyError, Cause, Directive, decide
from applier.protocol.lsn import LSN
from applier.protocol.messages import Delete, Insert, Origin, Truncate, TupleData, Update

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _row(*values: bytes | None) -> TupleData:
    return TupleData(bytes(ord("n") if v is None else ord("t") for v in values), values)


def transaction(r: Rig, xid: int, commit_lsn: int, *changes: object, origin: Origin | None = None) -> None:
    """Deliver one plain source transaction as the assembler does."""
    applier = r.applier
    applier.begin(TransactionStart(xid, LSN(commit_lsn), T0, streamed=False, gid=None, end_lsn=None))
    if origin is not None:
        applier.origin(origin)
    for change in changes:
        applier.change(change)
    applier.commit(TransactionEnd(xid, LSN(commit_lsn), LSN(commit_lsn + 8), T0, streamed=False,
                                  gid=None))


def insert(key: int, value: str = "v", relation_id: int = 1) -> Insert:
    return Insert(None, relation_id, _row(str(key).encode(), value.encode()))


def test_each_source_transaction_commits_with_its_position_on_the_careful_path() -> None:
    r = rig()
    r.applier.relation(relation())
    transaction(r, 700, 0x100, insert(1), insert(2))
    transaction(r, 701, 0x200, Update(None, 1, None, None, _row(b"1", b"w")),
                Delete(None, 1, "K", _row(b"2", None)))
    first, second = r.target.transactions  # (the in-memory store writes no SQL)
    assert [s.split(None, 1)[0] for s in first] == ["INSERT", "INSERT"]
    assert [s.split(None, 1)[0] for s in second] == ["UPDATE", "DELETE"]
    assert r.commits == [LSN(0x108), LSN(0x208)]
    progress = r.store.progress("s")
    assert progress is not None and (progress.commit_lsn, progress.end_lsn) == (LSN(0x200), LSN(0x208))
    assert r.applier.counts["transactions"] == 2 and r.applier.counts["insert"] == 2


def test_a_transaction_at_or_below_the_recorded_position_is_skipped_whole() -> None:
    r = rig()
    r.applier.relation(relation())
    transaction(r, 700, 0x100, insert(1))
    statements = len(r.target.statements)
    transaction(r, 700, 0x100, insert(1))  # sent again after a restart
    assert len(r.target.statements) == statements and r.commits == [LSN(0x108)]


def test_the_fast_path_shares_one_target_transaction_and_records_the_last_position() -> None:
    r = rig(fast=True)
    r.applier.relation(relation())
    for n in range(3):
        transaction(r, 700 + n, 0x100 * (n + 1), insert(n))
    assert r.target.transactions == [] and r.applier.holds_uncommitted
    r.applier.flush()
    (batch,) = r.target.transactions
    assert len(batch) == 3 and all(s.startswith('INSERT INTO "public"."t"') for s in batch)
    assert r.commits == [LSN(0x308)]
    assert r.applier.counts["transactions"] == 3 and r.applier.counts["insert"] == 3


def test_a_row_count_other_than_expected_sends_the_batch_to_the_careful_path() -> None:
    r = rig(fast=True)
    r.applier.relation(relation())
    transaction(r, 700, 0x100, insert(1))
    transaction(r, 701, 0x200, Update(None, 1, None, None, _row(b"9", b"w")))
    r.target.rows = lambda sql, values: 0 if sql.startswith("UPDATE") else 1  # row 9 is missing
    with pytest.raises(ApplyError) as failed:
        r.applier.flush()
    assert decide(failed.value) is Directive.REDO_CAREFUL and failed.value.careful_until == LSN(0x200)
    assert r.target.transactions == [] and r.store.progress("s") is None and r.commits == []
    assert r.applier.counts["transactions"] == 0  # nothing counted that did not commit


def test_a_failure_that_stops_the_worker_first_commits_the_transactions_before_it() -> None:
    """Issue 23, item 1: the fast path held a good transaction when the next one met a table
    the target lacks. The batch is redone row by row up to the failing transaction, so that the
    good one commits before the worker stops on the bad one."""
    r = rig(fast=True)
    r.applier.relation(relation())
    r.applier.relation(relation(2, "missing"))
    transaction(r, 700, 0x100, insert(1), insert(2))
    with pytest.raises(ApplyError) as failed:
        transaction(r, 701, 0x200, insert(3, relation_id=2))
    assert decide(failed.value) is Directive.REDO_CAREFUL and failed.value.careful_until == LSN(0x200)
    assert r.target.transactions == [] and not r.target.in_transaction
    # The new session, careful up to 0/200: the good transaction commits, the bad one stops it.
    again = rig(careful_until=LSN(0x200), tables={"t": table("t")})
    again.applier.relation(relation())
    again.applier.relation(relation(2, "missing"))
    transaction(again, 700, 0x100, insert(1), insert(2))
    with pytest.raises(ApplyError) as stopped:
        transaction(again, 701, 0x200, insert(3, relation_id=2))
    assert decide(stopped.value) is Directive.STOP and stopped.value.cause is Cause.NEEDS_OPERATOR
    assert stopped.value.commit_lsn == LSN(0x200) and "xid 701" in str(stopped.value)
    assert again.commits == [LSN(0x108)] and len(again.target.transactions) == 1


def test_a_lost_connection_inside_a_batch_is_retried_not_redone() -> None:
    r = rig(fast=True)
    r.applier.relation(relation())
    transaction(r, 700, 0x100, insert(1))
    r.target.fail_on["INSERT INTO \"public\""] = _lost()
    with pytest.raises(ApplyError) as failed:
        r.applier.flush()
    assert decide(failed.value) is Directive.RETRY


def test_truncate_names_every_table_quoted() -> None:
    r = rig(tables={"t": table("t"), 'od"d': table('od"d')})
    r.applier.relation(relation())
    r.applier.relation(relation(2, 'od"d'))
    transaction(r, 700, 0x100, Truncate(None, 2, (1, 2)))
    assert r.target.transactions[0][0] == 'TRUNCATE "public"."t", "public"."od""d" RESTART IDENTITY'


def test_a_skip_request_skips_exactly_that_transaction_and_records_it() -> None:
    from applier.apply.handlers import default_handlers
    from applier.apply.skipping import SkipRequests

    def handlers(tx):  # type: ignore[no-untyped-def]
        built = default_handlers(tx)
        built.skips = SkipRequests(tx.store, LSN(0x200))
        return built

    r = rig(handlers=handlers)
    r.store.request_skip("s", LSN(0x200))
    r.applier.relation(relation())
    transaction(r, 700, 0x100, insert(1))
    transaction(r, 701, 0x200, insert(2), insert(3))
    transaction(r, 702, 0x300, insert(4))
    ((slot, skipped),) = r.store.committed.skipped
    assert (skipped.xid, skipped.finish_lsn, skipped.changes, skipped.tables) == (
        701, LSN(0x200), 2, ("public.t",))
    assert r.store.committed.skip_requests == {}
    assert r.commits == [LSN(0x108), LSN(0x208), LSN(0x308)]
    inserted = [s for t in r.target.transactions for s in t if s.startswith('INSERT INTO "public"')]
    assert len(inserted) == 2


def test_a_transaction_from_a_skipped_origin_is_dropped_and_others_record_their_origin() -> None:
    from applier.apply.handlers import default_handlers
    from applier.apply.origins import OriginTag, OriginTracker

    def handlers(tx):  # type: ignore[no-untyped-def]
        built = default_handlers(tx)
        built.origins = OriginTracker(tx.store, OriginTag(None), skip=["loop"])
        return built

    r = rig(handlers=handlers)
    r.applier.relation(relation())
    transaction(r, 700, 0x100, insert(1), origin=Origin(LSN(0x50), "loop"))
    transaction(r, 701, 0x200, insert(2), origin=Origin(LSN(0x60), "upstream"))
    assert r.applier.counts["skipped_origin"] == 1
    ((key, (record, count)),) = r.store.committed.origins.items()
    assert key == ("s", "upstream") and record.origin_lsn == LSN(0x60) and count == 1


def test_the_error_context_names_the_source_transaction() -> None:
    r = rig()
    r.applier.relation(relation())
    r.target.fail_on['INSERT INTO "public"."t"'] = _refused()
    with pytest.raises(ApplyError) as failed:
        transaction(r, 777, 0x500, insert(1))
    text = str(failed.value)
    assert "xid 777" in text and f"commit LSN {LSN(0x500)}" in text and '(table "public"."t")' in text
    assert failed.value.commit_lsn == LSN(0x500) and decide(failed.value) is Directive.STOP


def test_a_change_before_its_relation_is_a_protocol_violation() -> None:
    r = rig()
    with pytest.raises(ApplyError) as failed:
        transaction(r, 700, 0x100, insert(1, relation_id=9))
    assert failed.value.cause is Cause.PROTOCOL and "relation id 9" in str(failed.value)


def _lost():  # type: ignore[no-untyped-def]
    from fake_target import lost_connection
    return lost_connection()


def _refused():  # type: ignore[no-untyped-def]
    from applier.errors import TargetError
    return TargetError("target: INSERT failed: invalid input syntax", sqlstate="22P02",
                       cause=Cause.REFUSED_DATA)


def test_fake_target_counts_transactions() -> None:
    """The double itself: statements outside a transaction are not part of one."""
    from applier.progress.memory import MemoryStore
    target = FakeTarget(MemoryStore("s"))
    target.sql("BEGIN")
    target.sql("SELECT 1")
    target.sql("COMMIT")
    target.sql("SELECT 2")
    assert target.transactions == [["SELECT 1"]]


def test_the_one_policy_for_a_failure_inside_a_batch() -> None:
    """errors.decide_in_batch: passing failures stay themselves; a conflict, refused data or a
    stop are redone row by row (the fast path and the dispatch both ask it)."""
    from fake_target import lost_connection

    from applier.apply.fast.pipeline import RowCountMismatch
    from applier.errors import decide_in_batch

    assert decide_in_batch(lost_connection()) is Directive.RETRY
    assert decide_in_batch(ApplyError("busy", cause=Cause.BUSY)) is Directive.RETRY
    assert decide_in_batch(ApplyError("again", cause=Cause.SEND_AGAIN)) is Directive.RESTART_NOW
    assert decide_in_batch(RowCountMismatch("0 rows, 1 expected")) is Directive.REDO_CAREFUL
    for cause in (Cause.REFUSED_DATA, Cause.NEEDS_OPERATOR, Cause.FAST_PATH_MISMATCH):
        assert decide_in_batch(ApplyError("x", cause=cause)) is Directive.REDO_CAREFUL
