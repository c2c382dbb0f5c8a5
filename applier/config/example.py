"""The fully commented example config file (config/applier.example.toml), generated from the
option table. Must never hold an option's default or help of its own.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from ..ops.lag import LagLimit
from ..units import format_duration, format_size
from .option import Option
from .options import OPTIONS

__all__ = ["example_config"]


def example_config() -> str:
    """The fully commented example config file (config/applier.example.toml is this text)."""
    lines = ["# applier configuration file (TOML). Every key is optional here and may instead come",
             "# from the command line (--kebab-case) or the environment (APPLIER_UPPER_CASE);",
             "# the command line beats the environment, which beats this file.",
             "# Generated from applier/config/options.py; a test checks that it is current.", ""]
    for option in OPTIONS:
        lines.extend("# " + line for line in textwrap.wrap(option.help, 94))
        lines.append(f"# commands: {', '.join(option.commands)}; environment: {option.env}")
        lines.append(f"# {option.name} = {_toml_example(option)}")
        lines.append("")
    return "\n".join(lines)


#: Example values for options whose default shows nothing useful.
_SAMPLES: dict[str, Any] = {
    "source": "host=source.example port=5432 dbname=app user=replicator sslmode=verify-full",
    "target": "postgresql://applier@replica.example:5432/app?sslmode=verify-full",
    "slot": "applier_app", "publication": ["app_pub"], "spill_dir": "/var/lib/applier/spill",
    "skip_lsn": "16/B374D848", "lsn": "16/B374D848", "metrics_port": 9188, "max_lag": "64MB",
    "master": "spark://spark.example:7077", "jdbc_jar": "/usr/share/java/postgresql.jar",
    "output": "/var/lib/applier/pipeline", "change_feed": ["public.orders", "public.customers"],
    "every": "5min", "standby": ["host=standby.example port=5432 dbname=app user=replicator"],
}
_KIND_SAMPLES: dict[str, Any] = {"bool": True, "int": 4, "str": ""}


def _toml_example(option: Option) -> str:
    value = _SAMPLES.get(option.name, option.default)
    if value is None:
        value = option.choices[0] if option.choices else _KIND_SAMPLES[option.kind]
    if option.kind == "size" and isinstance(value, int):
        value = format_size(value)
    elif option.kind == "duration" and isinstance(value, float):
        value = format_duration(value)
    elif isinstance(value, (LagLimit, Path)):
        value = str(value.text if isinstance(value, LagLimit) else value)
    return json.dumps(value)  # the JSON of a string, number, boolean or list is TOML too
