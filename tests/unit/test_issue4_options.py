"""Options and pure rules of two-phase, origins, messages, conflicts and skipping (no server)."""

from __future__ import annotations

import pytest

from applier.apply.origins import default_origin_name
from applier.apply.twophase import GID_MAX_BYTES, resolve_mode, target_gid
from applier.cli import build_parser
from applier.config import ConfigError, load_settings, parse_conflict_policies, parse_table_name
from applier.protocol import LSN


def test_conflict_policies_default_and_per_table() -> None:
    default, tables = parse_conflict_policies(
        ["error", "orders=keep-local", 'Sales."Big Table"=apply', '"MiXed".x=ERROR'])
    assert default == "error"
    assert tables == {("public", "orders"): "keep-local", ("sales", "Big Table"): "apply",
                      ("MiXed", "x"): "error"}
    assert parse_conflict_policies([]) == ("apply", {})


@pytest.mark.parametrize("entry, message", [
    ("ignore", "not one of apply, error, keep-local"),
    ("t=upsert", "not one of"),
    ("a.b.c=apply", "not a table name"),
    ('"open=apply', "not a table name"),
])
def test_bad_conflict_policies_are_named(entry: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings("run", {"conflict_policy": [entry]}, None, {})


def test_table_names() -> None:
    assert parse_table_name("t") == ("public", "t")
    assert parse_table_name('"a""b".C') == ('a"b', "c")
    assert parse_table_name('s."x.y"') == ("s", "x.y")


def test_repeatable_options_from_the_command_line_and_environment() -> None:
    args = build_parser().parse_args([
        "run", "--skip-origin", "a,b", "--skip-origin", "c", "--conflict-policy", "error",
        "--conflict-policy", "t=apply", "--message-prefix", "app*", "--skip-lsn", "16/B374D848"])
    values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    settings = load_settings("run", values, None, {"APPLIER_MESSAGE_PREFIX": "x,y"})
    assert settings.skip_origin == ["a,b", "c"]  # a name may contain a comma on the command line
    assert settings.conflict_policy == ["error", "t=apply"]
    assert settings.message_prefix == ["app*"]
    assert settings.skip_lsn == LSN.parse("16/B374D848")
    assert load_settings("run", {}, None, {"APPLIER_SKIP_ORIGIN": "a, b"}).skip_origin == ["a", "b"]
    assert load_settings("run", {}, None, {}).two_phase_mode == "auto"
    with pytest.raises(ConfigError, match="invalid LSN"):
        load_settings("skip", {"lsn": "12345"}, None, {})


@pytest.mark.parametrize("flags, value", [
    ([], None), (["--binary", "auto"], "auto"), (["--binary", "off"], "off"),
    (["--binary"], "on"), (["--no-binary"], "off"),  # the flags of the boolean it once was
])
def test_binary_on_the_command_line(flags: list[str], value: str | None) -> None:
    args = build_parser().parse_args(["run", *flags])
    assert args.binary == value


def test_skip_and_status_commands_have_their_options() -> None:
    args = build_parser().parse_args(["skip", "--target", "t", "--slot", "s", "--lsn", "0/1"])
    assert (args.command, args.lsn) == ("skip", "0/1")
    args = build_parser().parse_args(["status", "--target", "t", "--slot", "s", "--json"])
    assert (args.command, args.json) == ("status", True)


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


def test_origin_name_names_slot_and_database() -> None:
    assert default_origin_name("s", "app") == "applier_s_app"


def test_message_prefix_filter() -> None:
    from applier.apply.messages import MessageSink
    from applier.progress.memory import MemoryStore
    from applier.protocol.messages import Message

    def msg(prefix: str) -> Message:
        return Message(None, 1, LSN(1), prefix, b"")

    sink = MessageSink(MemoryStore("s"), "log", ["app.*", "ops"])
    assert [sink.wants(msg(p)) for p in ("app.audit", "app", "ops", "opsx")] == [
        True, False, True, False]
    assert MessageSink(MemoryStore("s"), "log").wants(msg("anything"))


def test_sync_takes_every_apply_option_of_run() -> None:
    """applier sync continues as run, so the apply options of run are its options too."""
    args = build_parser().parse_args([
        "sync", "--source", "s", "--target", "t", "--slot", "x", "--publication", "p",
        "--two-phase-mode", "defer", "--skip-origin", "a", "--replication-origin", "none",
        "--message-sink", "log", "--message-prefix", "app*", "--conflict-policy", "error",
        "--skip-lsn", "0/10"])
    assert (args.command, args.two_phase_mode, args.message_sink, args.skip_lsn) == (
        "sync", "defer", "log", "0/10")
    assert (args.skip_origin, args.conflict_policy) == (["a"], ["error"])
