"""The apply plan: one pure function decides every source transaction's route."""

from __future__ import annotations

import pytest

from applier.apply import plan as plan_module
from applier.apply.plan import CARRIES, Facts, Need, Route, already_applied, carries, plan
from applier.protocol.lsn import LSN


def facts(commit: int | None = 500, **kwargs: object) -> Facts:
    base: dict[str, object] = {"applied": LSN(100), "careful_until": LSN(0), "lane": True}
    base.update(kwargs)
    return Facts(None if commit is None else LSN(commit), **base)  # type: ignore[arg-type]


def test_a_plain_transaction_takes_the_lane_then_the_fast_path_then_the_careful_path() -> None:
    assert plan(facts()) is Route.LANE
    assert plan(facts(lane=False)) is Route.FAST
    assert plan(facts(lane=True, fast=False)) is Route.CAREFUL  # the lane writes through the fast path


@pytest.mark.parametrize("commit", [100, 99, 1])
def test_a_transaction_within_the_recorded_position_is_already_applied_whatever_else(commit: int) -> None:
    for extra in ({}, {"prepared": True}, {"skip_matches": True}, {"streamed": True, "early": True}):
        assert plan(facts(commit, **extra)) is Route.ALREADY_APPLIED
    assert already_applied(LSN(commit), LSN(100))
    assert not already_applied(LSN(101), LSN(100))


def test_a_skip_request_wins_over_two_phase_and_every_applying_route() -> None:
    assert plan(facts(skip_matches=True, prepared=True)) is Route.SKIPPED
    assert plan(facts(prepared=True)) is Route.PREPARED


def test_a_redone_stretch_goes_row_by_row_and_the_floor_tells_the_lane() -> None:
    assert plan(facts(450, careful_until=LSN(450))) is Route.CAREFUL
    assert plan(facts(451, careful_until=LSN(450))) is Route.LANE
    assert facts(careful_until=LSN(450)).floor == LSN(450)
    assert facts(careful_until=LSN(50)).floor == LSN(100)


@pytest.mark.parametrize("need", [Need.COPY_BESIDE, Need.HOLD, Need.SKIP_PENDING])
def test_a_need_the_lane_cannot_carry_sends_the_transaction_to_the_fast_path(need: Need) -> None:
    assert plan(facts(needs=frozenset({need}))) is Route.FAST
    # The lane's decision is made before its commit LSN is read: the same answer.
    assert plan(facts(None, needs=frozenset({need}))) is Route.FAST
    assert plan(facts(None)) is Route.LANE


def test_a_streamed_transaction_is_applied_early_unless_it_needs_what_that_cannot_carry() -> None:
    assert plan(facts(None, streamed=True, early=True)) is Route.EARLY
    assert plan(facts(None, streamed=True, early=False)) is Route.BUFFERED
    assert plan(facts(None, streamed=True, early=True, needs=frozenset({Need.HOLD}))) is Route.EARLY
    for need in (Need.COPY_BESIDE, Need.SKIP_PENDING):
        assert plan(facts(None, streamed=True, early=True, needs=frozenset({need}))) is Route.BUFFERED
    # At its commit: a redone stretch takes it back to the buffered replay, row by row.
    assert plan(facts(450, streamed=True, early=True, careful_until=LSN(450))) is Route.BUFFERED
    assert plan(facts(451, streamed=True, early=True, careful_until=LSN(450))) is Route.EARLY


def test_changing_one_row_of_the_capability_table_reroutes(monkeypatch: pytest.MonkeyPatch) -> None:
    copying = facts(needs=frozenset({Need.COPY_BESIDE}))
    assert plan(copying) is Route.FAST
    monkeypatch.setitem(plan_module.CARRIES, Route.LANE, frozenset({Need.COPY_BESIDE}))
    assert plan(copying) is Route.LANE
    monkeypatch.setitem(plan_module.CARRIES, Route.FAST, frozenset())
    assert plan(facts(lane=False, needs=frozenset({Need.HOLD}))) is Route.CAREFUL


def test_the_fast_and_careful_paths_carry_every_need() -> None:
    for route in (Route.FAST, Route.CAREFUL, Route.BUFFERED):
        assert carries(route, frozenset(Need))
    assert set(CARRIES) == {Route.LANE, Route.FAST, Route.CAREFUL, Route.EARLY, Route.BUFFERED}
