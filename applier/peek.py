"""``applier peek``: print the decoded messages waiting in a slot as JSON lines, consuming nothing.

Owns reading a slot for inspection, over the replication protocol (default: START_REPLICATION
from the slot's ``confirmed_flush_lsn``) or over the SQL interface (``--sql``:
``pg_logical_slot_peek_binary_changes``), and the JSON shape of a decoded message. Must never
consume or alter the slot: it never calls ``ReplicationStream.confirm()``, so every standby status
update reports the slot's own ``confirmed_flush_lsn`` (which changes nothing), it uses only the
*peek* SQL function, and it refuses ``--two-phase`` on a slot created without two-phase (the
server would switch the slot to two-phase decoding for good). Must never print a DSN password.

Output: one JSON object per line on stdout, in the order the server sent the messages::

    {"lsn": "0/1A2B3C4D", "type": "insert", "xid": null, "relation_id": 16385,
     "new_tuple": [{"kind": "t", "value": "1"}, {"kind": "n", "value": null}]}

* ``lsn`` -- ``X/XXXXXXXX``: the XLogData start position (replication protocol) or the row's
  ``lsn`` (SQL interface); ``null`` where the walsender sends none (0/0: a ``relation`` or
  ``type`` message written ahead of the change that needs it).
* ``type`` -- the message's snake_case name: ``begin``, ``commit``, ``origin``, ``relation``,
  ``type``, ``insert``, ``update``, ``delete``, ``truncate``, ``message``, ``stream_start``,
  ``stream_stop``, ``stream_commit``, ``stream_abort``, ``begin_prepare``, ``prepare``,
  ``commit_prepared``, ``rollback_prepared``, ``stream_prepare``.
* then every field of the message's dataclass in ``applier.protocol.messages``, under its field
  name, followed by its convenience properties:

  - LSNs (``final_lsn``, ``commit_lsn``, ``end_lsn``, ``origin_lsn``, ``prepare_lsn``,
    ``abort_lsn``, ...) as ``X/XXXXXXXX`` strings; timestamps (``commit_time``, ``prepare_time``,
    ``abort_time``, ...) as ISO-8601 strings with offset; ``abort_lsn``/``abort_time`` of
    ``stream_abort`` are ``null`` unless protocol 4 with ``--streaming parallel``.
  - ``xid`` on relation/type/insert/update/delete/truncate/message is the (sub)transaction id
    the server sends inside a streamed block only, else ``null``.
  - ``relation``: ``relation_id`` (the table OID), ``namespace``, ``name``,
    ``replica_identity`` (``d``/``n``/``f``/``i``), ``columns``: a list of
    ``{"flags", "name", "type_oid", "type_modifier", "is_key"}``.
  - ``new_tuple`` / ``old_tuple``: a list of ``{"kind", "value"}`` per column; kind ``t``: the
    text value as a string (UTF-8, invalid bytes replaced by U+FFFD), ``b``: the binary value as
    a hex string, ``n``: NULL (value ``null``), ``u``: unchanged TOASTed value (value ``null``).
    ``old_kind`` is ``K`` (key columns), ``O`` (whole old row) or ``null`` (update without one).
  - ``truncate``: ``options``, ``relation_ids`` (list), ``cascade``, ``restart_identity``.
  - ``message``: ``flags``, ``lsn`` (the message's own LSN, which is also the position the
    server sends it at, so the line's ``lsn`` key holds it), ``prefix``, ``content`` (text if
    valid UTF-8, else ``null``), ``content_hex`` (always), ``transactional``.
  - ``stream_start``: ``xid``, ``first_segment``; ``stream_abort``: ``xid``, ``subxid``
    (equal to ``xid`` when the whole transaction aborted).

Stops after ``--limit`` messages (0: none, once the slot, publications and options are
checked) or ``--timeout`` seconds without a new one (replication protocol); the SQL interface
returns what the slot holds at once. Exit status 0 on success; 1 with
one line on stderr when the slot or a publication is missing, another consumer (a worker) holds
the slot, the server cannot honour an option, the connection fails or a message cannot be decoded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Generator
from contextlib import closing
from datetime import datetime
from itertools import islice
from typing import Any, TextIO

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .config import Settings, mask_dsn
from .connections import connect
from .exit_codes import ExitCode
from .protocol import LSN, DecodeError, decode
from .protocol.messages import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED,
    RelationColumn,
    ReplicationMessage,
    StreamStart,
    StreamStop,
    TupleData,
    Unchanged,
)
from .source import ReplicationStream, SourceError, StreamOptions, UnsupportedOption, resolve_stream_options
from .source.slots import SlotInfo, publications_missing, slot_info

__all__ = ["peek", "PeekError", "message_to_json", "sql_options"]

_KIND_NAMES = {KIND_NULL: "n", KIND_TEXT: "t", KIND_UNCHANGED: "u", KIND_BINARY: "b"}
#: Seconds a slot may stay active before peek reports its holder: a WAL sender whose client has
#: just gone (a peek just before, a worker just stopped) releases the slot a moment later.
_RELEASE_GRACE = 1.0


class PeekError(Exception):
    """Why peek cannot go on; the message is the one line shown to the user."""


def peek(settings: Settings) -> int:
    """Print the slot's pending messages as JSON lines; the exit status."""
    settings.require("source", "slot", "publication")
    try:
        # islice stops after the limit without asking for one more message (which would wait for
        # the timeout); closing() ends the replication connection right away.
        with closing(_messages(settings)) as messages:
            for lsn, message in islice(messages, settings.limit):
                _emit(sys.stdout, message_to_json(lsn, message))
    except BrokenPipeError:
        # The reader (e.g. `| head`) has gone: that is a normal end. Point stdout at /dev/null so
        # the interpreter's final flush does not complain again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK
    except (PeekError, UnsupportedOption, SourceError, DecodeError, psycopg.Error) as exc:
        print(f"applier peek: {_one_line(exc, settings.required('source'))}", file=sys.stderr)
        return ExitCode.FAILED
    return ExitCode.OK


