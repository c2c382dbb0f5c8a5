"""Settings resolution: command line > environment > file > defaults; validation; masking."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from pathlib import Path

import pytest

from applier.cli import build_parser
from applier.config import (
    OPTIONS,
    ConfigError,
    Settings,
    example_config,
    load_settings,
    mask_dsn,
    options_for,
    parse_conflict_policies,
    parse_size,
    parse_table_name,
)
from applier.protocol import LSN
from applier.units import format_size

REPO = Path(__file__).resolve().parents[2]


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    config = tmp_path / "applier.toml"
    config.write_text('slot = "from_file"\npublication = ["a", "b"]\nmemory-budget = "2MB"\n'
                      'status_interval = 5\n')
    env = {"APPLIER_SLOT": "from_env", "APPLIER_STATUS_INTERVAL": "7"}
    settings = load_settings("run", {"status_interval": "3"}, config, env)
    assert settings.slot == "from_env"
    assert settings.publication == ["a", "b"]
    assert settings.memory_budget == 2 * 1024**2
    assert settings.status_interval == 3
    assert settings.sources["slot"] == "env" and settings.sources["status_interval"] == "cli"
    assert settings.sources["memory_budget"] == "file" and settings.sources["binary"] == "default"


def test_config_file_from_environment_and_unknown_keys(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('slot = "x"\nbogus = 1\n')
    with pytest.raises(ConfigError, match="unknown setting.*bogus"):
        load_settings("run", {}, None, {"APPLIER_CONFIG": str(config)})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings("run", {}, tmp_path / "missing.toml", {})
    config.write_text("slot = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings("run", {}, config, {})


@pytest.mark.parametrize("values, message", [
    ({"proto_version": "5"}, "not a pgoutput protocol version"),
    ({"proto_version": "1", "streaming": "on"}, "streaming needs protocol version 2"),
    ({"proto_version": "3", "streaming": "parallel"}, "parallel needs protocol version 4"),
    ({"proto_version": "2", "two_phase": True}, "two_phase needs protocol version 3"),
    ({"streaming": "sometimes"}, "not one of off, on, parallel"),
    ({"memory_budget": "lots"}, "invalid size"),
    ({"memory_budget": "1kB"}, "at least 64kB"),
    ({"status_interval": "60"}, "between 1 and 10"),
    ({"messages": "maybe"}, "invalid boolean"),
    ({"binary": "maybe"}, "not one of auto, on, off"),
])
def test_bad_values_are_named(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings("run", values, None, {})


def test_binary_takes_its_choices_and_the_booleans_it_once_took() -> None:
    assert load_settings("run", {}, None, {}).binary == "auto"
    assert load_settings("run", {"binary": True}, None, {}).binary == "on"
    assert load_settings("run", {}, None, {"APPLIER_BINARY": "false"}).binary == "off"
    assert load_settings("run", {"binary": "auto"}, None, {}).binary == "auto"


def test_required_settings_say_where_to_set_them() -> None:
    settings = load_settings("run", {}, None, {})
    with pytest.raises(ConfigError, match="--source .or APPLIER_SOURCE"):
        settings.require("source", "target")


def test_sizes() -> None:
    assert parse_size("64MB") == 64 * 1024**2
    assert parse_size("512kB") == 512 * 1024
    assert parse_size("1GiB") == 1024**3
    assert parse_size("100") == 100
    assert [format_size(n) for n in (64 * 1024**2, 1024**3, 8192, 1000, 1536 * 1024)] == [
        "64MB", "1GB", "8kB", "1000B", "1536kB"]
    assert all(parse_size(format_size(n)) == n for n in (1, 4096, 1024**4, 3 * 1024**2 + 1))


def test_passwords_are_masked_in_both_dsn_forms() -> None:
    assert mask_dsn("postgresql://u:s3cret@h:5432/db") == "postgresql://u:****@h:5432/db"
    assert "s3cret" not in mask_dsn("host=h password=s3cret user=u")
    assert "s3 cret" not in mask_dsn("host=h password='s3 cret' user=u")
    settings = load_settings("run", {"source": "host=h password=hunter2"}, None, {})
    assert "hunter2" not in repr(settings.describe())


def test_example_config_is_current_and_complete() -> None:
    text = (REPO / "config" / "applier.example.toml").read_text()
    assert text.rstrip("\n") == example_config().rstrip("\n"), (
        "regenerate: python -c 'from applier.config import example_config; print(example_config())' "
        "> config/applier.example.toml")
    for option in OPTIONS:
        assert f"# {option.name} = " in text


# -- the Settings dataclass and the option table agree ---------------------------------------------

_OWN_FIELDS = {"command", "sources"}
HINTS = typing.get_type_hints(Settings)


def conforms(value: object, hint: object) -> bool:
    """Whether ``value`` has the type ``hint`` describes (the hints Settings uses)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(conforms(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint in (int, float) and isinstance(value, bool):
        return False  # a bool is an int to isinstance, never to a setting
    assert isinstance(hint, type), hint
    return isinstance(value, hint)


def test_settings_has_one_field_per_option_name() -> None:
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert fields - _OWN_FIELDS == {option.name for option in OPTIONS}
    assert not {"values", "require", "describe"} & {option.name for option in OPTIONS}


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: f"{o.name}:{o.commands[0]}")
def test_every_default_type_checks_against_its_field(option) -> None:
    hint = HINTS[option.name]
    assert conforms(option.default, hint), f"{option.name}: default {option.default!r} is not {hint}"
    if option.kind == "choice":  # the field's Literal names exactly the choices
        literal = next(a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal) \
            if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
        assert typing.get_args(literal) == option.choices


def test_example_values_type_check_against_their_fields() -> None:
    """Every option's example in the config file converts to a value of the field's type."""
    examples = re.findall(r"^# commands: .*\n# (\w+) = (.*)$", example_config(), re.MULTILINE)
    assert [name for name, _ in examples] == [option.name for option in OPTIONS]
    for option, (_, literal) in zip(OPTIONS, examples):
        value = option.convert(tomllib.loads(f"x = {literal}")["x"])
        assert conforms(value, HINTS[option.name]), (option.name, value)


def test_entries_of_one_name_share_a_field_and_split_the_commands() -> None:
    for name in {option.name for option in OPTIONS}:
        entries = [option for option in OPTIONS if option.name == name]
        assert len({(o.kind, o.secret) for o in entries}) == 1, name
        commands = [c for o in entries for c in o.commands]
        assert len(commands) == len(set(commands)), f"{name}: a command has two entries"


def test_settings_are_frozen_and_fully_typed_for_every_command() -> None:
    for command in ("run", "sync", "peek", "status", "skip", "verify", "pipeline", "demo"):
        settings = load_settings(command, {}, None, {})
        assert set(settings.sources) == {o.name for o in options_for(command)}
        for field in dataclasses.fields(Settings):
            if field.name not in _OWN_FIELDS:
                assert conforms(getattr(settings, field.name), HINTS[field.name]), field.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.slot = "x"  # type: ignore[misc]


def test_defaults_come_from_the_table_per_command() -> None:
    assert load_settings("run", {}, None, {}).log_level == "INFO"
    assert load_settings("verify", {}, None, {}).log_level == "WARNING"
    assert load_settings("verify", {}, None, {}).table == []
    assert load_settings("pipeline", {}, None, {}).table == ["orders"]
    assert load_settings("pipeline", {"every": "5min"}, None, {}).every == 300.0
    assert load_settings("pipeline", {}, None, {}).every is None  # one round
    assert load_settings("run", {}, None, {}).ready_max_lag.seconds == 60
    assert load_settings("sync", {}, None, {}).create_slot is False  # sync goes on as run
    first, second = load_settings("run", {}, None, {}), load_settings("run", {}, None, {})
    assert first.publication is not second.publication  # no list shared between settings


@pytest.mark.parametrize("command, values, message", [
    ("pipeline", {"table": "a,b"}, "pipeline aggregates one table, not 2"),
    ("pipeline", {"every": "0s"}, "every must be a positive duration"),
    ("pipeline", {"every": "soon"}, "--every: invalid duration"),
    ("pipeline", {"rounds": "0"}, "rounds must be at least 1"),
    ("run", {"batch_rows": "-1"}, "batch_rows must be at least 1, or 0 to turn fast apply off"),
    ("demo", {"pg_version": "16"}, "--pg-version: 16 is not one of 15, 18"),
    ("verify", {"settle": "soon"}, r"--settle: 'soon' is not a number \(expected a number, e.g. 10\)"),
    ("verify", {"max_keys": "-1"}, "max_keys must not be negative"),
    ("status", {"max_lag": "5"}, "--max-lag: lag limit '5' has no unit"),
])
def test_bad_values_of_every_command_are_named(command: str, values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(command, values, None, {})


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
