"""The Dockerfile and the wheel it installs (no Docker engine here: the Dockerfile is parsed)."""

from __future__ import annotations

import configparser
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions (keyword, arguments) per stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        stages[-1].append((keyword.upper(), args.strip()))
    return stages


def test_dockerfile_is_multi_stage_non_root_with_entrypoint_and_health_check() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "build tools must stay in a separate build stage"
    build, final = stages[0], stages[-1]
    build_text = " ".join(args for _, args in build)
    final_text = " ".join(args for _, args in final)
    assert "gcc" in build_text, "the build stage compiles the decoder accelerator"
    assert re.search(r"pip wheel [^&]*--wheel-dir /wheels \.(\s|$)", build_text), \
        "the build stage must build the wheel of this repository"
    assert not re.search(r"\b(gcc|cc|make|build-essential|libc6-dev)\b", final_text), final_text
    assert ("COPY", "--from=build /wheels /wheels") in final
    assert re.search(r"pip install .*--no-index --find-links /wheels applier", final_text)
    users = [args for keyword, args in final if keyword == "USER"]
    assert users and users[-1] not in ("root", "0"), "the final image must not run as root"
    entrypoint = [args for keyword, args in final if keyword == "ENTRYPOINT"]
    assert entrypoint and json.loads(entrypoint[-1]) == ["applier"]
    health = [args for keyword, args in final if keyword == "HEALTHCHECK"]
    assert health and "applier.ops.healthcheck" in health[-1]
    env = " ".join(args for keyword, args in final if keyword == "ENV")
    port = re.search(r"APPLIER_METRICS_PORT=(\d+)", env)
    assert port and ("EXPOSE", port.group(1)) in final, "the health check's port must be exposed"
    # The build stage copies everything the wheel is built from.
    copied = " ".join(args for keyword, args in build if keyword == "COPY")
    for needed in ("pyproject.toml", "setup.py", "applier", "migrations"):
        assert needed in copied


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                           "--wheel-dir", str(out), str(REPO)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("applier-*.whl")
    return built


@pytest.mark.slow  # pip builds the wheel, C accelerators included
def test_wheel_has_the_entry_point_and_the_migrations(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(archive.read(entry_points).decode())
    assert parser["console_scripts"]["applier"].strip() == "applier.cli:main"
    migrations = {n for n in names if n.startswith("applier/_migrations/")}
    assert {"applier/_migrations/env.py", "applier/_migrations/script.py.mako"} <= migrations
    shipped = {Path(n).name for n in migrations if n.startswith("applier/_migrations/versions/")}
    expected = {p.name for p in (REPO / "migrations" / "versions").glob("*.py")}
    assert expected <= shipped, f"migrations missing from the wheel: {expected - shipped}"
    assert "applier/ops/healthcheck.py" in names  # what the HEALTHCHECK runs


def test_the_schema_head_constant_is_alembics_head() -> None:
    """upgrade_schema skips alembic when the target is at SCHEMA_HEAD: it must be the newest."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from applier.progress.schema import MIGRATIONS_DIR, SCHEMA_HEAD

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    assert ScriptDirectory.from_config(config).get_heads() == [SCHEMA_HEAD]


def test_the_spark_readers_are_exported_at_the_top_and_loaded_on_first_use() -> None:
    """``from applier.spark import read_table, ...`` works, as PySpark's own exports do, while
    ``import applier.spark`` (verify imports it) loads neither PySpark nor the readers."""
    pytest.importorskip("pyspark.sql.datasource")  # the [spark] extra (./dev test installs it)
    code = ("import sys, applier.spark as s; "
            "assert 'pyspark' not in sys.modules and 'applier.spark.stream' not in sys.modules; "
            "from applier.spark import open_snapshot, read_change_stream, read_changes, read_table; "
            "from applier.spark.reader import read_table as r; from applier.spark.stream import "
            "read_change_stream as st; assert read_table is r and read_change_stream is st; "
            "assert set(s.__all__) >= {'open_snapshot', 'read_change_stream', 'read_changes', "
            "'read_table'}; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
