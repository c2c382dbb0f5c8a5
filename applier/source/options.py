"""pgoutput START_REPLICATION options, checked against what the source server supports."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg

from ..config import Settings
from ..protocol.messages import FIRST_NORMAL_OID
from ..quoting import ident, qualified

__all__ = ["StreamOptions", "UnsupportedOption", "max_protocol_version", "not_built_in",
           "options_for", "resolve_stream_options"]

log = logging.getLogger(__name__)


class UnsupportedOption(ValueError):
    """An option the source server's version cannot honour; the message names the version needed."""


def max_protocol_version(server_version_num: int) -> int:
    """Highest pgoutput protocol version a server speaks (14: 2, 15: 3, 16+: 4)."""
    major = server_version_num // 10000
    if major >= 16:
        return 4
    return {15: 3, 14: 2}.get(major, 1)


def _major(server_version_num: int) -> int:
    return server_version_num // 10000


@dataclass(frozen=True)
class StreamOptions:
    publications: tuple[str, ...]
    proto_version: int
    streaming: str          # off | on | parallel
    two_phase: bool
    binary: bool
    messages: bool
    origin: str | None      # any | none (PostgreSQL 16+), None = server default

    def sql(self) -> str:
        """The parenthesised option list for START_REPLICATION ... LOGICAL lsn (...)."""
        names = ",".join(self.publications)
        parts = [f"proto_version '{self.proto_version}'", f"publication_names {_command_literal(names)}"]
        if self.streaming != "off":
            parts.append(f"streaming '{self.streaming}'")
        if self.two_phase:
            parts.append("two_phase 'true'")
        if self.binary:
            parts.append("binary 'true'")
        if self.messages:
            parts.append("messages 'true'")
        if self.origin is not None:
            parts.append(f"origin '{self.origin}'")
        return "(" + ", ".join(parts) + ")"


def _command_literal(text: str) -> str:
    """A string in a replication command. The walsender's grammar (repl_scanner.l) knows only
    '...' with '' for a quote: no E'...' strings, which ``psycopg.sql.Literal`` writes for a
    backslash, so this one literal is not composed with it."""
    return "'" + text.replace("'", "''") + "'"


def _quote_publication(name: str) -> str:
    # publication_names is parsed with SplitIdentifierString: names with special characters need
    # double quotes inside the string.
    if name.isidentifier() and name == name.lower():
        return name
    return ident(name)


def resolve_stream_options(server_version_num: int, publications: list[str], *,
                           proto_version: int | None = None, streaming: str | None = None,
                           two_phase: bool | None = None, slot_two_phase: bool = False,
                           binary: bool = False, messages: bool = False,
                           origin: str | None = None) -> StreamOptions:
    """Fill defaults and refuse what the server cannot do, naming the version that introduced it.

    Defaults: the highest protocol the server speaks; streaming ``parallel`` on 4, ``on`` on 2-3;
    two-phase when the slot has it.
    """
    if not publications:
        raise UnsupportedOption("at least one publication is required")
    major = _major(server_version_num)
    highest = max_protocol_version(server_version_num)
    version = highest if proto_version is None else proto_version
    if version > highest:
        needed = {2: 14, 3: 15, 4: 16}[version]
        raise UnsupportedOption(f"protocol version {version} needs PostgreSQL {needed} or later; "
                                f"the source runs PostgreSQL {major} (highest version {highest})")
    if streaming is None:
        streaming = {4: "parallel", 3: "on", 2: "on"}.get(version, "off")
    if streaming != "off" and version < 2:
        raise UnsupportedOption("streaming needs protocol version 2 (PostgreSQL 14) or later")
    if streaming == "parallel" and version < 4:
        raise UnsupportedOption("streaming=parallel needs protocol version 4 (PostgreSQL 16) or later")
    if two_phase is None:
        two_phase = slot_two_phase and version >= 3
    if two_phase and version < 3:
        raise UnsupportedOption("two_phase needs protocol version 3 (PostgreSQL 15) or later")
    if binary and major < 14:
        raise UnsupportedOption("binary mode needs PostgreSQL 14 or later")
    if messages and major < 14:
        raise UnsupportedOption("messages need PostgreSQL 14 or later")
    if origin is not None:
        if origin not in ("any", "none"):
            raise UnsupportedOption(f"origin must be 'any' or 'none', not {origin!r}")
        if major < 16:
            raise UnsupportedOption(f"origin filtering needs PostgreSQL 16 or later; the source "
                                    f"runs PostgreSQL {major}")
    return StreamOptions(tuple(_quote_publication(p) for p in publications), version, streaming,
                         two_phase, binary, messages, origin)


def options_for(settings: Settings, control: psycopg.Connection, slot_two_phase: bool, *,
                text_values: bool = False) -> StreamOptions:
    """The options a worker with ``settings`` asks of the source ``control`` is connected to.
    Binary values with ``--binary on``, and with ``auto`` from PostgreSQL 14 on unless a relation
    already needed text values (``text_values``: the worker then stays on text) or a published
    column has a type that is not built in (read from the catalogs here, so that the first
    session asks for text values rather than restarting on its first such Relation)."""
    version = control.info.server_version
    auto_binary = settings.binary == "auto" and not text_values and version >= 140000
    if auto_binary:
        table = not_built_in(control, settings.publication)
        if table is not None:
            log.info("text values: published table %s has a column of a type that is not built "
                     "in, whose binary values would not mean the same on the target (--binary "
                     "auto)", table)
            auto_binary = False
    return resolve_stream_options(
        version, settings.publication, proto_version=settings.proto_version,
        streaming=settings.streaming, two_phase=settings.two_phase, slot_two_phase=slot_two_phase,
        binary=settings.binary == "on" or auto_binary, messages=settings.messages,
        origin=settings.origin)


_NOT_BUILT_IN = """
    SELECT p.schemaname, p.tablename
    FROM pg_catalog.pg_publication_tables p
    JOIN pg_catalog.pg_namespace n ON n.nspname = p.schemaname
    JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename
    JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
    WHERE p.pubname = ANY(%(publications)s) AND a.atttypid >= %(first)s {published}
    ORDER BY 1, 2 LIMIT 1
"""


def not_built_in(control: psycopg.Connection, publications: list[str]) -> str | None:
    """A published table (its quoted name) with a published column whose type is not built in,
    or None. (Before PostgreSQL 15 every column is published.)"""
    published = "AND a.attname = ANY(p.attnames)" if control.info.server_version >= 150000 else ""
    row = control.execute(_NOT_BUILT_IN.format(published=published),
                          {"publications": publications, "first": FIRST_NORMAL_OID}).fetchone()
    return qualified(row[0], row[1]) if row else None
