"""The command line of every command: one loader, whichever the command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from applier.cli import COMMANDS, parse_settings
from applier.config import options_for

REPO = Path(__file__).resolve().parents[2]

#: One option per command, and its value from the file, the environment and the command line.
PRECEDENCE = {
    "run": ("batch_rows", "1", "2", "3"),
    "sync": ("jobs", "1", "2", "3"),
    "peek": ("timeout", "1", "2", "3"),
    "status": ("max_lag", "1MB", "2MB", "3MB"),
    "skip": ("slot", "f", "e", "c"),
    "verify": ("settle", "1.5", "0", "2.5"),
    "pipeline": ("group_by", "f", "e", "c"),
    "demo": ("seconds", "1", "2", "3"),
}


def test_every_command_is_covered() -> None:
    assert set(PRECEDENCE) == set(COMMANDS)


@pytest.mark.parametrize("command", PRECEDENCE)
def test_flags_beat_environment_beat_file_for_every_command(command: str, tmp_path: Path) -> None:
    name, in_file, in_env, on_line = PRECEDENCE[command]
    config = tmp_path / "applier.toml"
    config.write_text(f'{name} = "{in_file}"\n')
    flag = "--" + name.replace("_", "-")
    env = {"APPLIER_" + name.upper(): in_env}

    def value(settings: object) -> str:
        found = getattr(settings, name)
        return found.text if name == "max_lag" else str(found)

    def loaded(arguments: list[str], environ: dict[str, str]) -> tuple[str, str]:
        settings = parse_settings([command, *arguments], environ)
        return value(settings), settings.sources[name]

    assert loaded(["--config", str(config)], {}) == (str(_typed(command, name, in_file)), "file")
    assert loaded([], {"APPLIER_CONFIG": str(config)})[1] == "file"
    assert loaded(["--config", str(config)], env) == (str(_typed(command, name, in_env)), "env")
    assert loaded(["--config", str(config), flag, on_line], env) == (
        str(_typed(command, name, on_line)), "cli")


def _typed(command: str, name: str, raw: str) -> object:
    (option,) = [o for o in options_for(command) if o.name == name]
    value = option.convert(raw)
    return value.text if name == "max_lag" else value


def test_verify_reads_the_environment_like_every_command() -> None:
    settings = parse_settings(["verify"], {"APPLIER_SETTLE": "0", "APPLIER_SOURCE": "host=s",
                                           "APPLIER_PUBLICATION": "a,b", "APPLIER_JSON": "true"})
    assert (settings.settle, settings.source, settings.publication, settings.json) == (
        0.0, "host=s", ["a", "b"], True)
    assert parse_settings(["verify", "--table", "x", "--table", "y"], {}).table == ["x", "y"]
    assert parse_settings(["demo", "--pg-version", "15", "--keep"], {}).pg_version == 15


def test_run_does_not_import_other_commands() -> None:
    code = ("import sys; from applier.cli import _parse, _runner; _runner(_parse(['run'], {})[1].command); "
            "print(sorted(m for m in sys.modules if m.startswith(('applier.spark', 'applier.demo', "
            "'applier.verify', 'pyspark'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_pipeline_module_runs_as_the_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "applier.spark.pipeline", "--help"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: applier pipeline "), proc.stderr