def _emit(out: TextIO, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj, ensure_ascii=False) + "\n")
    # Flushed per line so that a script reading the pipe sees each message as it arrives.
    out.flush()


def _one_line(exc: BaseException, dsn: str) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.ProgrammingError:
        password = None
    if password:
        text = text.replace(str(password), "****")
    return mask_dsn(text)


# -- reading the slot -----------------------------------------------------------------------------

def _messages(settings: Settings) -> Generator[tuple[LSN, ReplicationMessage], None, None]:
    """Check the slot (there, a pgoutput slot of this database, free), the publications and the
    options, at once (also for ``--limit 0``); then the (lsn, message) pairs of the slot, read
    as they are asked for."""
    try:
        conn = connect(settings.required("source"), autocommit=True)
    except psycopg.Error as exc:
        raise PeekError(f"cannot connect to the source: {exc}") from None
    with conn:
        slot = _slot(conn, settings.required("slot"))
        missing = publications_missing(conn, settings.publication)
        if missing:
            names = ", ".join(repr(name) for name in missing)
            verb = "does" if len(missing) == 1 else "do"
            raise PeekError(f"publication {names} {verb} not exist in database "
                            f"{conn.info.dbname!r} on the source")
        options = resolve_stream_options(
            conn.info.server_version, settings.publication, proto_version=settings.proto_version,
            streaming=settings.streaming, two_phase=settings.two_phase,
            slot_two_phase=slot.two_phase, binary=settings.binary == "on", messages=settings.messages,
            origin=settings.origin)
        if options.two_phase and not slot.two_phase:
            raise PeekError(f"slot {settings.slot!r} was created without two_phase; decoding it "
                            "with two_phase would switch the slot to two-phase for good, and peek "
                            "never alters a slot (leave --two-phase off)")
        if settings.limit == 0:
            return _nothing()
        if settings.sql:
            return _decoded(_peek_sql(conn, settings.required("slot"), options, settings.limit))
    return _peek_replication(settings, slot, options)


def _nothing() -> Generator[tuple[LSN, ReplicationMessage], None, None]:
    yield from ()


def _slot(conn: psycopg.Connection[Any], name: str) -> SlotInfo:
    """The slot, if peek can read it: a pgoutput slot of this database that no one holds."""
    deadline = time.monotonic() + _RELEASE_GRACE
    while True:
        info = slot_info(conn, name)
        if info is None:
            raise PeekError(f"replication slot {name!r} does not exist on the source")
        if info.plugin != "pgoutput":
            kind = f"plugin {info.plugin}" if info.plugin else "a physical slot"
            raise PeekError(f"replication slot {name!r} is not a logical pgoutput slot ({kind})")
        if info.database != conn.info.dbname:
            raise PeekError(f"replication slot {name!r} belongs to database {info.database!r}; "
                            "connect the source to that database")
        if info.active_pid is None:
            return info
        if time.monotonic() >= deadline:
            # The server would refuse too (after the stream's wait for a slot to be released),
            # without saying what to do.
            raise PeekError(f"replication slot {name!r} is in use by PID {info.active_pid} on the "
                            "source (a worker, or another consumer): a slot serves one consumer "
                            "at a time, so peek cannot read it, with --sql or without. To see "
                            "its messages, stop the worker first; to see the slot and its "
                            "replica while the worker runs, use applier status")
        time.sleep(0.1)


