"""Running one query on whichever connection a command holds, off the hot path.

Commands hold psycopg connections (sync's copies, the Spark reader, ``applier run`` and its
metrics probe) or SQLAlchemy connections (status, verify's snapshot, sync's catalog); both take the same psycopg-style
parameters (``%(name)s``), SQLAlchemy's through ``exec_driver_sql``. Owns only that adapter; must
never hold state, commit or roll back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from psycopg import sql

__all__ = ["rows"]


def rows(conn: Any, query: str | sql.Composable,
         params: Mapping[str, Any] | Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """The rows ``query`` returns on ``conn`` (none for a statement that returns none)."""
    text = query if isinstance(query, str) else query.as_string()
    if hasattr(conn, "exec_driver_sql"):  # SQLAlchemy
        result = conn.exec_driver_sql(text, params if params else None)
        return [tuple(row) for row in result] if result.returns_rows else []
    cursor = conn.execute(text, params or None)
    return list(cursor.fetchall()) if cursor.description is not None else []
