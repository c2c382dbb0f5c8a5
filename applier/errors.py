"""One error policy: every failure, whichever library raised it, maps to what the worker does.

Owns the errors applier raises itself (``ApplierError`` and its kinds by side), the facts they
carry (a ``Cause``, the SQLSTATE), the reading of foreign exceptions (psycopg, SQLAlchemy, the
decoder and assembler) into those facts, and the one table from cause to ``Directive``. Raise
sites state what happened (a lost connection, an object the operator must create, a row the
target refused); only ``decide`` says what follows. Must never retry, log or sleep itself: the
worker and ``sync`` do that with tenacity, asking ``decide``.

Directives:

* ``RETRY``: start a new session after a backoff (a lost connection on either side, a lock wait
  that timed out, a server that is starting or full).
* ``RESTART_NOW``: start a new session at once: not a failure but a change of course (the stream
  must carry text values; a transaction applied as it streams must be sent again).
* ``REDO_CAREFUL``: the fast path met a conflict or an error; redo that stretch row by row.
* ``STOP``: nothing waiting can fix; stop and tell the operator what to do. Everything before
  the failing source transaction is committed first (the worker's invariant 5).
"""

from __future__ import annotations

import sys
from enum import Enum

import psycopg

from .protocol.lsn import LSN

__all__ = ["ApplierError", "ApplyError", "Cause", "Directive", "SourceError", "TargetError",
           "TextValuesNeeded", "cause_of", "cause_of_sqlstate", "decide", "decide_in_batch",
           "is_lost_connection",
           "sqlstate_of"]


class Directive(Enum):
    RETRY = "retry after a backoff"
    RESTART_NOW = "restart the session at once"
    REDO_CAREFUL = "redo the stretch row by row"
    STOP = "stop and tell the operator"


class Cause(Enum):
    """What happened, as far as deciding what to do about it goes."""

    LOST_CONNECTION = "lost connection"
    BUSY = "busy"                          # lock wait timed out, deadlock, too many connections
    NEEDS_OPERATOR = "needs the operator"  # a missing object, a privilege, a setting, credentials
    REFUSED_DATA = "refused data"          # the target refused a row, a conflict under 'error'
    PROTOCOL = "protocol violation"        # malformed bytes, an impossible message sequence
    FAST_PATH_MISMATCH = "fast path mismatch"
    TEXT_VALUES_NEEDED = "text values needed"
    SEND_AGAIN = "send again"              # only the source still has the changes
    PUBLICATION_CHANGED = "publication changed"  # a table to copy before streaming on


_DIRECTIVES = {
    Cause.LOST_CONNECTION: Directive.RETRY,
    Cause.BUSY: Directive.RETRY,
    Cause.NEEDS_OPERATOR: Directive.STOP,
    Cause.REFUSED_DATA: Directive.STOP,
    Cause.PROTOCOL: Directive.STOP,
    Cause.FAST_PATH_MISMATCH: Directive.REDO_CAREFUL,
    Cause.TEXT_VALUES_NEEDED: Directive.RESTART_NOW,
    Cause.SEND_AGAIN: Directive.RESTART_NOW,
    Cause.PUBLICATION_CHANGED: Directive.RESTART_NOW,
}

#: SQLSTATE classes of a connection that is gone: connection exceptions, operator intervention
#: (a server shut down or restarted, a backend terminated).
_LOST_CONNECTION_CLASSES = ("08", "57")
#: Another attempt can succeed: a lock wait past lock_timeout, a deadlock, a serialization
#: failure, too many connections, a server starting up.
_BUSY_SQLSTATES = frozenset({"55P03", "40P01", "40001", "53300", "57P03"})
#: Only an operator can fix these, whichever server says them.
_OPERATOR_SQLSTATES = frozenset({
    "42704",  # undefined object: a slot or publication missing
    "28P01",  # authentication failed
    "28000",  # authorization failed
    "55006",  # object in use: the slot is active for another process
    "3D000",  # database does not exist
    "42501",  # insufficient privilege
    "0A000",  # feature not supported
    "22023",  # invalid parameter value
    "42710",  # duplicate object
    "42P01",  # undefined table
    "42703",  # undefined column
    "3F000",  # undefined schema
})
#: libpq's own words for connection failures an operator must fix (no SQLSTATE reaches the
#: client when the server refuses a connection during start-up).
_OPERATOR_CONNECTION_TEXT = ("authentication failed", "does not exist", "no pg_hba.conf entry",
                             "permission denied", "password is required", "no password supplied",
                             "is not permitted to log in")


