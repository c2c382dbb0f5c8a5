"""The interface of a *divert*: where a source transaction's changes go instead of being applied.

While the apply stage delivers one source transaction it has either no divert (changes are
applied as they come: the hot path) or exactly one, chosen at its begin or Origin message: a
transaction already applied, one skipped on request, one from a skipped origin, a prepared
transaction already prepared on the target, or one deferred until COMMIT PREPARED. The divert
then receives the changes and the end of the transaction. Pure interface: no behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..assembler import Change, TransactionEnd
    from ..protocol.messages import Relation

__all__ = ["Divert", "Discard"]


class Divert:
    """Receives one transaction's changes instead of the apply path. Default: drop them."""

    #: Name used in logs.
    what = "diverted"
    #: True when the divert has the target transaction open and a skipped origin may roll it back.
    abandonable = False

    def change(self, msg: Change) -> None:
        """One change of the transaction, in order."""

    def relation(self, msg: Relation) -> None:
        """A Relation message arrived inside the transaction (the apply stage has cached it)."""

    def commit(self, txn: TransactionEnd) -> None:
        """The transaction commits."""

    def prepare(self, txn: TransactionEnd) -> None:
        """The transaction is prepared."""


class Discard(Divert):
    """Drops everything: an already applied transaction, or one from a skipped origin."""

    def __init__(self, what: str) -> None:
        self.what = what
