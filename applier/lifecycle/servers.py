"""What the lifecycle commands read of both servers alike: connections, prepared transactions.

Owns connecting for ``sequences``, ``cutover`` and ``drop`` (a connection that cannot be made is
a ``LifecycleError`` naming the side and the reason, the password masked), and listing the
prepared transactions that keep a target from being a replacement: the source database's, and the
ones the worker prepared on the target for a slot (two-phase mode prepare; its GIDs are
``apply.twophase.target_gid``). Must never write to either server.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from .. import connections
from ..apply.twophase import is_target_gid
from ..config import mask_dsn
from ..errors import ApplierError, Cause

__all__ = ["LifecycleError", "PreparedTransaction", "connect", "source_prepared", "target_prepared"]


class LifecycleError(ApplierError):
    """The command cannot do its work; the message says what is wrong and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.NEEDS_OPERATOR)


@dataclass(frozen=True)
class PreparedTransaction:
    gid: str
    prepared: datetime
    owner: str


def connect(dsn: str, side: str, command: str) -> psycopg.Connection[Any]:
    """An autocommit connection to the ``side`` ('source' or 'target') for ``applier command``."""
    try:
        return connections.connect(dsn, autocommit=True, application_name=f"applier {command}")
    except psycopg.Error as exc:
        reason = mask_dsn(" ".join(str(exc).split()))
        raise LifecycleError(f"cannot connect to the {side} ({mask_dsn(dsn)}): {reason}. Check "
                             f"--{side} and that the server is up") from None


def _prepared(conn: psycopg.Connection[Any]) -> list[PreparedTransaction]:
    return [PreparedTransaction(*row) for row in conn.execute(
        "SELECT gid, prepared, owner::text FROM pg_catalog.pg_prepared_xacts "
        "WHERE database = pg_catalog.current_database() ORDER BY prepared")]


def source_prepared(conn: psycopg.Connection[Any]) -> list[PreparedTransaction]:
    """Every transaction prepared in the source database and not yet committed or rolled back."""
    return _prepared(conn)


def target_prepared(conn: psycopg.Connection[Any], slot: str) -> list[PreparedTransaction]:
    """The transactions the worker of ``slot`` prepared on the target, pending."""
    return [p for p in _prepared(conn) if is_target_gid(p.gid, slot)]
