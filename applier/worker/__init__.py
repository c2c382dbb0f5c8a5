"""The replication worker (``applier run``): its life (``lifecycle``), one session at a time
(``session``), and the stream loop of a session (``loop``).
"""

from .lifecycle import Worker, WorkerFailed, run

__all__ = ["Worker", "WorkerFailed", "run"]
