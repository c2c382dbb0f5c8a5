"""Where the C lane sits in the apply stage: the ``lane.LaneHost`` it writes through.

Owns the lane's questions to the apply stage: may it take payloads now, and how far
(``lane_room``); may a table's changes of one kind go into a run of the batch (``lane_run``);
and handing its counts, parts and commits to the fast path. Must never decide which path a
source transaction takes: ``plan.plan`` does, from the facts ``dispatch.Applier`` gives it
(read through ``SeatOwner``), and the lane only takes what that decision allows.
"""

from __future__ import annotations

from typing import Protocol

from ...assembler import TransactionEnd
from ...protocol.lsn import LSN
from ..mapping import MappingError, RelationMapping
from ..plan import Facts, Need, Route, carries, plan
from ..relation_cache import RelationCache
from ..transaction import TargetTransaction
from .batch import KeyRun, Run
from .lane import LaneStamp, RunMaker
from .path import FastPath, LaneRoom

__all__ = ["LaneSeat", "SeatOwner"]

#: Without a change feed: no change table, no stamp.
_NO_FEED: tuple[int, LaneStamp | None] = (0, None)
#: No recorded table has an open run: no bound on the lane's change rows.
_NO_LIMIT = 2**64 - 1


class SeatOwner(Protocol):
    """What the seat reads of the apply stage (``dispatch.Applier``)."""

    tx: TargetTransaction
    relations: RelationCache

    def facts(self, commit_lsn: LSN | None) -> Facts:
        """What the plan decides a transaction's route from, as the stage stands now."""

    @property
    def on_fast_path(self) -> bool:
        """The open source transaction is on the fast path, and nothing diverts its changes."""

    def mapping(self, relation_id: int) -> RelationMapping: ...

    def flush(self) -> None: ...


class LaneSeat:
    """The ``lane.LaneHost`` of an apply stage with a fast path."""

    def __init__(self, owner: SeatOwner, fast: FastPath) -> None:
        self.owner = owner
        self.fast = fast

    @property
    def batch_runs(self) -> dict[int, Run | KeyRun]:
        return self.fast.batch.runs

    def lane_room(self, whole: bool) -> LaneRoom | None:
        """Room for ``whole`` transactions when the plan of one not begun yet is the lane; or,
        inside a fast-path transaction, for its changes when the lane carries what it needs.
        The lane is told the plan's floor: a transaction committing at or before it is handed
        back (its commit LSN is in its Begin, which the lane reads)."""
        owner = self.owner
        tx = owner.tx
        facts = owner.facts(None)
        if whole:
            if tx.current is not None or plan(facts) is not Route.LANE:
                return None
        elif not owner.on_fast_path or tx.current is None or not carries(Route.LANE, facts.needs):
            return None
        return self.fast.room(whole, facts.floor)

    def lane_run(self, relation_id: int, kind: str, make_run: RunMaker) -> bool:
        """A run for the table's changes of one kind, when the lane carries what they need (see
        ``plan.Need``). False: the ordinary path takes the change (and reports what is wrong with
        the relation, if anything)."""
        owner = self.owner
        if relation_id not in owner.relations:
            return False
        try:
            mapping = owner.mapping(relation_id)
        except MappingError:
            return False
        needs = set()
        if not mapping.table.independent:
            needs.add(Need.DEPENDENT_TABLE)
        if kind != "I" and (not mapping.key_positions or mapping.full_identity):
            needs.add(Need.FULL_IDENTITY)
        if not carries(Route.LANE, frozenset(needs)):
            return False
        self.fast.open_run(mapping, make_run(len(mapping.target_columns), mapping.key_positions,
                                                mapping.feed is not None),
                           kind)
        return True

    def lane_stamp(self) -> tuple[int, LaneStamp | None]:
        feed = self.owner.tx.feed
        if feed is None:
            return _NO_FEED
        recorded = self.fast.batch.recorded_runs()
        until = min((int(t.newest.to_lsn) for t in recorded), default=_NO_LIMIT)
        return until, feed.lane_stamp(recorded)

    def lane_seq(self, seq: int) -> None:
        feed = self.owner.tx.feed
        if feed is not None:
            feed.stamp().seq = seq

    def lane_took(self, inserts: int, updates: int, deletes: int, value_bytes: int,
                  transactions: int, last: TransactionEnd | None) -> None:
        self.fast.took(inserts, updates, deletes, value_bytes, transactions, last)

    @property
    def records_commits(self) -> bool:
        return self.owner.tx.feed is not None

    def lane_commits(self, commit_lsns: bytes, end_lsns: bytes) -> None:
        feed = self.owner.tx.feed
        assert feed is not None
        self.fast.batch.add_commits(feed.slot, commit_lsns, end_lsns)

    def lane_due(self) -> None:
        self.fast.due()

    def send_part(self) -> None:
        self.fast.send_part()

    def flush(self) -> None:
        self.owner.flush()
