"""``./dev``, the one entry point on a fresh machine: its help (which needs no set-up)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _dev(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(REPO / "dev"), *args], capture_output=True, text=True, timeout=30,
                          cwd=REPO)


def test_help_is_the_header_comment_and_nothing_else() -> None:
    for args in ((), ("help",)):
        done = _dev(*args)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith("applier's one entry point")
        commands = [line.split()[1] for line in lines[1:] if line.split()[0] == "./dev"]
        assert commands == ["demo", "test", "test", "test", "lint", "soak", "setup"], done.stdout
        assert "./dev test --quick" in done.stdout and "./dev test --pure" in done.stdout
        assert "set -euo" not in done.stdout


def test_an_unknown_command_prints_the_help_and_fails() -> None:
    done = _dev("no-such-command")
    assert done.returncode == 2
    assert "./dev setup" in done.stdout and "set -euo" not in done.stdout


def test_soak_refuses_an_unknown_option_before_any_set_up() -> None:
    done = _dev("soak", "--hours", "2")
    assert done.returncode == 2
    assert "./dev soak takes --minutes N and --seed S, not --hours" in done.stderr
