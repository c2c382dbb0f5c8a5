"""One option as every front end sees it (``Option``): its flag, environment variable,
placeholder, default as a person writes it, and the conversion of a raw value to its type; and the
``ConfigError`` any bad value raises. Must never know which options exist (``options`` does).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ops.lag import LagLimit, parse_lag_limit
from ..protocol.lsn import LSN
from ..units import format_duration, format_size, parse_duration, parse_size

__all__ = ["ConfigError", "Option"]


class ConfigError(ValueError):
    """A bad option value, file or combination; the message says which and how to fix it."""


def _parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"invalid boolean {text!r}: use true or false")


def _parse_int(raw: str | int) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    text = str(raw).strip()
    if not re.fullmatch(r"[+-]?\d+", text):
        raise ValueError(f"{raw!r} is not a whole number")
    return int(text)


def _parse_float(raw: str | float) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    try:
        return float(str(raw).strip())
    except ValueError:
        raise ValueError(f"{raw!r} is not a number") from None


def _parse_list(text: str | Sequence[str]) -> list[str]:
    items = text.split(",") if isinstance(text, str) else list(text)
    return [item.strip() for item in items if item.strip()]


def _parse_dsns(value: str | Sequence[str]) -> list[str]:
    """Connection strings: one from the environment or a file's string (a DSN may hold commas:
    ``host=a,b``), several from repeated flags or a file's list."""
    return [value] if isinstance(value, str) else [str(item) for item in value]


def _parse_lag(value: str | int | LagLimit) -> LagLimit:
    return value if isinstance(value, LagLimit) else parse_lag_limit(str(value))


#: Command-line placeholders by kind; a plain string names its own (``Option.metavar``).
_PLACEHOLDERS = {"int": "N", "float": "N", "size": "SIZE", "list": "NAME[,NAME...]", "path": "DIR",
                 "dsns": "DSN",
                 "lsn": "LSN", "lag": "SIZE|DURATION", "duration": "DURATION"}


@dataclass(frozen=True)
class Option:
    """One setting of one or more commands, as every front end sees it.

    A name may have several entries for disjoint sets of commands where its meaning or default
    differs by command (``--slot`` of ``verify`` is optional, of ``run`` required); they share
    one ``Settings`` field, so they must share ``kind``.
    """

    name: str                      # snake_case; --kebab-case on the command line; APPLIER_UPPER in env
    help: str                      # says what the default means when ``default`` cannot show it
    kind: str = "str"              # str | int | float | bool | size | list | choice | path | lsn | lag
                                   # | duration (seconds as a float; 30s, 5min or a bare number)
                                   # | dsns (connection strings, never split at commas)
    default: Any = None            # the field's value as typed (64 * 1024**2, not "64MB")
    choices: tuple[str, ...] = ()  # for kind choice (and an int may have them too)
    commands: tuple[str, ...] = ("run", "sync")
    secret: bool = False           # DSNs: passwords are masked wherever the value is shown
    repeatable: bool = False       # list options given several times on the command line
    metavar: str | None = None     # command-line placeholder, when the kind's is unclear

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "APPLIER_" + self.name.upper()

    @property
    def placeholder(self) -> str | None:
        """What the command line shows for the value (None: a flag, or a choice of its own)."""
        if self.kind in ("bool", "choice") or self.choices:
            return None
        return self.metavar or _PLACEHOLDERS.get(self.kind) or ("DSN" if self.secret else None)

    @property
    def default_text(self) -> str | None:
        """The default as a person writes it (``64MB``, ``60s``, ``false``); None when there is
        none to show (the help then says what happens)."""
        value = self.default
        if value is None or value == []:
            return None
        if isinstance(value, bool):
            return "true" if value else "false"
        if self.kind == "size":
            return format_size(value)
        if isinstance(value, LagLimit):
            return value.text
        if isinstance(value, list):
            return ",".join(value)
        if self.kind == "duration":
            return format_duration(value)
        if isinstance(value, float):
            return f"{value:g}"  # 10, not 10.0
        return str(value)

    def choice(self, raw: Any) -> str:
        """``raw`` as one of the choices: any case (``debug`` is ``DEBUG``), and for a choice of
        on/off (and more) a boolean too, as the option once was one. Anything else is returned
        as it is, for the check of the choices to refuse."""
        if "on" in self.choices and "off" in self.choices:
            try:
                return "on" if _parse_bool(raw) else "off"
            except ValueError:
                pass
        text = str(raw)
        return next((c for c in self.choices if c.lower() == text.strip().lower()), text)

    @property
    def expected(self) -> str:
        """The form a number takes, for an error message."""
        form = "a whole number" if self.kind == "int" else "a number"
        return f"{form}, e.g. {self.default_text}" if self.default_text else form

    def convert(self, raw: Any, given_as: str | None = None) -> Any:
        """A value from the command line, the environment, the file or the default -> its type.
        ``given_as`` names where it was given (``APPLIER_BATCH_ROWS``, ``--batch-rows``) for
        the error, which then says what form it takes."""
        if raw is None:
            return None
        converters: dict[str, Callable[[Any], Any]] = {
            "str": str, "int": _parse_int, "float": _parse_float, "bool": _parse_bool,
            "size": parse_size,
            "list": _parse_list, "path": lambda v: Path(v).expanduser(), "choice": self.choice,
            "lsn": lambda v: LSN.parse(str(v)), "lag": _parse_lag,
            "duration": parse_duration, "dsns": _parse_dsns,
        }
        label = given_as or self.name
        try:
            value = converters[self.kind](raw)
        except (TypeError, ValueError) as exc:
            # Sizes, durations, lag limits, booleans and LSNs say their form themselves.
            form = f" (expected {self.expected})" if self.kind in ("int", "float") else ""
            raise ConfigError(f"{label}: {exc}{form}") from None
        if self.choices and str(value) not in self.choices:
            raise ConfigError(f"{label}: {value!r} is not one of {', '.join(self.choices)}")
        return value