def sql_options(options: StreamOptions) -> list[str]:
    """The pgoutput options as the SQL interface's variadic name/value text list."""
    values = ["proto_version", str(options.proto_version),
              "publication_names", ",".join(options.publications)]
    if options.streaming != "off":
        values += ["streaming", options.streaming]
    if options.two_phase:
        values += ["two_phase", "true"]
    if options.binary:
        values += ["binary", "true"]
    if options.messages:
        values += ["messages", "true"]
    if options.origin is not None:
        values += ["origin", options.origin]
    return values


def _peek_sql(conn: psycopg.Connection[Any], slot: str, options: StreamOptions,
              limit: int | None) -> list[tuple[str, bytes]]:
    """The slot's (lsn, data) rows, read now (before the connection closes)."""
    # upto_nchanges stops decoding at the end of the transaction that reaches the limit, so the
    # server does not decode the whole slot only for us to print the first few rows.
    try:
        return conn.execute(
            "SELECT lsn::text, data FROM pg_catalog.pg_logical_slot_peek_binary_changes("
            "%s, NULL, %s, VARIADIC %s::text[])", (slot, limit, sql_options(options))).fetchall()
    except psycopg.Error as exc:
        raise PeekError(f"source: {exc}") from None


def _decoded(rows: list[tuple[str, bytes]]) -> Generator[tuple[LSN, ReplicationMessage], None, None]:
    in_stream = False
    for lsn, data in rows:
        message = decode(data, in_stream)
        in_stream = _in_stream_after(message, in_stream)
        yield LSN.parse(lsn), message


def _peek_replication(settings: Settings, slot: SlotInfo, options: StreamOptions
                      ) -> Generator[tuple[LSN, ReplicationMessage], None, None]:
    assert slot.confirmed_flush_lsn is not None  # only a slot being created has none
    stream = ReplicationStream(settings.required("source"), settings.required("slot"), options)
    try:
        stream.connect()
        # Starting at confirmed_flush_lsn makes the stream's flush position exactly the slot's:
        # its status updates then confirm nothing new. confirm() is never called.
        stream.start(slot.confirmed_flush_lsn)
        in_stream = False
        while True:
            xlog = stream.read(settings.timeout)
            if xlog is None:
                return
            message = decode(xlog.payload, in_stream)
            in_stream = _in_stream_after(message, in_stream)
            yield xlog.data_start, message
    finally:
        stream.close()


def _in_stream_after(message: ReplicationMessage, in_stream: bool) -> bool:
    if isinstance(message, StreamStart):
        return True
    if isinstance(message, StreamStop):
        return False
    return in_stream


# -- JSON -----------------------------------------------------------------------------------------

def message_to_json(lsn: LSN, message: ReplicationMessage) -> dict[str, Any]:
    """One message as the JSON object described in this module's docstring."""
    # The walsender sends position 0/0 with a message it writes ahead of another (a Relation
    # before the row change that needs it): no position, rather than a false one.
    obj: dict[str, Any] = {"lsn": str(lsn) if lsn else None, "type": message.type_name}
    obj.update(_object_fields(message))
    return obj


_PROPERTIES: dict[type, tuple[str, ...]] = {}


def _properties(cls: type) -> tuple[str, ...]:
    """The properties a message class defines (``Truncate.cascade``...), each class read once."""
    found = _PROPERTIES.get(cls)
    if found is None:
        found = _PROPERTIES[cls] = tuple(name for name, attr in vars(cls).items()
                                         if isinstance(attr, property))
    return found


def _object_fields(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, bytes):
            # Only Message.content is raw bytes at this level: text when it is text, hex always.
            try:
                out[field.name] = value.decode("utf-8")
            except UnicodeDecodeError:
                out[field.name] = None
            out[f"{field.name}_hex"] = value.hex()
        else:
            out[field.name] = _value(value)
    for name in _properties(type(obj)):
        out[name] = getattr(obj, name)
    return out


def _value(value: Any) -> Any:
    if isinstance(value, LSN):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, TupleData):
        return [_column(kind, item) for kind, item in zip(value.kinds, value.values)]
    if isinstance(value, RelationColumn):
        return _object_fields(value)
    if isinstance(value, tuple):
        return [_value(item) for item in value]
    return value


def _column(kind: int, value: bytes | None | Unchanged) -> dict[str, Any]:
    if not isinstance(value, bytes):
        return {"kind": _KIND_NAMES[kind], "value": None}
    if kind == KIND_BINARY:
        return {"kind": "b", "value": value.hex()}
    return {"kind": "t", "value": value.decode("utf-8", errors="replace")}
