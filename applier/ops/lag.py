"""Apply lag: how far the target is behind the source, and limits on it.

Owns the single definition of lag shared by ``applier status`` and the metrics endpoint, and
parsing of lag limits (``--max-lag``, ``--ready-max-lag``: a size or a duration, always with its
unit). Pure: must never query a database, nor import the option table (which builds on it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from ..protocol.lsn import LSN
from ..units import DURATION, parse_duration, parse_size

__all__ = ["Lag", "LagLimit", "measure_lag", "parse_lag_limit"]


@dataclass(frozen=True)
class Lag:
    """``bytes``: source WAL not yet applied or confirmed. ``seconds``: an upper bound on how old
    the replica's view of the source is; None when nothing was ever applied."""

    bytes: int
    seconds: float | None


def measure_lag(source_lsn: LSN, done_lsn: LSN, last_commit_time: datetime | None,
                now: datetime) -> Lag:
    """Lag of a replica whose furthest handled position is ``done_lsn``.

    ``done_lsn`` is max(end LSN of the last applied transaction, the slot's confirmed position):
    the slot also confirms WAL that held nothing for the publication, so WAL of other tables or
    databases does not count as lag. When WAL is pending, the replica shows the source as of the
    last applied commit at the latest, so ``now - last_commit_time`` bounds the lag in time (it
    overstates it right after a long idle period, never understates it).
    """
    pending = max(0, int(source_lsn) - int(done_lsn))
    if pending == 0:
        return Lag(0, 0.0)
    if last_commit_time is None:
        return Lag(pending, None)
    return Lag(pending, max(0.0, (now - last_commit_time).total_seconds()))


@dataclass(frozen=True)
class LagLimit:
    """At most ``bytes`` of pending WAL, or at most ``seconds`` of lag (exactly one is set)."""

    text: str
    bytes: int | None = None
    seconds: float | None = None

    def exceeded_by(self, lag: Lag) -> bool:
        if self.bytes is not None:
            return lag.bytes > self.bytes
        assert self.seconds is not None
        if lag.seconds is None:  # WAL is pending and nothing was ever applied: unbounded
            return lag.bytes > 0
        return lag.seconds > self.seconds


_BARE_NUMBER = re.compile(r"^\s*\d+(?:\.\d+)?\s*$")


def parse_lag_limit(text: str) -> LagLimit:
    """``'64MB'`` (bytes of WAL) or ``'30s'``, ``'5min'``, ``'2h'`` (time); ValueError otherwise.

    A number without a unit is refused (is ``5`` five bytes or five seconds?), except ``0``, which
    is the same either way.
    """
    if DURATION.match(text):
        return LagLimit(text, seconds=parse_duration(text))
    if _BARE_NUMBER.match(text) and float(text) != 0:
        raise ValueError(f"lag limit {text!r} has no unit: write a size of WAL (e.g. "
                         f"{text.strip()}MB) or a duration (e.g. {text.strip()}s, {text.strip()}min)")
    try:
        return LagLimit(text, bytes=parse_size(text))
    except ValueError:
        raise ValueError(f"invalid lag limit {text!r}: use a size of WAL (e.g. 64MB) or a "
                         "duration (e.g. 30s, 5min, 2h)") from None
