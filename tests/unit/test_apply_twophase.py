"""Two-phase source transactions (``apply.twophase``) without a server: which mode the target's
max_prepared_transactions allows, the GID a prepared transaction gets on the target, where its
changes go in each mode, what is recorded at the prepare and at its end, and that a prepare seen
again after a restart is not applied twice."""

from __future__ import annotations

import pytest
from fake_target import Rig, relation, rig
from test_apply_dispatch import T0, insert, transaction

from applier.apply.handlers import default_handlers
from applier.apply.twophase import GID_MAX_BYTES, TwoPhase, resolve_mode, target_gid
from applier.assembler import TransactionEnd, TransactionStart
from applier.protocol.lsn import LSN
from applier.protocol.messages import CommitPrepared, RollbackPrepared


def _two_phase(mode: str):  # type: ignore[no-untyped-def]
    def handlers(tx):  # type: ignore[no-untyped-def]
        built = default_handlers(tx)
        built.two_phase = TwoPhase(tx, mode, 5, built.skips, built.origins)
        return built
    return handlers


def prepared(r: Rig, xid: int, prepare_lsn: int, *changes: object) -> None:
    applier = r.applier
    applier.begin(TransactionStart(xid, LSN(prepare_lsn), T0, streamed=False, gid=f"g{xid}",
                                   end_lsn=LSN(prepare_lsn + 8)))
    for change in changes:
        applier.change(change)
    applier.prepare(TransactionEnd(xid, LSN(prepare_lsn), LSN(prepare_lsn + 8), T0, streamed=False,
                                   gid=f"g{xid}"))


def commit_prepared(r: Rig, xid: int, commit_lsn: int) -> None:
    r.applier.commit_prepared(CommitPrepared(0, LSN(commit_lsn), LSN(commit_lsn + 8), T0, xid,
                                             f"g{xid}"))


def test_prepare_mode_prepares_on_the_target_and_commits_it_at_commit_prepared() -> None:
    r = rig(fast=True, handlers=_two_phase("prepare"))
    r.applier.relation(relation())
    prepared(r, 800, 0x100, insert(1), insert(2))
    gid = target_gid("s", 5, 800)
    assert list(r.target.prepared) == [gid]
    assert r.store.committed.prepared == {}  # its header is inside the prepared transaction
    assert r.commits == [LSN(0x108)]  # the position past the prepare, committed on its own
    transaction(r, 801, 0x200, insert(3))  # a later transaction commits past it
    r.applier.flush()
    assert f"COMMIT PREPARED '{gid}'" not in r.target.statements
    commit_prepared(r, 800, 0x300)
    assert f"COMMIT PREPARED '{gid}'" in r.target.statements and r.target.prepared == {}
    assert r.store.committed.prepared == {}  # taken when it ended
    assert r.commits[-1] == LSN(0x308) and r.applier.counts["transactions"] == 2


def test_defer_mode_stores_the_changes_and_applies_them_at_commit_prepared() -> None:
    r = rig(fast=True, handlers=_two_phase("defer"))
    r.applier.relation(relation())
    prepared(r, 800, 0x100, insert(1), insert(2))
    assert r.target.prepared == {}
    header = r.store.committed.prepared[("s", 800)]
    assert (header.mode, header.source_gid, header.changes) == ("defer", "g800", 2)
    assert [s for t in r.target.transactions for s in t] == []  # nothing applied yet
    transaction(r, 801, 0x200, insert(3))  # leaves the fast path's state behind it
    commit_prepared(r, 800, 0x300)
    applied = r.target.transactions[-1]
    assert sum(s.startswith('INSERT INTO "public"."t"') for s in applied) == 2
    assert r.store.committed.prepared == {} and r.store.committed.chunks == {}
    assert r.commits[-1] == LSN(0x308)


@pytest.mark.parametrize("mode", ["prepare", "defer"])
def test_a_prepare_sent_again_after_a_restart_only_records_the_position(mode: str) -> None:
    r = rig(handlers=_two_phase(mode))
    r.applier.relation(relation())
    prepared(r, 800, 0x100, insert(1))
    statements = len(r.target.statements)
    # A new session (the position was not recorded yet) meets the same prepare.
    r.applier.tx.applied.commit_lsn = LSN(0)
    prepared(r, 800, 0x100, insert(1))
    new = r.target.statements[statements:]
    assert not any(s.startswith('INSERT INTO "public"') for s in new)
    assert r.commits == [LSN(0x108), LSN(0x108)]


@pytest.mark.parametrize("mode", ["prepare", "defer"])
def test_rollback_prepared_leaves_nothing_and_moves_only_the_end_position(mode: str) -> None:
    r = rig(handlers=_two_phase(mode))
    r.applier.relation(relation())
    transaction(r, 799, 0x50, insert(9))
    prepared(r, 800, 0x100, insert(1))
    r.applier.rollback_prepared(RollbackPrepared(0, LSN(0x108), LSN(0x208), T0, T0, 800, "g800"))
    assert r.target.prepared == {} and r.store.committed.prepared == {}
    progress = r.store.progress("s")
    assert progress is not None and (progress.commit_lsn, progress.end_lsn) == (LSN(0x100), LSN(0x208))
    committed = [s for t in r.target.transactions for s in t if s.startswith('INSERT INTO "public"')]
    assert len(committed) == 1  # transaction 799's row; nothing of the rolled-back one


def test_two_phase_mode_follows_max_prepared_transactions() -> None:
    assert resolve_mode("auto", 10) == "prepare"
    assert resolve_mode("auto", 0) == "defer"
    assert resolve_mode("defer", 10) == "defer"
    with pytest.raises(ValueError, match="max_prepared_transactions > 0"):
        resolve_mode("prepare", 0)


def test_gid_is_ours_and_fits() -> None:
    slot = "s" * 63  # the longest slot name PostgreSQL allows
    gid = target_gid(slot, 4294967295, 4294967295)
    assert gid.startswith("applier_4294967295_4294967295_") and len(gid.encode()) <= GID_MAX_BYTES
    assert target_gid("a", 1, 2) != target_gid("a", 2, 2) != target_gid("b", 1, 2)
