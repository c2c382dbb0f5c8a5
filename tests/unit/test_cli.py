"""The command line of every command: one loader, one table of exit codes, help that explains."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from applier import __version__, cli, implementation
from applier.cli import COMMANDS, build_parser, main, parse_settings
from applier.config import OPTIONS, options_for
from applier.exit_codes import ExitCode
from applier.implementation import ACCELERATORS, accelerator, pure_python

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
    "sequences": ("margin", "1", "2", "3"),
    "cutover": ("timeout", "1", "2", "3"),
    "drop": ("slot", "f", "e", "c"),
    "resync": ("slot", "f", "e", "c"),
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


# -- exit codes ------------------------------------------------------------------------------------

def test_the_exit_codes() -> None:
    assert [(c.name, c.value) for c in ExitCode] == [
        ("OK", 0), ("FAILED", 1), ("USAGE", 2), ("CHECK", 3), ("INTERRUPTED", 130)]


def _exits(capsys: pytest.CaptureFixture[str], arguments: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stopped:
        main(arguments)
    return stopped.value.code, capsys.readouterr().err  # type: ignore[return-value]


@pytest.mark.parametrize("arguments, message", [
    (["run", "--bogus"], "unrecognized arguments: --bogus"),
    (["run", "--batch-rows", "many"], r"--batch-rows: 'many' is not a whole number \(expected a "
                                      r"whole number, e.g. 20000\)"),
    (["run", "--streaming", "sometimes"], "invalid choice"),
    (["status", "--max-lag", "5"], "--max-lag: lag limit '5' has no unit"),
    (["verify", "--config", "/nonexistent/applier.toml"], "does not exist"),
    (["verify", "--source", "host=s", "--target", "host=t"], "missing required setting.*--publication"),
    (["pipeline", "--target", "host=t"], "missing required setting.*--output"),
    (["demo", "--pg-version", "16"], "invalid choice"),
])
def test_bad_usage_exits_2_with_the_one_line_that_matters(capsys, arguments, message) -> None:
    code, err = _exits(capsys, arguments)
    assert code == ExitCode.USAGE
    first, *rest = err.splitlines()
    assert first.startswith(f"applier {arguments[0]}: error: "), err
    assert re.search(message, first), err
    assert rest == [f"(see applier {arguments[0]} --help for every option)"], err  # no usage block


def test_a_bad_environment_variable_is_named_with_the_form_it_takes(capsys, monkeypatch) -> None:
    monkeypatch.setenv("APPLIER_BATCH_ROWS", "abc")
    code, err = _exits(capsys, ["run"])
    assert code == ExitCode.USAGE
    assert err.splitlines()[0] == ("applier run: error: APPLIER_BATCH_ROWS: 'abc' is not a whole "
                                   "number (expected a whole number, e.g. 20000)"), err


def test_choices_are_taken_in_any_case() -> None:
    assert parse_settings(["run"], {"APPLIER_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    assert parse_settings(["run", "--log-level", "warning"], {}).log_level == "WARNING"
    assert parse_settings(["peek", "--streaming", "Parallel"], {}).streaming == "parallel"


def test_keyboard_interrupt_exits_130(monkeypatch) -> None:
    def interrupted(settings: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_runner", lambda command: interrupted)
    monkeypatch.setattr(cli, "configure_logging", lambda *args: None)  # leave pytest's alone
    assert main(["status"]) == ExitCode.INTERRUPTED


# -- version ---------------------------------------------------------------------------------------

def _version(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("APPLIER_")}
    proc = subprocess.run([sys.executable, "-m", "applier", "--version"], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=clean | env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_version_says_which_implementation_runs() -> None:
    """As psycopg's ``pq.__impl__``: the C accelerators in use, or pure Python and why."""
    if any(accelerator(name) is None for name in ACCELERATORS) and not pure_python():
        pytest.skip("a C accelerator is not built")
    built = ", ".join(ACCELERATORS)
    assert _version() == f"applier {__version__}, C accelerators: {built}\n"
    assert _version(APPLIER_PURE_PYTHON="1") == f"applier {__version__}, pure Python (APPLIER_PURE_PYTHON=1)\n"
    assert _version(APPLIER_PURE_PYTHON="apply._lane").endswith(
        ", sync._relay; pure Python for apply._lane (turned off by APPLIER_PURE_PYTHON)\n")


