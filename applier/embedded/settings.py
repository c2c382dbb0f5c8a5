"""postgresql.conf settings of a scratch server: the standard values, and their text.

Owns: the settings every scratch server starts with (a logical-replication source; a target is
the same, so it can be one too), overriding and merging them, and writing them as ``-c`` command
line arguments or postgresql.conf lines. Must never start, stop or connect to a server, and never
write a parameter name that is not a plain configuration name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["ServerSettings", "conf_value"]


@dataclass(frozen=True)
class ServerSettings:
    """postgresql.conf settings; ``values`` maps parameter name to value."""

    values: Mapping[str, str] = field(default_factory=dict)

    @staticmethod
    def source(**overrides: object) -> ServerSettings:
        """Settings for a logical-replication source (streaming above 64kB)."""
        base: dict[str, str] = {
            "wal_level": "logical",
            "max_wal_senders": "20",
            "max_replication_slots": "20",
            "max_prepared_transactions": "20",
            "logical_decoding_work_mem": "64kB",
            "track_commit_timestamp": "on",
            "fsync": "off",
            "full_page_writes": "off",
            "max_connections": "100",
            "shared_buffers": "64MB",
        }
        base.update({k: _conf_str(v) for k, v in overrides.items()})
        return ServerSettings(base)

    @staticmethod
    def target(**overrides: object) -> ServerSettings:
        """Settings for a target; identical to a source so it can be one too."""
        return ServerSettings.source(**overrides)

    @staticmethod
    def of(settings: ServerSettings | Mapping[str, object] | None) -> ServerSettings:
        """``settings`` as given to a backend: None means the source settings; a mapping's
        values are written as postgresql.conf wants them."""
        if settings is None:
            return ServerSettings.source()
        if isinstance(settings, ServerSettings):
            return settings
        return ServerSettings({k: _conf_str(v) for k, v in settings.items()})

    def merged(self, other: Mapping[str, object]) -> ServerSettings:
        return ServerSettings({**self.values, **{k: _conf_str(v) for k, v in other.items()}})

    def as_dict(self) -> dict[str, str]:
        return dict(self.values)

    def as_command_args(self) -> list[str]:
        """``["-c", "name=value", ...]`` for a ``postgres`` command line."""
        out: list[str] = []
        for name, value in self.values.items():
            out += ["-c", f"{name}={value}"]
        return out

    def as_conf(self) -> str:
        lines = [f"{_check_name(k)} = {conf_value(v)}" for k, v in self.values.items()]
        return "\n".join(lines) + "\n"


def _conf_str(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _check_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name):
        raise ValueError(f"invalid configuration parameter name {name!r}")
    return name


def conf_value(text: str) -> str:
    """``text`` as a quoted postgresql.conf value (the configuration file's grammar, not SQL:
    psycopg.sql does not apply)."""
    return "'" + text.replace("'", "''") + "'"
