"""Log sequence numbers and PostgreSQL timestamps.

Owns the two scalar types every other stage passes around. Pure: no I/O.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

__all__ = ["LSN", "PG_EPOCH", "pg_timestamp", "to_pg_timestamp"]


class LSN(int):
    """A WAL position. Behaves as an ``int``; prints as PostgreSQL does (``X/XXXXXXXX``)."""

    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> LSN:
        """Parse ``'16/B374D848'`` (either half may be shorter or zero-padded)."""
        high, sep, low = text.strip().partition("/")
        if not sep or not high or not low:
            raise ValueError(f"invalid LSN {text!r}: expected the form X/XXXXXXXX")
        try:
            hi, lo = int(high, 16), int(low, 16)
        except ValueError:
            raise ValueError(f"invalid LSN {text!r}: both halves must be hexadecimal") from None
        if not (0 <= hi <= 0xFFFFFFFF and 0 <= lo <= 0xFFFFFFFF):
            raise ValueError(f"invalid LSN {text!r}: each half must fit in 32 bits")
        return cls((hi << 32) | lo)

    def __str__(self) -> str:
        """As PostgreSQL prints a pg_lsn: ``%X/%X``, no padding (``0/4E63920``)."""
        return f"{int(self) >> 32:X}/{int(self) & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"LSN('{self}')"


#: Timestamps on the wire count microseconds from this instant.
PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def pg_timestamp(microseconds: int) -> datetime:
    """Convert a wire ``TimestampTz`` (microseconds since 2000-01-01 UTC) to an aware datetime."""
    return PG_EPOCH + timedelta(microseconds=microseconds)


def to_pg_timestamp(moment: datetime) -> int:
    """Convert an aware datetime to wire microseconds since 2000-01-01 UTC."""
    delta = moment - PG_EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