def test_version_without_built_accelerators_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_built(name: str) -> None:
        raise ImportError(name)

    monkeypatch.delenv("APPLIER_PURE_PYTHON", raising=False)
    monkeypatch.setattr(implementation.importlib, "import_module", not_built)
    assert implementation.summary() == "pure Python (no C accelerator is built)"
    monkeypatch.setenv("APPLIER_PURE_PYTHON", "apply._lane")
    assert implementation.summary() == ("pure Python: protocol._speedups (not built), apply._lane (turned "
                                        "off by APPLIER_PURE_PYTHON), source._frames (not built), "
                                        "sync._relay (not built)")


# -- help ------------------------------------------------------------------------------------------

def _help(*arguments: str) -> str:
    # Wide enough that argparse writes each option's help on one line.
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIER_")} | {"COLUMNS": "400"}
    proc = subprocess.run([sys.executable, "-m", "applier", *arguments, "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_top_level_help_has_the_exit_code_table() -> None:
    text = _help()
    table = text[text.index("exit status:"):]
    for code in ExitCode:
        assert re.search(rf"^\s+{code.value}\s+{code.name}\s+\S", table, re.MULTILINE), table


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_explains_every_option(command: str) -> None:
    text = _help(command)
    assert text.startswith(f"usage: applier {command} ")
    assert "exit status: 0 ok, 1 failed, 2 usage" in " ".join(text.split())
    # Each option: its line, and the help argparse puts on the next one when the flags are long.
    entries = re.findall(r"^  (-.*\n(?:    .*\n)*)", text, re.MULTILINE)
    for option in options_for(command):
        (entry,) = [e for e in entries if re.match(rf"{option.flag}(?![\w-])", e)]
        entry = " ".join(entry.split())
        if option.placeholder:
            assert entry.startswith(f"{option.flag} {option.placeholder}"), entry
        assert option.help[:40] in entry
        assert ("(default: " in entry or re.search(r"\b(Default|Required)\b", entry)), entry


def test_sizes_and_lag_limits_read_as_people_write_them() -> None:
    run = _help("run")
    assert "(default: 64MB)" in run and "(default: 8MB)" in run and "67108864" not in run
    assert "--metrics-address ADDRESS" in run and "--ready-max-lag SIZE|DURATION" in run
    assert "(default: 60s)" in run
    assert "--max-lag SIZE|DURATION" in _help("status")
    assert "(default: 1GB)" in _help("sync")


def test_every_option_has_help_and_a_placeholder() -> None:
    for option in OPTIONS:
        assert option.help.strip(), option.name
        if option.kind not in ("bool", "choice") and not option.choices:
            assert option.placeholder, f"{option.name} needs a metavar"


def test_run_does_not_import_other_commands() -> None:
    code = ("import sys; from applier.cli import _parse, _runner; _runner(_parse(['run'], {})[1].command); "
            "print(sorted(m for m in sys.modules if m.startswith(('applier.spark', 'applier.demo', "
            "'applier.verify', 'pyspark'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_run_loads_neither_sqlalchemy_nor_alembic() -> None:
    """They cost a third of a second each at every start: the worker's path (head start and
    worker) must not import them; only a schema to create or upgrade, or a table to copy, does."""
    code = ("import sys; import applier.cli, applier.headstart, applier.worker; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'alembic')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_pipeline_module_runs_as_the_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "applier.spark.pipeline", "--help"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: applier pipeline "), proc.stderr


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
