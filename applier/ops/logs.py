"""Log output: human-readable lines or JSON lines, secrets masked, slot/LSN/xid attached.

Owns the root handler ``applier`` installs (``configure_logging``), the masking of connection
string passwords in every line whoever logged it (applier, psycopg, alembic, tracebacks), and the
log context: the running worker registers a function returning its slot, last received source
LSN and xid, and every record carries them as fields (JSON) or, on warnings and errors, as a
``[slot=... received_lsn=... xid=...]`` suffix at the end of the message (text). Must never
decide what is logged or at which level.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TextIO

from ..config import mask_dsn

__all__ = ["CONTEXT_FIELDS", "configure_logging", "set_log_context"]

#: Structured fields every record carries when known.
CONTEXT_FIELDS = ("slot", "lsn", "xid")

_context: Callable[[], dict[str, Any]] | None = None


def set_log_context(provider: Callable[[], dict[str, Any]] | None) -> None:
    """Register (or with None, remove) the function giving the current slot, LSN and xid."""
    global _context
    _context = provider


class _ContextFilter(logging.Filter):
    """Adds slot, lsn and xid to each record; values given with ``extra=`` win."""

    def filter(self, record: logging.LogRecord) -> bool:
        known: dict[str, Any] = {}
        if _context is not None:
            try:
                known = _context()
            except Exception:  # noqa: BLE001 - a context failure must never lose the log line
                known = {}
        for name in CONTEXT_FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, known.get(name))
        return True


def _context_of(record: logging.LogRecord) -> dict[str, Any]:
    return {name: getattr(record, name, None) for name in CONTEXT_FIELDS
            if getattr(record, name, None) is not None}


#: How the text format labels a context field: ``lsn`` is the last *received* source LSN, which
#: is not the LSN ``applier skip`` takes (the message names that one).
_TEXT_LABELS = {"lsn": "received_lsn"}


class TextFormatter(logging.Formatter):
    """``time level logger: message``; warnings and errors end with their slot, last received
    LSN and xid, after the whole message (a traceback follows below)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        context = _context_of(record)
        if record.levelno >= logging.WARNING and context:
            suffix = " ".join(f"{_TEXT_LABELS.get(name, name)}={value}"
                              for name, value in context.items())
            line = f"{line} [{suffix}]"
        return line

    def format(self, record: logging.LogRecord) -> str:
        return mask_dsn(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, slot, lsn, xid, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": mask_dsn(record.getMessage()),
        }
        entry.update({name: str(value) if name == "lsn" else value
                      for name, value in _context_of(record).items()})
        if record.exc_info:
            entry["exception"] = mask_dsn(self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str = "INFO", log_format: str = "text", stream: TextIO | None = None) -> None:
    """Replace the root logger's handlers with one masked, context-aware handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
