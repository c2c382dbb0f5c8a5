"""How a target transaction takes a schema change (``TargetTransaction.schema_changes``).

Owns the three modes and what each means around the change's statements: inside the open
transaction (the rule); committed on its own before the transaction that needs it, which the
source then sends again (a transaction prepared on the target holds locks the change would wait
for); or refused (a session that must not change the schema). Used by the schema follower and
the change feed. Must never compose a schema change.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import ApplyError, Cause

__all__ = ["DDL_INLINE", "DDL_REFUSED", "DDL_SEPARATELY", "DdlSession", "after_ddl", "before_ddl"]

DDL_INLINE, DDL_SEPARATELY, DDL_REFUSED = "inline", "separately", "refused"


class DdlSession(Protocol):
    """The target transaction, as far as a schema change needs it."""

    schema_changes: str

    def begin(self) -> None: ...

    def rollback(self) -> None: ...

    def commit_alone(self) -> None: ...


def before_ddl(tx: DdlSession, subject: str) -> None:
    """Before ``subject`` (what needs the change, for the error) is changed: refused, or a
    transaction of its own begun."""
    if tx.schema_changes == DDL_REFUSED:
        raise ApplyError(f"{subject} needs a schema change, which this session does not make",
                         cause=Cause.SEND_AGAIN)
    if tx.schema_changes == DDL_SEPARATELY:
        tx.rollback()
        tx.begin()


def after_ddl(tx: DdlSession, subject: str) -> None:
    """After the change's statements: a change made on its own is committed, and the source is
    to send the transaction that needed it again."""
    if tx.schema_changes == DDL_SEPARATELY:
        tx.commit_alone()
        raise ApplyError(f"{subject} needed a schema change, made on its own before the prepared "
                         "transaction that needs it; the source sends that transaction again",
                         cause=Cause.SEND_AGAIN)
