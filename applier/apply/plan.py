"""The apply plan: which route takes a source transaction, decided once, by one pure function.

Owns the routes a source transaction can take to the target (``Route``), what each route can
carry (``CARRIES``, the capability table: route x need), and ``plan``, which PostgreSQL's
worker.c calls ``TransApplyAction``: from what is known of the transaction and of the worker
(``Facts``) it returns the route. Every place that routes a transaction asks it: the apply
stage at a transaction's begin (``dispatch.Applier``), the C lane before it takes payloads
(``fast.seat``), a streamed transaction at its first segment and at its commit
(``streaming.StreamingApply``). A route that cannot carry what a transaction needs sends it to
the next route that can: moving a need in or out of a route's row of ``CARRIES`` is all it
takes to reroute. Must never run a statement, read the stream or hold state: it is unit-tested
without a server.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from ..protocol.lsn import LSN

__all__ = ["CARRIES", "Facts", "Need", "Route", "already_applied", "carries", "plan"]


class Route(Enum):
    """Where a source transaction's changes go."""

    ALREADY_APPLIED = "discarded: the target's recorded position covers it"
    SKIPPED = "skipped on request"
    PREPARED = "two-phase: prepared on the target, or kept until COMMIT PREPARED"
    LANE = "the C lane: payloads into the fast path's batch, undecoded"
    FAST = "the fast path: batched with other source transactions in one target transaction"
    CAREFUL = "the careful path: one statement per row, conflicts resolved"
    EARLY = "applied as it streams, in a second target session"
    BUFFERED = "buffered (in memory, then on disk) and applied at its commit"


class Need(Enum):
    """What a transaction (or one of its changes) may need of the route that applies it."""

    COPY_BESIDE = "a table copy runs beside the stream: changes it holds are filtered out"
    HOLD = "a verify asked the worker to hold at a source position"
    SKIP_PENDING = "a skip request is pending: each commit LSN is compared with it"
    FULL_IDENTITY = "an update or delete matched by every column (REPLICA IDENTITY FULL)"
    DEPENDENT_TABLE = "a table others depend on (foreign keys, triggers): order across tables"


#: The capability table: what each applying route carries. The fast and careful paths carry
#: everything; the lane carries none of these (it hands the transaction, or the change, back to
#: the fast path); a transaction applied as it streams is held at its commit, but neither
#: filtered for a copy nor compared with a skip request until its commit LSN is known.
CARRIES: dict[Route, frozenset[Need]] = {
    Route.LANE: frozenset(),
    Route.FAST: frozenset(Need),
    Route.CAREFUL: frozenset(Need),
    Route.EARLY: frozenset({Need.HOLD, Need.FULL_IDENTITY, Need.DEPENDENT_TABLE}),
    Route.BUFFERED: frozenset(Need),
}


def carries(route: Route, needs: frozenset[Need]) -> bool:
    return needs <= CARRIES[route]


class Facts(NamedTuple):
    """What ``plan`` decides from. ``commit_lsn`` is None before it is known (the lane before
    it reads the Begin, a streamed transaction before its commit): the rules by LSN are then
    left to whoever learns it (``floor``). (A named tuple: it is made for every transaction.)"""

    commit_lsn: LSN | None
    applied: LSN                  # the commit LSN of the target's recorded position
    careful_until: LSN            # a redone stretch: up to here, row by row
    needs: frozenset[Need] = frozenset()
    prepared: bool = False        # a two-phase transaction (BEGIN PREPARE)
    skip_matches: bool = False    # the pending skip request names this transaction
    streamed: bool = False        # it arrives in stream blocks before its commit
    fast: bool = True             # the fast path exists (--batch-rows > 0)
    lane: bool = False            # the C lane exists (built, and a fast path)
    early: bool = False           # a streamed transaction may be applied as it streams

    @property
    def floor(self) -> LSN:
        """Transactions committing at or before this take no batched route (the lane is told it
        and hands them back): already applied, or in a stretch redone row by row."""
        return LSN(max(self.applied, self.careful_until))


def already_applied(commit_lsn: LSN, applied: LSN) -> bool:
    """A source transaction committing at ``commit_lsn`` is in the target's recorded position
    (the commit LSN ``applied``): sent again after a restart, it is discarded whole. Positions
    are recorded in commit order, in the target transaction that applied the last of them."""
    return commit_lsn <= applied


def plan(facts: Facts) -> Route:
    """The route of one source transaction (see ``Route``): the first of the lane, the fast and
    the careful path (streamed: applied early, buffered) that exists and carries what it needs.
    Written out rather than looped: it runs for every transaction."""
    commit_lsn = facts.commit_lsn
    if commit_lsn is not None and already_applied(commit_lsn, facts.applied):
        return Route.ALREADY_APPLIED
    if facts.skip_matches:
        return Route.SKIPPED
    if facts.prepared:
        return Route.PREPARED
    needs = facts.needs
    redone = commit_lsn is not None and commit_lsn <= facts.careful_until
    if facts.streamed:
        if facts.early and not redone and (not needs or needs <= CARRIES[Route.EARLY]):
            return Route.EARLY
        return Route.BUFFERED
    if facts.fast and not redone:
        if facts.lane and (not needs or needs <= CARRIES[Route.LANE]):
            return Route.LANE
        if not needs or needs <= CARRIES[Route.FAST]:
            return Route.FAST
    return Route.CAREFUL
