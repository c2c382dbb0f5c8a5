"""Which source server a session reached, and whether the target's progress belongs to its history.

After a failover the source DSN's host list leads the worker to another server: the promoted
standby (the same system identifier, a new timeline), or, by mistake, an old primary that came
back, or another server altogether. Before a session streams anything, it reads on its
replication connection, before START_REPLICATION (``read_lineage``): IDENTIFY_SYSTEM (system
identifier, timeline, WAL position), TIMELINE_HISTORY of that timeline (where each earlier
timeline of its history ended: the switch points), and the slot as that server has it. Then
``check_lineage`` compares them with what the target recorded (``SourceIdentity``: the system
identifier and timeline its progress came from) and its position:

* another system identifier: another server, whose slot is not the one;
* a recorded timeline missing from this server's history (an older timeline than recorded, or
  another branch): not the primary the replica followed;
* a recorded timeline that ended, in this server's history, before the target's position: the
  old primary sent changes its standby never received, and the target holds them;
* a failover since the record, with a slot that is not a synchronised copy (17+): a slot made
  after the promotion, which would skip everything before its creation.

Each stops the worker with a ``LineageError`` that says which, names the positions and what to do;
nothing has been applied by then. Owns those reads and that decision; must never write anything,
on either server (the worker records the identity once the check passed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import psycopg

from ..errors import Cause, SourceError
from ..progress.records import AppliedPosition, SourceIdentity
from ..protocol.lsn import LSN
from ..queries import rows
from .slots import SlotInfo, slot_from_row, slot_query

__all__ = ["LineageError", "SourceLineage", "check_lineage", "missing_slot", "parse_history",
           "read_lineage"]

#: What ends every refusal: the worker applied nothing, and a new copy is the way on.
_NOTHING_APPLIED = "Nothing was applied."
_NEW_REPLICA = "start a new replica from it (applier drop, then applier sync --truncate-target)"


class LineageError(SourceError):
    """The source server or its slot is not the one the target's progress came from."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.NEEDS_OPERATOR)


@dataclass(frozen=True)
class SourceLineage:
    """The source server a replication connection reached, as it says before streaming."""

    system_identifier: str
    timeline: int
    position: LSN                 # its WAL flush position when asked
    ended: Mapping[int, LSN]      # each earlier timeline of its history -> where it ended
    slot: SlotInfo | None         # the slot as this server has it

    @property
    def identity(self) -> SourceIdentity:
        return SourceIdentity(self.system_identifier, self.timeline)


def parse_history(text: str) -> dict[int, LSN]:
    """A timeline history file (``parentTLI<tab>switchpoint<tab>reason`` lines) as the earlier
    timelines and where each ended."""
    ended: dict[int, LSN] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and not line.lstrip().startswith("#"):
            ended[int(fields[0])] = LSN.parse(fields[1])
    return ended


def read_lineage(conn: psycopg.Connection, slot: str) -> SourceLineage:
    """Read the lineage on a replication connection (``replication=database``) that has not
    started streaming."""
    identified = conn.execute("IDENTIFY_SYSTEM").fetchone()
    assert identified is not None
    timeline = int(identified[1])
    ended: dict[int, LSN] = {}
    if timeline > 1:  # timeline 1 has no history file
        history = conn.execute(f"TIMELINE_HISTORY {timeline}").fetchone()
        assert history is not None
        content = history[1]
        ended = parse_history(content.decode() if isinstance(content, bytes) else content)
    found = rows(conn, slot_query(slot))
    return SourceLineage(str(identified[0]), timeline, LSN.parse(identified[2]), ended,
                         slot_from_row(found[0]) if found else None)


def missing_slot(slot: str, applied: AppliedPosition | None) -> LineageError:
    """The error for a slot the target has records of and the source no longer has: a new slot
    would start at the server's current position and skip everything in between."""
    held = (f"the target has applied source transactions up to {applied.end_lsn} from it"
            if applied else "the target has records of it (a worker or sync ran for it)")
    return LineageError(
        f"source: replication slot {slot!r} does not exist on the source server, but {held}. A "
        "new slot would start at the server's current position and skip every change in between, "
        "so none is created (not even with --create-slot). If the source failed over, its standby "
        "held no synchronised copy of the slot (failover slots need PostgreSQL 17+ and a standby "
        "with sync_replication_slots = on: see applier status --standby). To go on, "
        f"{_NEW_REPLICA}. {_NOTHING_APPLIED}")


def check_lineage(slot: str, lineage: SourceLineage, recorded: SourceIdentity | None,
                  applied: AppliedPosition | None) -> str | None:
    """Raise ``LineageError`` when streaming ``slot`` from this server could apply anything out
    of the history the target's progress (``applied``, from the server ``recorded``) belongs
    to; else return a line for the log when the source failed over since the record (None when
    nothing changed, or nothing was recorded to compare with)."""
    if recorded is None or recorded == lineage.identity:
        return None
    here = (f"the server this session reached (system identifier {lineage.system_identifier}, "
            f"timeline {lineage.timeline})")
    if recorded.system_identifier != lineage.system_identifier:
        raise LineageError(
            f"source: {here} is not the one the target's progress for slot {slot!r} came from "
            f"(system identifier {recorded.system_identifier}): its slot of that name is another "
            "slot, whose changes do not follow on from what the target holds. Point --source at "
            f"the original server (or its promoted standby); to replicate from this one, "
            f"{_NEW_REPLICA}. {_NOTHING_APPLIED}")
    switch = lineage.ended.get(recorded.timeline)
    if switch is None:
        raise LineageError(
            f"source: {here} does not have timeline {recorded.timeline}, which the target's "
            f"progress for slot {slot!r} came from, in its history: it is not the primary the "
            "replica followed (an old primary that came back after a failover without being "
            "rebuilt as a standby, or a standby promoted on another branch) and may lack changes "
            f"the target holds. Point --source at the current primary. {_NOTHING_APPLIED}")
    if applied is not None and applied.end_lsn > switch:
        raise LineageError(
            f"source: the target holds source transactions up to {applied.end_lsn} (the end of "
            f"the last one applied, commit {applied.commit_lsn}), but {here} left timeline "
            f"{recorded.timeline} at {switch} when it was promoted: the old primary's "
            f"{int(applied.end_lsn) - int(switch)} bytes of WAL after {switch} never reached it, "
            "and the target holds changes from them that this server never had. Going on would "
            f"mix the two histories. {_NOTHING_APPLIED} The target must be copied again: "
            f"{_NEW_REPLICA}. To prevent it, name the standbys' physical slots in the primary's "
            "synchronized_standby_slots (applier status --standby checks it).")
    if lineage.slot is not None and lineage.slot.synced is False:
        raise LineageError(
            f"source: slot {slot!r} on {here} is not a synchronised copy of the one on the "
            f"primary the target's progress came from (timeline {recorded.timeline}): it was "
            "created on this server after its promotion, starts at its own creation point and "
            f"would skip every change before it. {_NOTHING_APPLIED} To go on, {_NEW_REPLICA}; "
            "for the next failover, make the slot a failover slot (PostgreSQL 17+; applier run "
            "--create-slot and applier sync do) on a standby that synchronises it.")
    position = f"position {applied.end_lsn}" if applied else "empty position"
    return (f"the source failed over since the last session: {here} left timeline "
            f"{recorded.timeline} at {switch}, and the target's {position} is not past it: going "
            f"on from slot {slot!r}" + (" (a synchronised copy)" if lineage.slot and lineage.slot.synced else ""))
