"""Sizes and durations in text: ``'64MB'`` to bytes, ``'7d'`` to seconds, and back.

Owns the one spelling of byte sizes (binary multiples, PostgreSQL's ``kB``/``MB``/``GB``/``TB``)
and of durations (``ms``, ``s``, ``min``, ``h``, ``d``) that options, help texts and the
configuration reference share. A leaf module: it must never import the rest of applier, so that
both ``config`` and ``ops.lag`` can build on it.
"""

from __future__ import annotations

import re

__all__ = ["DURATION", "format_duration", "format_size", "parse_duration", "parse_size",
           "readable_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_NAMES = (("TB", 1024**4), ("GB", 1024**3), ("MB", 1024**2), ("kB", 1024))


def parse_size(text: str | int) -> int:
    """``'64MB'``, ``'512kB'``, ``'1GiB'`` or a plain byte count -> bytes (binary multiples)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"invalid size {text!r}: use a number with an optional unit, e.g. 64MB")
    unit = (match.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(size: int) -> str:
    """Bytes -> the largest unit that divides them exactly: ``64MB``, ``8kB``, ``1000B``."""
    for name, factor in _NAMES:
        if size and size % factor == 0:
            return f"{size // factor}{name}"
    return f"{size}B"


def readable_size(nbytes: float) -> str:
    """Bytes for a person, to one decimal: ``812 B``, ``12.3 MB``."""
    for unit in ("B", "kB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


#: A number and a time unit (the unit is required).
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|secs|seconds?|min|mins|minutes?|h|hours?|d|days?)\s*$",
                      re.IGNORECASE)
_SECONDS = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "h": 3600, "hour": 3600, "d": 86400, "day": 86400}
_BARE_SECONDS = re.compile(r"^\s*\d+(?:\.\d+)?\s*$")
_UNIT_NAMES = {"secs": "s", "second": "s", "seconds": "s", "mins": "min", "minute": "min",
               "minutes": "min", "hours": "hour", "days": "day"}


def parse_duration(text: str | float) -> float:
    """``'7d'``, ``'12h'``, ``'30min'``, ``'45s'``, ``'500ms'`` (or a number of seconds, also
    written as text) -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    if _BARE_SECONDS.match(text):
        return float(text)
    match = DURATION.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r}: use a number and a unit, e.g. 7d, 12h, 30min, 45s "
                         "(a bare number is seconds)")
    unit = match.group(2).lower()
    return float(match.group(1)) * _SECONDS[_UNIT_NAMES.get(unit, unit)]


def format_duration(seconds: float) -> str:
    """Seconds -> the largest unit that divides them exactly: ``7d``, ``12h``, ``90s``."""
    for name, factor in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if seconds and seconds % factor == 0:
            return f"{int(seconds // factor)}{name}"
    return f"{seconds:g}s"
