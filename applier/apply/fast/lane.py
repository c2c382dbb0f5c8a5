"""The lane: plain transactions of row changes, from the received payloads straight into the batch.

Owns deciding when the C lane (``_lane.Lane``) may take payloads and handing what it took to the
sink: the changes it wrote into the batch's open runs (``batch.Run``: inserts as COPY text, or
COPY binary when the source sent binary values; ``batch.KeyRun``: updates of every column or
deletes, by key, every change: the batch folds them), the
transactions it saw commit and the last of them (the progress row names it), the change feed's
rows of applier.change_commits of those that wrote change rows, a part that is due,
a batch that is full. A stream of small transactions (pgbench's, single-row inserts) or one large
one is then mostly C: no message object, no call per change. Whatever the lane does not take
(any other message, a table it may not write, an update of part of a row or of its key, a row
whose values are not all in its run's format, anything malformed) it leaves where it stopped,
and the ordinary path (decoder, assembler, apply) takes it, so every check and error stays there.

A table the change feed records gets runs that also keep each change's change row. The rows
carry their transaction's stamp and order: the C lane reads the stamp from a Begin it takes;
for the changes of a transaction open on the ordinary path, ``LaneHost.lane_stamp`` gives it,
and the order reached goes back to it (``lane_seq``) whenever that path takes the transaction on.

Must never hold a transaction across a return: one still open when the C lane stops is handed
back (its Begin fed to the assembler), so the ordinary path finishes it and a batch is never
committed in the middle of a source transaction. Without the C accelerator there is no lane and
the ordinary path takes everything.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Protocol

from ...assembler import TransactionEnd
from ...implementation import accelerator
from ...protocol.decoder import decode
from ...protocol.messages import ROW_CHANGE_TYPES, Commit, MessageType
from .batch import KeyRun, Run
from .path import LaneRoom

__all__ = ["Lane", "LaneHost", "RunMaker", "LaneStamp", "core", "lane_for"]

#: A run made from (columns, key positions, whether the change feed records the table).
RunMaker = Callable[[int, tuple[int, ...], bool], "Run | KeyRun"]
#: A transaction's change-row stamp: commit LSN, commit time (microseconds since 2000-01-01; None
#: while the commit is not known), xid, change rows so far.
LaneStamp = tuple[int, int | None, int, int]

_BEGIN = int(MessageType.BEGIN)


class LaneHost(Protocol):
    """What the lane needs of the apply stage (``fast.seat.LaneSeat``)."""

    @property
    def batch_runs(self) -> dict[int, Run | KeyRun]:
        """The batch's open runs by relation id (the lane writes into them; changed in place only)."""

    def lane_room(self, whole: bool) -> LaneRoom | None:
        """May the lane take payloads now, and how far. ``whole``: it would take whole
        transactions; else the changes of the open one."""

    def lane_run(self, relation_id: int, kind: str, make_run: RunMaker) -> bool:
        """Give the relation's changes of one kind ("I", "U" or "D") a run in the batch, made by
        ``make_run(columns, key positions, recorded)``, if its table can take them."""

    def lane_stamp(self) -> tuple[int, LaneStamp | None]:
        """The change feed: the commit LSN below which every change table has its partition, and
        the stamp (``LaneStamp``) of the open transaction, or None when its change rows are not the
        lane's to write."""

    def lane_seq(self, seq: int) -> None:
        """The open transaction's change rows so far, the lane's included."""

    def lane_took(self, inserts: int, updates: int, deletes: int, value_bytes: int,
                  transactions: int, last: TransactionEnd | None) -> None:
        """Count what the lane took."""

    @property
    def records_commits(self) -> bool:
        """The change feed is on: keep the commit and end LSN of each transaction that wrote
        change rows (applier.change_commits)."""

    def lane_commits(self, commit_lsns: bytes, end_lsns: bytes) -> None:
        """The commit and end LSNs (array elements, ``progress.feed.lsn_element``) of the whole
        transactions the lane took that wrote change rows."""

    def lane_due(self) -> None:
        """After the lane's last commit, no transaction open: commit the batch if its time is up."""

    def send_part(self) -> None:
        """Send what the batch holds ahead of its commit."""

    def flush(self) -> None:
        """Commit the batch."""