class ApplierError(Exception):
    """An error applier raises itself: a message for the operator and the facts ``decide`` reads."""

    side = "applier"

    def __init__(self, message: str, *, cause: Cause, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.sqlstate = sqlstate


class SourceError(ApplierError):
    """The source (its replication connection, its catalog, its slot) failed or refused."""

    side = "source"


class TargetError(ApplierError):
    """A target statement or connection failed."""

    side = "target"


class ApplyError(ApplierError):
    """Applying a source transaction failed; nothing of it (or after it) is committed. Names the
    source transaction (``commit_lsn``, ``xid``) where known. ``careful_until``: with
    ``Cause.FAST_PATH_MISMATCH``, redo everything up to this commit LSN row by row."""

    side = "target"

    def __init__(self, message: str, *, cause: Cause, sqlstate: str | None = None,
                 commit_lsn: LSN | None = None, xid: int | None = None,
                 careful_until: LSN | None = None) -> None:
        super().__init__(message, cause=cause, sqlstate=sqlstate)
        self.commit_lsn = commit_lsn
        self.xid = xid
        self.careful_until = careful_until


class TextValuesNeeded(ApplyError):
    """The stream sends binary values (``--binary auto``) and a relation's would not mean the
    same on the target; the session restarts asking for text values."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.TEXT_VALUES_NEEDED)


def cause_of_sqlstate(sqlstate: str, *, side: str) -> Cause:
    """The cause a SQLSTATE means. An unknown one on the source is taken for a passing failure
    (the stream and its catalog queries fail that way); on the target it means the statement
    itself cannot succeed (a constraint, a type, a value)."""
    if sqlstate[:2] in _LOST_CONNECTION_CLASSES and sqlstate != "57P03":
        return Cause.LOST_CONNECTION
    if sqlstate in _BUSY_SQLSTATES:
        return Cause.BUSY
    if sqlstate in _OPERATOR_SQLSTATES:
        return Cause.NEEDS_OPERATOR
    return Cause.LOST_CONNECTION if side == "source" else Cause.REFUSED_DATA


def _psycopg_cause(exc: psycopg.Error, side: str) -> Cause:
    sqlstate = exc.sqlstate
    if sqlstate:
        return cause_of_sqlstate(sqlstate, side=side)
    if isinstance(exc, psycopg.OperationalError):
        # No SQLSTATE: libpq's own failure (refused, reset, timed out, or refused at start-up).
        text = str(exc)
        if any(words in text for words in _OPERATOR_CONNECTION_TEXT):
            return Cause.NEEDS_OPERATOR
        return Cause.LOST_CONNECTION
    if isinstance(exc, psycopg.InterfaceError):  # e.g. "the connection is closed"
        return Cause.LOST_CONNECTION
    return Cause.REFUSED_DATA if side == "target" else Cause.LOST_CONNECTION


def cause_of(exc: BaseException, *, side: str = "target") -> Cause | None:
    """The cause of any exception the worker may meet; None for one that is not a failure of the
    servers or the stream (a bug: it is reported with its traceback). ``side``: which server a
    foreign exception came from, when the exception cannot say."""
    from .assembler.errors import ProtocolSequenceError, SpillFailed  # (they import nothing of ours)
    from .config import ConfigError
    from .protocol.errors import DecodeError

    if isinstance(exc, ApplierError):
        return exc.cause
    # Not imported here: ``applier run`` loads SQLAlchemy only to create or upgrade the
    # bookkeeping schema (or to copy a table), and without it loaded no SQLAlchemy error can exist.
    alchemy = sys.modules.get("sqlalchemy.exc")
    if alchemy is not None and isinstance(exc, alchemy.DBAPIError):
        # SQLAlchemy wraps the driver's error; a dropped pooled connection says so itself.
        if exc.connection_invalidated:
            return Cause.LOST_CONNECTION
        if isinstance(exc.orig, psycopg.Error):
            return _psycopg_cause(exc.orig, side)
        return Cause.LOST_CONNECTION if isinstance(exc, alchemy.OperationalError) else None
    if isinstance(exc, psycopg.Error):
        return _psycopg_cause(exc, side)
    if isinstance(exc, (DecodeError, ProtocolSequenceError)):
        return Cause.PROTOCOL
    if isinstance(exc, (ConfigError, SpillFailed)):
        return Cause.NEEDS_OPERATOR
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return Cause.LOST_CONNECTION
    return None


def decide(exc: BaseException, *, side: str = "target") -> Directive:
    """What the worker does about ``exc``. Anything not recognised stops it (with a traceback)."""
    cause = cause_of(exc, side=side)
    return Directive.STOP if cause is None else _DIRECTIVES[cause]


def decide_in_batch(exc: BaseException) -> Directive:
    """What a failure met while the fast path holds source transactions in one target
    transaction means. A passing one (a lost connection, a lock wait) is what it is. Anything
    else (a row count other than expected: a conflict; a value or constraint the target refuses;
    a stop) is redone row by row up to the failing transaction: those before it are committed
    first, and it meets the careful path's conflict handling, or stops there on its own."""
    directive = decide(exc)
    return directive if directive in (Directive.RETRY, Directive.RESTART_NOW) else Directive.REDO_CAREFUL


def is_lost_connection(exc: BaseException, *, side: str = "target") -> bool:
    return cause_of(exc, side=side) is Cause.LOST_CONNECTION


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE behind ``exc`` (through SQLAlchemy's wrapper too), if any."""
    alchemy = sys.modules.get("sqlalchemy.exc")
    if alchemy is not None and isinstance(exc, alchemy.DBAPIError) and isinstance(exc.orig, BaseException):
        exc = exc.orig
    return getattr(exc, "sqlstate", None)
