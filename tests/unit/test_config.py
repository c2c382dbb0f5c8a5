"""Settings resolution: command line > environment > file > defaults; validation; masking."""

from __future__ import annotations

from pathlib import Path

import pytest

from applier.config import ConfigError, OPTIONS, example_config, load_settings, mask_dsn, parse_size

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
