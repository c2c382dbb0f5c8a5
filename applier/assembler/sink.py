"""What the assembler hands to the apply stage: the sink protocol and the transaction envelopes.

Owns the contract between transaction assembly and apply. Pure declarations: no behaviour, no
I/O. The apply stage implements ``TransactionSink``; the assembler calls it strictly in stream
order, one whole source transaction at a time (begin ... commit/prepare, never interleaved).
It may also implement ``EarlyApply``, which receives one streamed transaction at a time while it
streams, instead of the assembler buffering it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeAlias, Union

from applier.protocol import (
    LSN,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    Relation,
    RollbackPrepared,
    Truncate,
    Type,
    Update,
)

__all__ = ["TransactionSink", "TransactionStart", "TransactionEnd", "Change", "EarlyApply"]

#: A transactional change as delivered between ``begin`` and ``commit``/``prepare``.
Change: TypeAlias = Union[Insert, Update, Delete, Truncate, Message]


# The envelopes are made for every source transaction and never changed; they are not frozen
# only because a frozen dataclass costs about 1 µs more per object to make.
@dataclass(slots=True)
class TransactionStart:
    """A source transaction starts being delivered.

    ``commit_lsn`` is Begin.final_lsn, BeginPrepare.prepare_lsn, StreamCommit.commit_lsn or
    StreamPrepare.prepare_lsn. ``end_lsn`` is known up front for BeginPrepare and for streamed
    transactions (which are only delivered once their end arrived); it is None for a plain Begin.
    ``gid`` is set for two-phase transactions only.
    """

    xid: int
    commit_lsn: LSN
    commit_time: datetime
    streamed: bool
    gid: str | None
    end_lsn: LSN | None


@dataclass(slots=True)
class TransactionEnd:
    """The end of a delivered transaction: Commit, Prepare, Stream Commit or Stream Prepare."""

    xid: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime
    streamed: bool
    gid: str | None


class TransactionSink(Protocol):
    """Receiver of assembled transactions; implemented by the apply stage."""

    def relation(self, msg: Relation) -> None:
        """Schema of a relation, in stream order (inside or outside a transaction)."""

    def type(self, msg: Type) -> None:
        """A data type's name, in stream order (inside or outside a transaction)."""

    def begin(self, txn: TransactionStart) -> None:
        """A source transaction starts being delivered."""

    def origin(self, msg: Origin) -> None:
        """Replication origin of the current transaction."""

    def change(self, msg: Change) -> None:
        """One transactional change of the current transaction, in order."""

    def take_changes(self, payloads: list[bytes], start: int) -> int:
        """Changes of the streamed transaction being delivered, still encoded (as received in
        its stream blocks), from ``start`` on: the sink may take a prefix of them itself;
        returns the index of the first it did not take, which then comes through ``change``
        (or ``relation``, ``type``, ``origin``) decoded, and the rest after it are offered again."""

    def commit(self, txn: TransactionEnd) -> None:
        """The current transaction commits (Commit or Stream Commit)."""

    def prepare(self, txn: TransactionEnd) -> None:
        """The current transaction is prepared (Prepare or Stream Prepare); ends it like commit."""

    def commit_prepared(self, msg: CommitPrepared) -> None:
        """A previously prepared transaction commits (always outside any transaction)."""

    def rollback_prepared(self, msg: RollbackPrepared) -> None:
        """A previously prepared transaction rolls back (always outside any transaction)."""

    def message(self, msg: Message) -> None:
        """A non-transactional logical message, delivered as soon as it arrives."""


class EarlyApply(Protocol):
    """Applies a streamed transaction while it streams, uncommitted until its Stream Commit.

    The assembler offers each streamed transaction at its first segment (``open``); from an
    accepted ``open`` to the transaction's end it passes on its records as they arrive, in order,
    and where each subtransaction begins. Row changes it takes (``changes`` or ``change``
    returning True) are not buffered: it then holds the only copy, and giving up after that
    raises (the caller restarts replication, and the source sends the transaction again). Until
    then it may decline (False): the assembler buffers that transaction from there on, as any
    other, and passes nothing more of it on."""

    def open(self, xid: int) -> bool:
        """The first segment of ``xid`` arrived: will it be applied as it streams?"""

    def changes(self, payloads: list[bytes], start: int, stop: int) -> bool:
        """Row changes (Insert, Update, Delete payloads), still encoded, ``payloads[start:stop]``."""

    def change(self, msg: Change | Origin) -> bool:
        """Any other change of the transaction (or its Origin), decoded."""

    def schema(self, msg: Relation | Type) -> None:
        """A Relation or Type message of the transaction (buffered as well)."""

    def subtransaction(self, subxid: int) -> None:
        """``subxid``'s first change follows: everything from here on is undone by its abort."""

    def pause(self) -> None:
        """Stream Stop: nothing more of the transaction until its next segment."""

    def abort(self, subxid: int) -> None:
        """Stream Abort: of a subtransaction, or of the whole transaction (``subxid`` its xid)."""

    def finish(self, start: TransactionStart, end: TransactionEnd) -> bool:
        """Stream Commit. True: done (committed with its progress, or found applied already).
        False (only if it took no changes): deliver it from the buffer."""

    def cancel(self) -> None:
        """Stream Prepare: the transaction is delivered from the buffer (raises if it holds
        changes the buffer has not)."""
