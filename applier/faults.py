"""Named failure points for crash tests: make the worker (or ``verify --repair``) die at one, as a
power cut would.

``APPLIER_FAULT=<point>[:<n>]`` in the worker's environment makes it SIGKILL itself the n-th time
(default: the first) it reaches ``<point>``. Unset, ``hit`` is one comparison. The points sit
exactly where a crash is most dangerous: between a durable target step and the next one, or
between a durable step and the feedback that tells the source about it. Owns the names of the
points and the kill; must never change what the worker does otherwise.
"""

from __future__ import annotations

import logging
import os
import signal
from enum import StrEnum

__all__ = ["FailPoint", "arm", "hit"]

log = logging.getLogger(__name__)


class FailPoint(StrEnum):
    """Where ``APPLIER_FAULT`` may kill the worker (the value is the name the variable uses)."""

    #: Target PREPARE TRANSACTION done, its position not yet recorded.
    AFTER_PREPARE = "after_prepare"
    #: Target COMMIT PREPARED done, its position not yet recorded.
    AFTER_COMMIT_PREPARED = "after_commit_prepared"
    #: Target ROLLBACK PREPARED done, its position not yet recorded.
    AFTER_ROLLBACK_PREPARED = "after_rollback_prepared"
    #: A target transaction committed, the source not yet told.
    BEFORE_FEEDBACK = "before_feedback"
    #: Each change applied or deferred inside a prepared transaction.
    TWO_PHASE_CHANGE = "two_phase_change"
    #: A skipped transaction recorded, the source not yet told.
    AFTER_SKIP = "after_skip"
    #: The worker answered that it holds at a verify's position (the command reads the target).
    AFTER_HOLD_ACK = "after_hold_ack"
    #: A table to copy again beside the stream is emptied and its snapshot taken, not copied yet.
    RESYNC_COPYING = "resync_copying"
    #: verify --repair: the worker holds at the repair's position, nothing written yet.
    REPAIR_HELD = "repair_held"
    #: verify --repair: the repaired rows committed, the worker not yet let go.
    AFTER_REPAIR = "after_repair"


_point = ""
_remaining = 0


def arm() -> None:
    """Read ``APPLIER_FAULT`` (done at import; again by a process forked to become a worker,
    which the tests do instead of starting a new interpreter)."""
    global _point, _remaining
    point, _, count = os.environ.get("APPLIER_FAULT", "").partition(":")
    _point, _remaining = point, (int(count or 1) if point else 0)


arm()


def hit(point: FailPoint) -> None:
    """Die here if APPLIER_FAULT names this point and its count is reached."""
    global _remaining
    if point != _point:
        return
    _remaining -= 1
    if _remaining == 0:
        log.critical("APPLIER_FAULT: killing the worker at %s", point)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
