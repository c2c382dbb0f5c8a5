"""Fault injection for crash tests: make the worker die at a named point, as a power cut would.

``APPLIER_FAULT=<point>[:<n>]`` in the worker's environment makes it SIGKILL itself the n-th time
(default: the first) it reaches ``<point>``. Unset, ``hit`` is one string comparison. The points
sit exactly where a crash is most dangerous: between a durable target step and the next one, or
between a durable step and the feedback that tells the source about it.

Points: ``after_prepare`` (target PREPARE TRANSACTION done, its progress not yet recorded),
``after_commit_prepared`` (target COMMIT PREPARED done, its progress not yet recorded),
``after_rollback_prepared`` (the same for ROLLBACK PREPARED),
``before_feedback`` (a target transaction committed, the source not yet told),
``two_phase_change`` (each change applied or deferred inside a prepared transaction),
``after_skip`` (a skipped transaction recorded, the source not yet told).
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["hit"]

log = logging.getLogger(__name__)

_point, _, _count = os.environ.get("APPLIER_FAULT", "").partition(":")
_remaining = int(_count or 1) if _point else 0


def hit(point: str) -> None:
    """Die here if APPLIER_FAULT names this point and its count is reached."""
    global _remaining
    if point != _point:
        return
    _remaining -= 1
    if _remaining == 0:
        log.critical("APPLIER_FAULT: killing the worker at %s", point)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