class Lane:
    def __init__(self, module: ModuleType, sink: LaneHost) -> None:
        self._sink = sink
        self._lane = module.Lane(sink.batch_runs)
        self._part, self._limit, self._no_run = module.PART, module.LIMIT, module.NO_RUN
        self._lane.record_commits = sink.records_commits
        # A run for each kind of change, made from (columns, key positions), in the format of
        # the values of the change that asked for it (``Lane.binary``).
        lane = self._lane
        self._makers: dict[str, RunMaker] = {
            "I": lambda columns, keys, feed: module.Run(columns, lane.binary, feed),
            "U": lambda columns, keys, feed: module.KeyRun(columns, keys, True, lane.binary, feed),
            "D": lambda columns, keys, feed: module.KeyRun(columns, keys, False, lane.binary, feed),
        }

    def take(self, payloads: list[bytes], start: int, *,
             hand_back: Callable[[bytes], None] | None = None, streamed: bool = False) -> int:
        """Take payloads from ``start`` on; the index of the first left for the ordinary path.

        ``hand_back``: no transaction is open, so take whole ones (Begin .. Commit); one still
        open when the lane stops goes to ``hand_back`` (its Begin payload) and the ordinary path
        takes it on. None: the sink is inside a transaction (a plain one received, or a streamed
        one replayed from its stream blocks: ``streamed``, whose changes carry their xid), so
        take only its row changes."""
        kind = payloads[start][0]
        whole = hand_back is not None
        if kind not in ROW_CHANGE_TYPES and (kind != _BEGIN or not whole):
            return start
        lane, sink = self._lane, self._sink
        lane.streamed = streamed
        index = start
        while index < len(payloads):
            room = sink.lane_room(whole)
            if room is not None and min(room.part_rows, room.insert_part_rows) <= 0:
                # A part came due outside this loop: the core checks its room only after taking
                # a change, and the changes of a transaction taken from inside (with the room of
                # one open transaction) or on the ordinary path may have filled the part. Send
                # it before taking more, so that a part never grows past its rows.
                sink.send_part()
                room = sink.lane_room(whole)
            if room is None:
                return index
            lane.feed_until, stamp = sink.lane_stamp()
            if not whole:  # whole: each Begin taken stamps its transaction
                if stamp is None:
                    lane.set_stamp(None)
                else:
                    lane.set_stamp(*stamp)
            lane.whole = whole
            lane.after, lane.part_room, lane.insert_part_room = room.after, room.part_rows, room.insert_part_rows
            lane.rows_room, lane.bytes_room = room.rows, room.bytes
            index = lane.take(payloads, index)
            last = None
            if lane.transactions:
                commit = decode(lane.commit)
                assert isinstance(commit, Commit)
                last = TransactionEnd(lane.xid, commit.commit_lsn, commit.end_lsn, commit.commit_time,
                                      streamed=False, gid=None)
            sink.lane_took(lane.inserts, lane.updates, lane.deletes, lane.bytes, lane.transactions, last)
            if lane.commit_rows:
                sink.lane_commits(bytes(lane.commit_lsns), bytes(lane.end_lsns))
            if lane.begin is not None:
                assert hand_back is not None
                hand_back(lane.begin)  # that transaction continues on the ordinary path
                sink.lane_seq(lane.seq)
                whole = False
            elif not whole and stamp is not None:
                sink.lane_seq(lane.seq)
            elif lane.transactions:
                sink.lane_due()
            reason = lane.reason  # why the C take stopped: the module's own constants
            if reason == self._part:
                sink.send_part()
            elif reason == self._limit:
                sink.flush()
            elif reason != self._no_run or not sink.lane_run(lane.relation, chr(lane.kind),
                                                        self._makers[chr(lane.kind)]):
                return index
        return index


def core() -> ModuleType | None:
    """The C core (``_lane``), or None when it is not built or ``APPLIER_PURE_PYTHON=1`` asks for
    the ordinary path alone (``implementation.accelerator``)."""
    return accelerator("apply._lane")


def lane_for(sink: LaneHost) -> Lane | None:
    """The lane over ``sink``'s batch, or None without its C core (see ``core``)."""
    module = core()
    return None if module is None else Lane(module, sink)
