"""A streamed transaction applied as it streams (``apply.streaming``) without a server: a second
fake session beside the main one, sharing the in-memory store's committed state."""

from __future__ import annotations

import pytest
from fake_target import FakeTarget, Rig, relation, rig, table
from test_apply_dispatch import T0, insert, transaction

from applier.apply.build import second_applier
from applier.apply.streaming import StreamingApply
from applier.assembler import TransactionEnd, TransactionStart
from applier.errors import ApplyError, Cause, Directive, decide
from applier.protocol.lsn import LSN
from applier.protocol.messages import Message


def _early(r: Rig) -> tuple[StreamingApply, list[FakeTarget], set[int]]:
    seconds: list[FakeTarget] = []
    refused: set[int] = set()

    def open_second():  # type: ignore[no-untyped-def]
        store = r.store.another_session()
        target = FakeTarget(store)
        seconds.append(target)
        return second_applier(r.applier, target, lambda schema, name: table(name), store=store)  # type: ignore[arg-type]

    return StreamingApply(r.applier, open_second, refused), seconds, refused


def _streamed_insert(xid: int, key: int):  # type: ignore[no-untyped-def]
    change = insert(key)
    return type(change)(xid, change.relation_id, change.new_tuple)


def _finish(early: StreamingApply, xid: int, commit_lsn: int) -> bool:
    start = TransactionStart(xid, LSN(commit_lsn), T0, streamed=True, gid=None, end_lsn=LSN(commit_lsn + 8))
    end = TransactionEnd(xid, LSN(commit_lsn), LSN(commit_lsn + 8), T0, streamed=True, gid=None)
    return early.finish(start, end)


def test_a_streamed_transaction_commits_in_the_second_session_after_what_came_before() -> None:
    r = rig(fast=True)
    r.applier.relation(relation())
    early, seconds, _ = _early(r)
    assert early.open(900)
    early.schema(relation())
    assert early.change(_streamed_insert(900, 1))
    early.subtransaction(901)
    assert early.change(_streamed_insert(901, 2))
    early.abort(901)  # the subtransaction is undone: back to its savepoint
    early.pause()
    transaction(r, 700, 0x100, insert(50))  # committed on the source before the streamed one
    r.applier.flush()
    assert early.change(_streamed_insert(900, 3))
    assert _finish(early, 900, 0x200)
    (second,) = seconds
    (streamed,) = second.transactions
    assert '"applier_sub_901"' in " ".join(streamed)
    assert any(s.startswith('SAVEPOINT "applier_sub_901"') for s in streamed)
    assert 'ROLLBACK TO SAVEPOINT "applier_sub_901"' in streamed
    assert r.commits == [LSN(0x108), LSN(0x208)]  # commit order kept
    progress = r.store.progress("s")
    assert progress is not None and progress.commit_lsn == LSN(0x200)
    assert r.applier.counts["streamed_early"] == 1 and r.applier.tx.applied.commit_lsn == LSN(0x200)


def test_giving_up_after_taking_changes_needs_the_source_to_send_the_transaction_again() -> None:
    r = rig(fast=True)
    r.applier.relation(relation())
    early, seconds, refused = _early(r)
    assert early.open(900)
    early.schema(relation())  # pgoutput describes each relation inside every streamed transaction
    assert early.change(_streamed_insert(900, 1))
    with pytest.raises(ApplyError) as failed:
        early.change(Message(900, 1, LSN(0x150), "app", b"x"))  # not applied as it streams
    assert decide(failed.value) is Directive.RESTART_NOW and failed.value.cause is Cause.SEND_AGAIN
    assert refused == {900} and seconds[0].transactions == [] and not seconds[0].in_transaction
    assert not early.open(900)  # the resent transaction is buffered and applied at its commit


def test_declining_before_any_change_is_quiet() -> None:
    r = rig(fast=True)
    r.applier.relation(relation())
    early, seconds, refused = _early(r)
    assert early.open(900)
    assert not early.change(Message(900, 1, LSN(0x150), "app", b"x"))  # nothing taken yet
    assert refused == set() and not _finish(early, 900, 0x200)
    assert r.commits == []


def test_a_transaction_applied_before_a_restart_is_discarded_at_its_commit() -> None:
    r = rig(fast=True)
    r.applier.relation(relation())
    transaction(r, 700, 0x300, insert(50))
    r.applier.flush()
    early, seconds, _ = _early(r)
    assert early.open(900)
    early.schema(relation())
    assert early.change(_streamed_insert(900, 1))
    assert _finish(early, 900, 0x200)  # at or below the recorded position: done, nothing applied
    assert seconds[0].transactions == [] and r.commits == [LSN(0x308)]
