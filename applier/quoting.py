"""Identifiers and literals in SQL text, always through ``psycopg.sql``.

Statements on the hot path are built once per shape and kept as text (they are sent with
libpq's extended protocol, parameters as ``$n``); these helpers render ``psycopg.sql``
compositions to that text. Owns nothing else: every module composes its SQL with ``psycopg.sql``
and nothing hand-quotes a name or a value.
"""

from __future__ import annotations

from psycopg import sql

__all__ = ["ident", "literal", "qualified", "render"]


def render(query: sql.Composable) -> str:
    """A composition as SQL text (identifiers quoted, literals escaped for a UTF8 session)."""
    return query.as_string()


def ident(name: str) -> str:
    """An identifier, always quoted: mixed case, spaces, quotes and keywords all survive."""
    return sql.Identifier(name).as_string()


def qualified(schema: str, name: str) -> str:
    """A schema-qualified name, both parts quoted."""
    return sql.Identifier(schema, name).as_string()


def literal(value: object) -> str:
    """A SQL literal of ``value`` (strings quoted and escaped)."""
    return sql.Literal(value).as_string()
