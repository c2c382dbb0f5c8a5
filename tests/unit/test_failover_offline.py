"""Failover of the source without a server (issue 41): the check of a source server against the
target's records, when a new slot is a failover slot, multi-host connection strings, and what
status says of standbys."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

from applier.cli import parse_settings
from applier.config import load_settings
from applier.connections import with_liveness
from applier.ops.failover import PrimaryFacts, StandbyFacts, assess, render_failover
from applier.progress.records import AppliedPosition, SourceIdentity
from applier.protocol.lsn import LSN
from applier.source.lineage import LineageError, SourceLineage, check_lineage, parse_history
from applier.source.options import UnsupportedOption
from applier.source.slots import SlotInfo, failover_slot

SYSTEM = "7413181224790767404"
HISTORY = ("1\t0/3003678\tno recovery target specified\n"
           "\n"
           "2\t0/5000100\tno recovery target specified\n")


def _slot(synced: bool | None = True, failover: bool | None = True,
          confirmed: str = "0/6000000") -> SlotInfo:
    return SlotInfo("s", "pgoutput", "app", False, None, LSN.parse(confirmed), LSN.parse("0/5000000"),
                    failover=failover, synced=synced)


def _lineage(timeline: int = 3, system: str = SYSTEM, slot: SlotInfo | None = None) -> SourceLineage:
    ended = {k: v for k, v in parse_history(HISTORY).items() if k < timeline}
    return SourceLineage(system, timeline, LSN.parse("0/7000000"), ended, slot or _slot())


def _applied(end: str) -> AppliedPosition:
    return AppliedPosition(LSN(int(LSN.parse(end)) - 40), LSN.parse(end))


def test_a_timeline_history_names_where_each_earlier_timeline_ended() -> None:
    assert parse_history(HISTORY) == {1: LSN.parse("0/3003678"), 2: LSN.parse("0/5000100")}
    assert parse_history("# comment\n") == {}


def test_nothing_to_compare_or_the_same_server_goes_on_quietly() -> None:
    assert check_lineage("s", _lineage(), None, _applied("0/6000000")) is None
    assert check_lineage("s", _lineage(), SourceIdentity(SYSTEM, 3), _applied("0/6500000")) is None


def test_a_failover_the_target_is_not_past_is_followed() -> None:
    note = check_lineage("s", _lineage(), SourceIdentity(SYSTEM, 2), _applied("0/5000100"))
    assert note is not None and "left timeline 2 at 0/5000100" in note
    # Two failovers since the record: timeline 1 ended at 0/3003678 in the history of 3.
    assert check_lineage("s", _lineage(), SourceIdentity(SYSTEM, 1), _applied("0/3000000"))
    assert check_lineage("s", _lineage(), SourceIdentity(SYSTEM, 1), None)  # nothing applied


def test_a_target_past_the_switch_point_is_refused_naming_the_positions() -> None:
    with pytest.raises(LineageError) as refused:
        check_lineage("s", _lineage(), SourceIdentity(SYSTEM, 2), _applied("0/5000200"))
    text = str(refused.value)
    assert "up to 0/5000200" in text and "left timeline 2 at 0/5000100" in text
    assert "256 bytes" in text and "never had" in text and "Nothing was applied" in text
    assert "synchronized_standby_slots" in text


def test_another_server_an_older_timeline_or_another_branch_is_refused() -> None:
    with pytest.raises(LineageError, match="system identifier 1234"):
        check_lineage("s", _lineage(), SourceIdentity("1234", 3), None)
    # An old primary that came back: the target followed timeline 3, the server is on 2.
    with pytest.raises(LineageError, match="does not have timeline 3"):
        check_lineage("s", _lineage(timeline=2), SourceIdentity(SYSTEM, 3), _applied("0/3000000"))
    with pytest.raises(LineageError, match="does not have timeline 7"):
        check_lineage("s", _lineage(), SourceIdentity(SYSTEM, 7), None)


def test_after_a_failover_a_slot_made_on_the_new_primary_is_refused() -> None:
    made_there = _lineage(slot=_slot(synced=False))
    with pytest.raises(LineageError, match="not a synchronised copy"):
        check_lineage("s", made_there, SourceIdentity(SYSTEM, 2), _applied("0/5000000"))
    # Before 17 the view has no synced column: nothing to tell by.
    assert check_lineage("s", _lineage(slot=_slot(synced=None, failover=None)),
                         SourceIdentity(SYSTEM, 2), _applied("0/5000000"))


@pytest.mark.parametrize("version, requested, two_phase, expected", [
    (150004, None, False, False), (160002, False, False, False),
    (170000, None, False, True), (170000, None, True, False), (170000, False, False, False),
    (180006, None, True, True), (180006, False, True, False), (180006, True, False, True),
])
def test_a_new_slot_is_a_failover_slot_where_the_source_supports_it(
        version: int, requested: bool | None, two_phase: bool, expected: bool) -> None:
    assert failover_slot(requested, version, two_phase) is expected


def test_asking_for_a_failover_slot_the_source_cannot_have_is_an_error() -> None:
    with pytest.raises(UnsupportedOption, match="PostgreSQL 17 or later.*runs PostgreSQL 15"):
        failover_slot(True, 150004, False)
    with pytest.raises(UnsupportedOption, match="--two-phase needs PostgreSQL 18"):
        failover_slot(True, 170002, True)


def test_several_hosts_reach_the_primary_and_keep_every_host() -> None:
    params = conninfo_to_dict(with_liveness("host=a,b port=5432,5433 dbname=app"))
    assert (params["host"], params["port"]) == ("a,b", "5432,5433")
    assert params["target_session_attrs"] == "read-write"
    url = conninfo_to_dict(with_liveness("postgresql://u@a:1,b:2/app?target_session_attrs=primary"))
    assert (url["host"], url["port"], url["target_session_attrs"]) == ("a,b", "1,2", "primary")
    single = conninfo_to_dict(with_liveness("host=a dbname=app"))
    assert "target_session_attrs" not in single and single["connect_timeout"] == "10"


def test_standbys_are_connection_strings_never_cut_at_commas() -> None:
    settings = parse_settings(["status", "--source", "s", "--target", "t", "--slot", "x",
                               "--standby", "host=a,b port=1,2", "--standby", "host=c"], {})
    assert settings.standby == ["host=a,b port=1,2", "host=c"]
    assert load_settings("status", {}, None, {"APPLIER_STANDBY": "host=a,b"}).standby == ["host=a,b"]
    assert parse_settings(["run", "--no-failover-slot"], {}).failover_slot is False
    assert parse_settings(["sync"], {}).failover_slot is None
    masked = load_settings("status", {"standby": ["postgresql://u:secret@h/db"]}, None, {}).describe()
    assert masked["standby"] == ["postgresql://u:****@h/db"]


_PRIMARY = PrimaryFacts(180006, SYSTEM, ["standby_b"], ["standby_b", "standby_c"], ["standby_b"], True)
_GOOD_SETTINGS = {"wal_level": "logical", "sync_replication_slots": "on", "hot_standby_feedback": "on",
                  "primary_slot_name": "standby_b", "primary_conninfo": "host=a dbname=postgres"}
_COPY = {"synced": True, "temporary": False, "invalidation_reason": None,
         "confirmed_flush_lsn": LSN.parse("0/5FFFF00"), "failover": True}


def _standby(settings: dict | None = None, copy: dict | None = _COPY, **facts) -> StandbyFacts:
    values = {"version": 180006, "in_recovery": True, "system_identifier": SYSTEM,
              "settings": settings if settings is not None else _GOOD_SETTINGS,
              "replay_lsn": LSN.parse("0/6FFFF00"), "copy": copy, **facts}
    return StandbyFacts(**values)


def test_a_standby_with_a_persistent_copy_is_ready_and_says_how_far_behind() -> None:
    report = assess("s", _slot(), _PRIMARY, LSN.parse("0/7000000"), [("b:5433", _standby())])
    (standby,) = report.standbys
    assert standby.ready and report.ready and standby.problems == []
    assert (standby.behind_bytes, standby.replay_behind_bytes) == (256, 256)
    rows = dict(render_failover(report))
    assert rows["failover slot"] == "yes" and rows["synchronized_standby_slots"] == "standby_b"
    assert rows["standby b:5433"].startswith("ready: copy synchronised")


@pytest.mark.parametrize("settings, copy, expected", [
    ({**_GOOD_SETTINGS, "sync_replication_slots": "off"}, _COPY,
     "ALTER SYSTEM SET sync_replication_slots = on"),
    ({**_GOOD_SETTINGS, "hot_standby_feedback": "off"}, _COPY, "ALTER SYSTEM SET hot_standby_feedback = on"),
    ({**_GOOD_SETTINGS, "wal_level": "replica"}, _COPY, "wal_level = logical, then a restart"),
    ({**_GOOD_SETTINGS, "primary_slot_name": ""}, _COPY, "primary_slot_name is empty"),
    ({**_GOOD_SETTINGS, "primary_slot_name": "nope"}, _COPY, "pg_create_physical_replication_slot('nope')"),
    ({**_GOOD_SETTINGS, "primary_slot_name": "standby_c"}, _COPY,
     "synchronized_standby_slots = 'standby_b, standby_c'"),
    ({**_GOOD_SETTINGS, "primary_conninfo": "host=a"}, _COPY, "names no dbname"),
    ({k: v for k, v in _GOOD_SETTINGS.items() if k != "primary_conninfo"}, _COPY, "cannot be read"),
    (_GOOD_SETTINGS, None, "holds no copy of slot 's'"),
    (_GOOD_SETTINGS, {**_COPY, "temporary": True}, "not usable yet"),
    (_GOOD_SETTINGS, {**_COPY, "invalidation_reason": "rows_removed"}, "invalidated (rows_removed)"),
    (_GOOD_SETTINGS, {**_COPY, "synced": False}, "created on the standby"),
])
def test_what_keeps_a_standby_from_taking_over_is_said_as_what_to_change(settings, copy, expected) -> None:
    report = assess("s", _slot(), _PRIMARY, LSN.parse("0/7000000"), [("b:5433", _standby(settings, copy))])
    assert not report.ready
    assert any(expected in problem for problem in report.standbys[0].problems), report.standbys[0].problems


def test_not_a_standby_of_this_source_or_unreachable() -> None:
    for facts, expected in ((_standby(in_recovery=False), "not in recovery"),
                            (_standby(system_identifier="42"), "standby of another server"),
                            ("cannot read the standby b:5433: refused", "refused")):
        report = assess("s", _slot(), _PRIMARY, LSN.parse("0/7000000"), [("b:5433", facts)])
        assert not report.ready and expected in report.standbys[0].problems[0]


def test_the_source_warns_of_what_a_failover_would_lose() -> None:
    unprotected = PrimaryFacts(180006, SYSTEM, [], ["standby_b"], ["standby_b"], True)
    (warning,) = assess("s", _slot(), unprotected, LSN(0), []).warnings
    assert "synchronized_standby_slots is empty" in warning and "= 'standby_b'" in warning
    dangling = PrimaryFacts(180006, SYSTEM, ["gone"], ["standby_b"], ["standby_b"], True)
    warnings = assess("s", _slot(), dangling, LSN(0), []).warnings
    assert any("'gone', which is no physical slot" in w for w in warnings)
    assert any("does not name 'standby_b'" in w for w in warnings)
    report = assess("s", _slot(failover=False), _PRIMARY, LSN(0), [("b:5433", _standby())])
    assert any("ALTER_REPLICATION_SLOT \"s\" (FAILOVER true)" in w for w in report.warnings)
    assert not report.ready  # a standby cannot take over a slot that is not synchronised
    old = assess("s", _slot(failover=None, synced=None), PrimaryFacts(150004, SYSTEM, None, [], [], False),
                 LSN(0), [])
    assert render_failover(old) == [("failover slot", "not supported by the source (PostgreSQL 17+)")]
    assert "PostgreSQL 15, which has no failover slots" in old.warnings[0]
